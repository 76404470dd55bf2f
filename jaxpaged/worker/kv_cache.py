"""KV cache on the device: how many blocks fit, and allocating them.

Sizing follows vLLM (docs/architecture.md, "KV cache sizing"): after the weights are loaded and one profiling step at the
full token budget has run, the KV cache gets ``gpu_memory_utilization * device_memory - peak``
bytes (capped by the JAX allocator's pool; see ``MemoryBudget``). ``kv_cache_memory_bytes``
replaces that rule (the default on CPU, where there is no device limit to read), and
``num_gpu_blocks_override`` forces a block count.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools

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


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    """How the device's memory was split, in bytes (docs/architecture.md, "KV cache sizing").

    ``usable = min(gpu_memory_utilization * total, pool)``: the engine may use the fraction of
    the card the user asked for, but never more than the JAX allocator's pool (JAX preallocates
    ``XLA_PYTHON_CLIENT_MEM_FRACTION`` of the card, 75% by default; the CLI and the benchmark
    scripts set it from ``--gpu-memory-utilization`` before importing jax, library users set it
    themselves). ``peak`` is the allocator's peak after the weights were loaded and one
    profiling step at the full token budget ran, so ``usable - peak`` is the memory left after
    weights and activations; the KV cache gets all of it but a small headroom.
    """

    total: int  # physical device memory; equals `pool` when the driver cannot be asked
    pool: int  # JAX allocator limit (`bytes_limit` of `device.memory_stats()`)
    requested: int  # gpu_memory_utilization * total
    weights: int  # bytes in use after loading the weights, before profiling
    peak: int  # peak bytes in use after the profiling step
    headroom: int  # kept free for allocator fragmentation and untracked temporaries

    @property
    def usable(self) -> int:
        return min(self.requested, self.pool)

    @property
    def left_after_weights_and_activations(self) -> int:
        return self.usable - self.peak

    @property
    def kv_bytes(self) -> int:
        return self.left_after_weights_and_activations - self.headroom


# Share of the memory left after weights and activations that the KV cache does not take: room
# for allocator fragmentation and for step temporaries larger than the profiled bucket's.
KV_HEADROOM_FRACTION = 0.01


def device_memory_bytes(device: jax.Device) -> int | None:
    """Physical memory of a CUDA ``device`` from the driver (``cuDeviceTotalMem``), or None.

    JAX reports only its allocator pool (a fraction of the card), so the card's size comes from
    the CUDA driver library, which every CUDA process has loaded. None off CUDA or when the
    driver cannot be asked.
    """
    if device.platform != "gpu":
        return None
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    ordinal = getattr(device, "local_hardware_id", None)
    ordinal = device.id if ordinal is None else ordinal
    handle, total = ctypes.c_int(), ctypes.c_size_t()
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(handle), int(ordinal)) != 0:
        return None
    if cuda.cuDeviceTotalMem_v2(ctypes.byref(total), handle) != 0:
        return None
    return int(total.value)


def bytes_in_use(device: jax.Device) -> int | None:
    """Bytes the JAX allocator holds now on ``device``; None without memory statistics (CPU)."""
    stats = device.memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats.get("bytes_in_use", 0))


def measure_kv_budget(
    gpu_memory_utilization: float, device: jax.Device, *, weights_bytes: int
) -> MemoryBudget | None:
    """The split of ``device``'s memory after weights and the profiling step, or None on CPU.

    Call it right after the profiling step (its peak is what activations need).
    """
    stats = device.memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    pool = int(stats["bytes_limit"])
    total = device_memory_bytes(device) or pool
    peak = int(stats.get("peak_bytes_in_use", stats.get("bytes_in_use", 0)))
    requested = int(gpu_memory_utilization * total)
    left = min(requested, pool) - peak
    return MemoryBudget(
        total=total,
        pool=pool,
        requested=requested,
        weights=weights_bytes,
        peak=peak,
        headroom=max(0, int(KV_HEADROOM_FRACTION * left)),
    )


def allocate_kv_caches(
    spec: KVCacheSpec, num_blocks: int, *, fill_value: float = 0.0, sharding=None
):
    """Allocate ``num_layers`` pairs of K/V caches, each ``[num_blocks, block_size, Hkv, D]``.

    ``fill_value=nan`` is what tests use to prove that no kernel reads stale slots. ``sharding``
    (tensor parallelism, ``models.sharding.kv_cache_sharding``): each device allocates only its
    own heads.
    """
    shape = kv_cache_shape(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    make = _filler(shape, jnp.dtype(spec.dtype), float(fill_value), sharding)
    return [(make(), make()) for _ in range(spec.num_layers)]


@functools.lru_cache(maxsize=16)
def _filler(shape: tuple, dtype, fill_value: float, sharding):
    """One jitted fill per cache geometry, kept: ``wake_up`` re-allocates without compiling."""
    placement = {} if sharding is None else {"out_shardings": sharding}
    return jax.jit(lambda: jnp.full(shape, fill_value, dtype), **placement)


def kv_cache_shapes(spec: KVCacheSpec, num_blocks: int, *, sharding=None) -> list:
    """The caches ``allocate_kv_caches`` makes, as ``jax.ShapeDtypeStruct`` pairs (compiling
    needs only these; nothing is allocated)."""
    shape = kv_cache_shape(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    leaf = jax.ShapeDtypeStruct(shape, spec.dtype, sharding=sharding)
    return [(leaf, leaf) for _ in range(spec.num_layers)]
