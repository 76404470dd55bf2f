"""Checks of an HF config's shapes before any array is built: a config with impossible sizes
(negative, zero, heads that do not divide) is refused by name instead of failing deep inside
model construction (a ZeroDivisionError, a JAX shape error)."""

from __future__ import annotations

from typing import Any

# Config fields that size the model: each must be a positive integer when present.
_SIZE_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
)  # fmt: skip


def check_config_shapes(hf_config: Any, config_path: str) -> None:
    """Refuse impossible shapes before any array is built: a size that is not a positive
    integer, query heads that KV heads do not divide, and (without ``head_dim``) a hidden size
    the heads do not divide. Nested text configs (``text_config``) are checked too.

    Raises:
        ValueError: naming ``config_path``, the field, the rule and the value.
    """
    configs = [hf_config]
    text_config = getattr(hf_config, "text_config", None)
    if text_config is not None and text_config is not hf_config:
        configs.append(text_config)
    for config in configs:
        for name in _SIZE_FIELDS:
            value = getattr(config, name, None)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{config_path}: {name} must be a positive integer, got {value!r}")
        heads = getattr(config, "num_attention_heads", None)
        kv_heads = getattr(config, "num_key_value_heads", None)
        if heads and kv_heads and heads % kv_heads:
            raise ValueError(
                f"{config_path}: num_attention_heads ({heads}) must be a multiple of "
                f"num_key_value_heads ({kv_heads})"
            )
        hidden = getattr(config, "hidden_size", None)
        if heads and hidden and getattr(config, "head_dim", None) is None and hidden % heads:
            raise ValueError(
                f"{config_path}: num_attention_heads ({heads}) must divide hidden_size "
                f"({hidden}) when head_dim is not given"
            )
