"""Hugging Face ``architectures[0]`` name -> jaxpaged model class.

Our families are listed here; a user's out-of-tree model joins with :func:`register_model`
(``jaxpaged.ModelRegistry.register_model``, vLLM's name), given as the class or, imported on
first use, as ``"module:ClassName"``. The other two parts of a model, its parameter-name map and
its sharding rules, follow from its parameter paths (``models.weights.hf_names``,
``models.sharding.param_partition_spec``; ``docs/model_protocol.md``).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

from models.checkpoint_views import bloom_view, gpt2_view
from models.gpt2 import BloomForCausalLM, GPT2LMHeadModel
from models.llama import (
    Gemma2ForCausalLM,
    LlamaForCausalLM,
    MistralForCausalLM,
    MixtralForCausalLM,
    Phi3ForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)

_MODEL_CLASSES: dict[str, type | str] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "BloomForCausalLM": BloomForCausalLM,
}

# Families whose checkpoint tensors differ from the standard layout (models.checkpoint_views).
_CHECKPOINT_VIEWS: dict[str, Callable] = {
    "GPT2LMHeadModel": gpt2_view,
    "BloomForCausalLM": bloom_view,
}


def register_model(
    architecture: str, model_class: type | str, *, view: Callable | None = None
) -> None:
    """Serve checkpoints whose ``config.json`` names ``architecture`` with ``model_class``.

    Args:
        architecture: the HF ``architectures[0]`` name, e.g. ``"MyLlamaForCausalLM"``.
        model_class: an ``nnx.Module`` class following ``docs/model_protocol.md``, or
            ``"package.module:ClassName"``, imported when a model of it is first built.
        view: ``(reader, config=...) -> reader`` presenting a checkpoint whose tensors differ
            from the standard layout (``models.checkpoint_views``); None: the standard layout.

    A name registered again replaces the earlier class (our own families too, as in vLLM).

    Raises:
        ValueError: an empty architecture name, or a ``model_class`` that is neither a class
            nor a ``"module:ClassName"`` string.
    """
    if not isinstance(architecture, str) or not architecture:
        raise ValueError(f"architecture must be a non-empty string, got {architecture!r}")
    lazy = isinstance(model_class, str) and model_class.count(":") == 1
    if not (isinstance(model_class, type) or lazy):
        raise ValueError(
            f"model_class must be a class or a 'module:ClassName' string, got {model_class!r}"
        )
    _MODEL_CLASSES[architecture] = model_class
    _CHECKPOINT_VIEWS.pop(architecture, None)
    if view is not None:
        _CHECKPOINT_VIEWS[architecture] = view


def _resolve(architecture: str) -> type:
    """The class registered for ``architecture``, importing a ``"module:ClassName"`` entry."""
    entry = _MODEL_CLASSES[architecture]
    if isinstance(entry, type):
        return entry
    module_name, class_name = entry.split(":")
    try:
        model_class = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"architecture {architecture!r} is registered as {entry!r}, which cannot be "
            f"imported: {e}"
        ) from e
    _MODEL_CLASSES[architecture] = model_class
    return model_class


def supported_architectures() -> list[str]:
    """The HF architecture names jaxpaged can load, sorted."""
    return sorted(_MODEL_CLASSES)


def get_model_class(hf_config: Any) -> type:
    """The model class for ``hf_config.architectures[0]``.

    Raises:
        ValueError: the config names no architecture, or one that is not supported (the message
            names it and lists the supported ones).
    """
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        raise ValueError(
            f"config has no 'architectures' entry; supported: {supported_architectures()}"
        )
    name = architectures[0]
    if name not in _MODEL_CLASSES:
        raise ValueError(
            f"architecture {name!r} is not supported; supported: {supported_architectures()}"
        )
    return _resolve(name)


def checkpoint_view(hf_config: Any) -> Callable | None:
    """``reader -> reader`` presenting the checkpoint of ``hf_config``'s architecture in the
    standard layout the loaders read (``models.checkpoint_views``), or None when it already is.
    """
    architectures = getattr(hf_config, "architectures", None) or [None]
    view = _CHECKPOINT_VIEWS.get(architectures[0])
    return None if view is None else functools.partial(view, config=hf_config)
