"""Hugging Face ``architectures[0]`` name -> jaxpaged model class."""

from __future__ import annotations

import functools
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

_MODEL_CLASSES: dict[str, type] = {
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
    return _MODEL_CLASSES[name]


def checkpoint_view(hf_config: Any) -> Callable | None:
    """``reader -> reader`` presenting the checkpoint of ``hf_config``'s architecture in the
    standard layout the loaders read (``models.checkpoint_views``), or None when it already is.
    """
    architectures = getattr(hf_config, "architectures", None) or [None]
    view = _CHECKPOINT_VIEWS.get(architectures[0])
    return None if view is None else functools.partial(view, config=hf_config)
