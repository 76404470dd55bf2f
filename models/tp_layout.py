"""The arithmetic of a tensor-parallel layout: which dimensions split, repeat or pad (no JAX).

Kept free of JAX so that ``jaxpaged.config`` can validate ``tensor_parallel_size`` against the
HF config without importing it; ``models.sharding`` explains the layout itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def _config_value(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, dict):
        value = config.get(name, default)
    else:
        value = getattr(config, name, default)
    return default if value is None else value


@dataclasses.dataclass(frozen=True)
class TPLayout:
    """How one model's dimensions split over ``tensor_parallel_size`` devices.

    Sizes are the checkpoint's (HF config). Construction validates the layout.

    Raises:
        ValueError: naming the dimension, its size and ``tensor_parallel_size`` when a dimension
            can neither be split evenly nor padded or replicated: ``num_attention_heads`` must
            divide by it; ``num_key_value_heads`` must divide by it or divide it.
    """

    tensor_parallel_size: int
    num_heads: int  # Hq
    num_kv_heads: int  # Hkv of the checkpoint
    intermediate_size: int
    vocab_size: int

    def __post_init__(self):
        tp = self.tensor_parallel_size
        if tp < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {tp}")
        if self.num_heads % tp:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be divisible by "
                f"tensor_parallel_size ({tp}): attention heads are split whole across devices"
            )
        hkv = self.num_kv_heads
        if hkv % tp and tp % hkv:
            raise ValueError(
                f"num_key_value_heads ({hkv}) must be divisible by tensor_parallel_size ({tp}), "
                f"or divide it (KV heads are then replicated {tp} // {hkv} times)"
            )

    @classmethod
    def from_hf_config(cls, config: Any, tensor_parallel_size: int) -> TPLayout:
        """Layout of an HF config (a ``PretrainedConfig`` or its ``config.json`` dict).

        GPT-2 and BLOOM ``config.json`` files name the head count ``n_head`` (and GPT-2 the
        hidden size ``n_embd``); their MLP width is ``n_inner`` or ``4 * hidden``.
        """
        num_heads = int(
            _config_value(config, "num_attention_heads") or _config_value(config, "n_head")
        )
        hidden = _config_value(config, "hidden_size") or _config_value(config, "n_embd")
        intermediate = _config_value(config, "intermediate_size") or _config_value(
            config, "n_inner"
        )
        return cls(
            tensor_parallel_size=int(tensor_parallel_size),
            num_heads=num_heads,
            num_kv_heads=int(_config_value(config, "num_key_value_heads", num_heads)),
            intermediate_size=int(intermediate or 4 * int(hidden)),
            vocab_size=int(_config_value(config, "vocab_size")),
        )

    @property
    def kv_head_replicas(self) -> int:
        """``r``: copies of each KV head (1 unless ``Hkv < tp``)."""
        return max(1, self.tensor_parallel_size // self.num_kv_heads)

    @property
    def num_kv_heads_physical(self) -> int:
        """KV heads of the sharded model and its KV cache: ``Hkv * r``."""
        return self.num_kv_heads * self.kv_head_replicas

    @property
    def intermediate_size_padded(self) -> int:
        """Intermediate size rounded up to a multiple of ``tensor_parallel_size``."""
        tp = self.tensor_parallel_size
        return -(-self.intermediate_size // tp) * tp

    @property
    def shard_vocab(self) -> bool:
        """Whether embeddings and LM head split over the vocab (else they are replicated)."""
        return self.vocab_size % self.tensor_parallel_size == 0
