"""Hugging Face ``architectures[0]`` name -> jaxpaged model class."""

from __future__ import annotations

from typing import Any

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
