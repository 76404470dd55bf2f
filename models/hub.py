"""A model name that is not a local directory: a Hugging Face Hub id, resolved through its cache.

As vLLM does (``vllm/model_executor/model_loader/weight_utils.py``), the id is handed to
``huggingface_hub.snapshot_download``, which returns the local snapshot directory
(``<cache>/models--org--name/snapshots/<commit>``), downloading what is missing unless offline.
Only what jaxpaged reads is fetched: safetensors weights, the JSON files (config, index,
tokenizer, generation config) and tokenizer vocabularies (``*.model``, ``*.txt``,
``*.tiktoken``); ``pytorch_model.bin`` never is.

Where and how is ``huggingface_hub``'s own configuration, read from the environment when that
library is imported: the cache is ``$HF_HUB_CACHE`` (default ``$HF_HOME/hub``,
``~/.cache/huggingface/hub``), ``HF_HUB_OFFLINE=1`` forbids network access, ``HF_TOKEN``
authenticates. ``download_dir`` replaces the cache directory for one call (vLLM's
``--download-dir``), ``revision`` picks a branch, tag or commit (``--revision``; ``main`` by
default).
"""

from __future__ import annotations

import glob
import os

# What jaxpaged reads from a checkpoint: weights, configs, tokenizer files.
ALLOW_PATTERNS = ("*.safetensors", "*.json", "*.model", "*.txt", "*.tiktoken")


def resolve_model_path(
    model: str,
    *,
    revision: str | None = None,
    download_dir: str | None = None,
    require_weights: bool = True,
) -> str:
    """The local directory of ``model``: ``model`` itself when it is a directory, else the
    snapshot of the Hugging Face Hub id ``model`` in the cache (downloaded when missing and
    online).

    Args:
        model: a local directory, or a Hub id ``"org/name"`` (or ``"name"``).
        revision: branch, tag or commit hash of the Hub repository; None means ``main``.
            Ignored for a local directory.
        download_dir: cache directory for Hub downloads; None means huggingface_hub's cache
            (``HF_HUB_CACHE`` / ``HF_HOME``).
        require_weights: the snapshot must hold ``*.safetensors`` files (False for
            ``load_format="dummy"``, which needs only ``config.json``).

    Returns:
        An existing local directory.

    Raises:
        ValueError: ``model`` is neither a directory nor a valid Hub id, the Hub id cannot be
            resolved (the message gives the id, the revision, the cache directory, whether
            huggingface_hub is offline, and the underlying error), or the snapshot holds no
            safetensors weights when ``require_weights``.
    """
    if os.path.isdir(model):
        return model
    import httpx
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id  # a submodule: `import huggingface_hub`
    # alone does not load it (transformers used to, before jaxpaged imported it lazily)

    cache_dir = download_dir or constants.HF_HUB_CACHE
    offline = bool(constants.HF_HUB_OFFLINE)
    tried = (
        f"revision {revision or 'main'!r}, cache {cache_dir}, "
        f"{'offline (HF_HUB_OFFLINE=1)' if offline else 'online'}"
    )
    try:
        validate_repo_id(model)
    except HFValidationError as error:
        raise ValueError(
            f"model {model!r} does not exist as a local directory and is not a valid Hugging "
            f"Face Hub id ('org/name'): {error}"
        ) from error
    try:
        path = huggingface_hub.snapshot_download(
            model,
            revision=revision,
            cache_dir=download_dir,
            allow_patterns=list(ALLOW_PATTERNS),
            local_files_only=offline,
        )
    except (OSError, httpx.HTTPError) as error:  # huggingface_hub's errors are both kinds
        raise ValueError(
            f"model {model!r} does not exist as a local directory, and resolving it as a "
            f"Hugging Face Hub id failed ({tried}): {type(error).__name__}: {error}"
        ) from error
    if require_weights and not glob.glob(os.path.join(path, "*.safetensors")):
        raise ValueError(
            f"Hugging Face Hub model {model!r} ({tried}) has no *.safetensors weights in "
            f"{path}; jaxpaged loads safetensors only (use load_format='dummy' for random "
            "weights of its config)"
        )
    return path
