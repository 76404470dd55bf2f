"""Checks of an HF config's shapes before any array is built: a config with impossible sizes
(negative, zero, heads that do not divide) is refused by name instead of failing deep inside
model construction (a ZeroDivisionError, a JAX shape error), and a config with more layers
than its checkpoint holds is refused before the model is built at all."""

from __future__ import annotations

import re
from collections.abc import Iterable
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


# The first numbered component of a tensor name and what precedes it: "model.layers.3.mlp..."
# -> ("model.layers", 3); the layer stack of every family (GPT-2's "h.3.", BLOOM's too).
_FIRST_INDEX = re.compile(r"^(.*?)\.(\d+)\.")


def check_layer_count(tensor_names: Iterable[str], hf_config: Any, model_dir: str) -> None:
    """Refuse a config whose ``num_hidden_layers`` exceeds every numbered stack of the
    checkpoint's tensor names (the first numbered component of a name: ``model.layers.N``,
    GPT-2's ``h.N``; experts are numbered inside a layer), before the model is built: building
    one with ``num_hidden_layers: 100000`` took 180 s and 1.7 GB before its first missing
    tensor was found. Fewer layers in the config than in the checkpoint is left to the loaders
    (they read the layers the config asks for).

    Raises:
        ValueError: naming ``config.json``, the count and what the checkpoint holds.
    """
    configs = [hf_config, getattr(hf_config, "text_config", None)]
    wanted = next(
        (
            value
            for config in configs
            if isinstance(value := getattr(config, "num_hidden_layers", None), int)
        ),
        None,
    )
    if wanted is None:
        return
    stacks: dict[str, int] = {}
    for name in tensor_names:
        match = _FIRST_INDEX.match(name)
        if match is not None:
            prefix, index = match.group(1), int(match.group(2))
            stacks[prefix] = max(stacks.get(prefix, 0), index + 1)
    held = max(stacks.values(), default=0)
    if wanted > held:
        prefix = max(stacks, key=stacks.get) if stacks else None
        holds = f"{held} ({prefix}.0 to {prefix}.{held - 1})" if prefix else "no numbered layers"
        raise ValueError(
            f"{model_dir}/config.json: num_hidden_layers is {wanted}, but the checkpoint's "
            f"tensors hold at most {holds}: the config and the weights disagree"
        )
