"""KV cache on the device: how many blocks fit, and allocating them.

Sizing follows vLLM (DESIGN.md §3): after the weights are loaded and one profiling step at the
full token budget has run, the KV cache gets ``gpu_memory_utilization * device_limit - peak``
bytes. ``kv_cache_memory_bytes`` replaces that rule (the default on CPU, where there is no device
limit to read), and ``num_gpu_blocks_override`` forces a block count.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import kv_cache_shape

DEFAULT_CPU_KV_CACHE_BYTES = 256 * 1024**2


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """Per-layer geometry of the cache: one K and one V array per layer."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: jnp.dtype

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block occupies across all layers, K and V together."""
        per_layer = self.block_size * self.num_kv_heads * self.head_dim * 2
        return per_layer * self.num_layers * jnp.dtype(self.dtype).itemsize


def num_blocks_for_budget(spec: KVCacheSpec, budget_bytes: int, *, cap: int) -> int:
    """Blocks that fit in ``budget_bytes``, at most ``cap``.

    Raises:
        ValueError: if not even one block fits (naming the budget and the block size in bytes).
    """
    num_blocks = min(budget_bytes // spec.bytes_per_block, cap)
    if num_blocks < 1:
        raise ValueError(
            f"KV cache budget of {budget_bytes} bytes holds no block of "
            f"{spec.bytes_per_block} bytes; raise gpu_memory_utilization or kv_cache_memory_bytes"
        )
    return int(num_blocks)


def device_kv_budget(gpu_memory_utilization: float, device: jax.Device) -> int | None:
    """Bytes left for the KV cache on ``device`` after weights and the profiling step, or None.

    None means the device reports no memory statistics (CPU): the caller uses a fixed budget.
    """
    stats = device.memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    peak = stats.get("peak_bytes_in_use", stats.get("bytes_in_use", 0))
    return int(gpu_memory_utilization * stats["bytes_limit"]) - int(peak)


def allocate_kv_caches(
    spec: KVCacheSpec, num_blocks: int, *, fill_value: float = 0.0, sharding=None
):
    """Allocate ``num_layers`` pairs of K/V caches, each ``[num_blocks, block_size, Hkv, D]``.

    ``fill_value=nan`` is what tests use to prove that no kernel reads stale slots. ``sharding``
    (tensor parallelism, ``models.sharding.kv_cache_sharding``): each device allocates only its
    own heads.
    """
    shape = kv_cache_shape(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    placement = {} if sharding is None else {"out_shardings": sharding}
    make = jax.jit(lambda: jnp.full(shape, fill_value, spec.dtype), **placement)
    return [(make(), make()) for _ in range(spec.num_layers)]
