"""Block moves before a step: swap-out (device -> host), swap-in (host -> device), copy-on-write.

The scheduler decides the moves (`SchedulerOutput.blocks_to_swap_out / _in / _copy`); this module
carries them out on the per-layer K/V caches. Each kind is one jitted gather or scatter over all
layers at once, with the block count padded to a power of two so that few shapes compile:
  - swap-out gathers the blocks of every layer into one array, `jax.device_get`s it and stores it
    in the host cache;
  - swap-in reads host rows, puts them on the device and scatters them into the caches (donated,
    so in place);
  - copy gathers the sources and scatters them to the destinations in one function: every source
    is read before any destination is written.
They run in that order (see `KVCacheManager` for why the order is safe).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.worker.kv_cache import KVCacheSpec
from pallas_kernels import kv_cache_shape


def _block_axis(spec: KVCacheSpec) -> int:
    """Axis of the block id in one layer's cache; the layout belongs to `pallas_kernels`."""
    one = kv_cache_shape(1, spec.block_size, spec.num_kv_heads, spec.head_dim)
    two = kv_cache_shape(2, spec.block_size, spec.num_kv_heads, spec.head_dim)
    (axis,) = [i for i, (a, b) in enumerate(zip(one, two, strict=True)) if a != b]
    return axis


def _padded(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class BlockMover:
    """Executes block moves on a list of per-layer `(k, v)` caches and owns the host cache.

    Args:
        spec: the device cache geometry; one layer's K (or V) is `kv_cache_shape(num_blocks,
            block_size, Hkv, D)` (today `[num_blocks, block_size, Hkv, D]`).
        num_cpu_blocks: host blocks (`swap_space` GiB / `spec.bytes_per_block`); 0 = no swap.
        cache_sharding: the sharding of every layer's K and V under tensor parallelism (None on
            one device); the moves keep it, so the step's compiled executables accept the caches.

    The host cache is one numpy array `[num_cpu_blocks, num_layers, 2, *block]` (block-major, so
    a block's K and V of all layers are one contiguous row), allocated with `np.zeros`, whose
    pages the OS only commits when a swap first writes them.
    """

    def __init__(self, spec: KVCacheSpec, num_cpu_blocks: int, *, cache_sharding=None):
        if num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be non-negative, got {num_cpu_blocks}")
        self.spec = spec
        self.num_cpu_blocks = num_cpu_blocks
        self.block_axis = _block_axis(spec)
        block_shape = list(kv_cache_shape(1, spec.block_size, spec.num_kv_heads, spec.head_dim))
        del block_shape[self.block_axis]
        self.host_cache = np.zeros(
            (num_cpu_blocks, spec.num_layers, 2, *block_shape), jnp.dtype(spec.dtype)
        )
        axis = self.block_axis
        # One sharding for every cache leaf (a pytree prefix); None lets XLA choose.
        placement = {} if cache_sharding is None else {"out_shardings": cache_sharding}
        self._gather = jax.jit(lambda caches, ids: _gather(caches, ids, axis))
        self._scatter = jax.jit(
            lambda caches, ids, rows: _scatter(caches, ids, rows, axis),
            donate_argnums=0,
            **placement,
        )
        self._copy = jax.jit(
            lambda caches, src, dst: _scatter(caches, dst, _gather(caches, src, axis), axis),
            donate_argnums=0,
            **placement,
        )

    def execute(self, kv_caches: list, scheduler_output) -> list:
        """Run the output's swap-out, swap-in and copies in that order; returns the new caches.

        Raises:
            ValueError: a swap while the mover has no host blocks.
        """
        swap_out = scheduler_output.blocks_to_swap_out
        swap_in = scheduler_output.blocks_to_swap_in
        copies = scheduler_output.blocks_to_copy
        if (swap_out or swap_in) and not self.num_cpu_blocks:
            raise ValueError("swap requested but swap_space is 0 (no host blocks)")
        if swap_out:
            device_ids, host_ids = zip(*swap_out, strict=True)
            rows = jax.device_get(self._gather(kv_caches, self._ids(device_ids, fill=0)))
            self.host_cache[list(host_ids)] = rows[: len(host_ids)]
        if swap_in:
            host_ids, device_ids = zip(*swap_in, strict=True)
            rows = np.zeros(
                (_padded(len(host_ids)), *self.host_cache.shape[1:]), self.host_cache.dtype
            )
            rows[: len(host_ids)] = self.host_cache[list(host_ids)]
            kv_caches = self._scatter(
                kv_caches,
                self._ids(device_ids, fill=self._num_device_blocks(kv_caches)),
                jax.device_put(rows),
            )
        if copies:
            src, dst = zip(*copies, strict=True)
            kv_caches = self._copy(
                kv_caches,
                self._ids(src, fill=0),
                self._ids(dst, fill=self._num_device_blocks(kv_caches)),
            )
        return kv_caches

    def _num_device_blocks(self, kv_caches) -> int:
        return kv_caches[0][0].shape[self.block_axis]

    @staticmethod
    def _ids(block_ids, *, fill: int) -> np.ndarray:
        # Padding rows read block 0 (harmless) or write past the end (dropped by mode="drop").
        ids = np.full(_padded(len(block_ids)), fill, np.int32)
        ids[: len(block_ids)] = block_ids
        return ids


def _gather(kv_caches, block_ids, axis: int):
    """`[n, num_layers, 2, *block]`: blocks `block_ids` of every layer's K and V."""
    layers = [
        jnp.stack([jnp.moveaxis(jnp.take(c, block_ids, axis=axis), axis, 0) for c in kv], axis=1)
        for kv in kv_caches
    ]
    return jnp.stack(layers, axis=1)


def _scatter(kv_caches, block_ids, rows, axis: int):
    """Write `rows` (`[n, num_layers, 2, *block]`) into blocks `block_ids` of every layer;
    ids past the end are dropped."""
    index = (slice(None),) * axis + (block_ids,)
    return [
        tuple(
            c.at[index].set(jnp.moveaxis(rows[:, layer, i], 0, axis).astype(c.dtype), mode="drop")
            for i, c in enumerate(kv)
        )
        for layer, kv in enumerate(kv_caches)
    ]
