"""The ``MARKER`` file of a ``jaxpaged convert`` directory, and the quantization it records.

No JAX here (as ``models.quantization.config``): ``jaxpaged.config`` reads a converted
directory's quantization at argument time. The parameters themselves are
``models.orbax_checkpoint``'s.

The marker records ``quantization`` (vLLM's method name, or None) and ``quantization_load_format``
(the ``load_format`` the parameters were quantized with: ``bitsandbytes`` quantizes at load only
with it); with the ``quantization_config`` of the copied ``config.json`` (pre-quantized
checkpoints keep theirs) they give back the exact ``QuantizationConfig`` the parameters were made
with, and ``quantized_layers`` lists, per quantized projection, the tensors attached to it in
order (``models.quantized_linear.QuantizedLinear.set_tensors``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from models.quantization.config import QuantizationConfig, resolve_quantization

MARKER = "jaxpaged_checkpoint.json"
FORMAT = "jaxpaged-orbax"
FORMAT_VERSION = 1


def is_orbax_checkpoint(model_dir: str) -> bool:
    """True if ``model_dir`` was written by ``save_checkpoint`` (it holds ``MARKER``)."""
    return os.path.isfile(os.path.join(model_dir, MARKER))


def read_metadata(model_dir: str) -> dict:
    """The ``MARKER`` file of a converted directory.

    Raises:
        ValueError: the file is missing, not JSON, or of another format or version.
    """
    path = os.path.join(model_dir, MARKER)
    if not os.path.isfile(path):
        raise ValueError(f"{model_dir} is not a jaxpaged orbax checkpoint (no {MARKER})")
    with open(path) as f:
        try:
            meta = json.load(f)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not JSON ({error}); convert the model again") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path} holds no JSON object; convert the model again")
    if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: format {meta.get('format')!r} version {meta.get('version')!r} is not "
            f"{FORMAT!r} version {FORMAT_VERSION}; convert the model again"
        )
    return meta


def checkpoint_quantization(
    model_dir: str,
    meta: Mapping[str, Any],
    hf_config_json: Mapping[str, Any],
    quantization: str | None = None,
) -> QuantizationConfig | None:
    """The quantization a converted directory was written with.

    Args:
        model_dir: the directory (for messages).
        meta: its ``read_metadata``.
        hf_config_json: its ``config.json``.
        quantization: the ``quantization=`` argument; None takes the recorded method, anything
            else must equal it.

    Raises:
        ValueError: ``quantization`` names another method than the recorded one.
    """
    stored = meta.get("quantization")
    if quantization is not None and quantization != stored:
        raise ValueError(
            f"quantization={quantization!r} does not match the orbax checkpoint {model_dir}, "
            f"converted with quantization={stored!r}; leave quantization unset or convert the "
            f"model again with --quantization {quantization}"
        )
    if stored is None:
        return None
    load_format = meta.get("quantization_load_format") or "auto"
    return resolve_quantization(stored, hf_config_json.get("quantization_config"), load_format)


def check_shard_count(model_dir: str, meta: Mapping[str, Any], tensor_parallel_size: int) -> None:
    """Raise unless the converted directory was written for ``tensor_parallel_size`` devices.

    Raises:
        ValueError: the recorded ``tensor_parallel_size`` differs (both named, and what to do).
    """
    if meta["tensor_parallel_size"] != tensor_parallel_size:
        raise ValueError(
            f"{model_dir} was converted for tensor_parallel_size="
            f"{meta['tensor_parallel_size']}, got tensor_parallel_size={tensor_parallel_size}; "
            f"convert it again with --tensor-parallel-size {tensor_parallel_size}"
        )
