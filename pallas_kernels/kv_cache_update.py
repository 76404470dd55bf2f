"""Writing new K/V into the paged cache: a scatter by slot.

The cache layout is ``[num_blocks, block_size, Hkv, D]`` (see the package docstring). A slot is
``block_id * block_size + offset``; slot ``-1`` marks a padding token and is never written.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.fp8_kv_cache import check_kv_scales, quantize_kv


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int]:
    """Shape of one layer's K (or V) cache: ``(num_blocks, block_size, Hkv, D)``.

    Raises:
        ValueError: if any dimension is smaller than 1.
    """
    dims = {
        "num_blocks": num_blocks,
        "block_size": block_size,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
    }
    for name, value in dims.items():
        if int(value) < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    return (int(num_blocks), int(block_size), int(num_kv_heads), int(head_dim))


@jax.jit
def _scatter(k_cache, v_cache, k_new, v_new, slot_mapping, kv_scales=None):
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if kv_scales is not None:  # FP8 cache: clip and cast before the scatter
        k_new = quantize_kv(k_new, kv_scales[0], k_cache.dtype)
        v_new = quantize_kv(v_new, kv_scales[1], v_cache.dtype)
    num_slots = num_blocks * block_size
    # JAX wraps negative indices (-1 would mean the last slot), so padding slots are sent to
    # num_slots, which is out of range and dropped by mode="drop". Slots >= num_slots drop too.
    slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping)
    if slots.shape[0] == 1:
        # XLA turns a one-row scatter into a dynamic-update-slice that it duplicates into each
        # consumer, copying the whole (donated) cache every step; one dropped row avoids that.
        slots = jnp.append(slots, num_slots)
        k_new = jnp.concatenate([k_new, k_new], axis=0)
        v_new = jnp.concatenate([v_new, v_new], axis=0)
    flat_shape = (num_slots, num_kv_heads, head_dim)
    k_flat = (
        k_cache.reshape(flat_shape)
        .at[slots]
        .set(k_new.astype(k_cache.dtype), mode="drop", unique_indices=False)
    )
    v_flat = (
        v_cache.reshape(flat_shape)
        .at[slots]
        .set(v_new.astype(v_cache.dtype), mode="drop", unique_indices=False)
    )
    return k_flat.reshape(k_cache.shape), v_flat.reshape(v_cache.shape)


def kv_cache_update(
    k_cache: jax.Array,
    v_cache: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    slot_mapping: jax.Array,
    *,
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Write the new tokens' K and V into their cache slots.

    Args:
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, same shape and dtype.
        k_new, v_new: ``[T, Hkv, D]``; cast to the cache dtype. An FP8 cache
            (``float8_e4m3fn`` / ``float8_e5m2``) stores ``quantize_kv(k_new, k_scale)``:
            ``k_new / k_scale`` clipped to the format's finite range, then cast, so an overflow
            saturates instead of becoming NaN (``pallas_kernels.fp8_kv_cache``).
        slot_mapping: ``i32[T]``; token ``t`` goes to slot ``slot_mapping[t]``
            (``block_id * block_size + offset``). ``-1`` (padding) is dropped, and so is any slot
            ``>= num_blocks * block_size``. Slots of real tokens are assumed distinct.
        k_scale, v_scale: an FP8 cache's per-layer scales, ``f32[]`` (may be traced; None
            means 1.0); must be None for any other cache.

    Returns:
        ``(k_cache, v_cache)`` with the slots written. A plain XLA scatter: when the caller's jit
        donates the caches the update happens in place, with no copy of the cache.

    Raises:
        ValueError: mismatched K/V cache shapes or dtypes, new K/V whose shape is not
            ``[T, Hkv, D]`` of the cache, a ``slot_mapping`` that is not ``i32[T]``, scales
            that are not scalars or are given with a cache that is not FP8.
    """
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, Hkv, D] of one dtype, got "
            f"{k_cache.shape} {k_cache.dtype} and {v_cache.shape} {v_cache.dtype}"
        )
    _, _, num_kv_heads, head_dim = k_cache.shape
    if k_new.ndim != 3 or k_new.shape != v_new.shape or k_new.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"k_new and v_new must both be [T, {num_kv_heads}, {head_dim}], got {k_new.shape} "
            f"and {v_new.shape}"
        )
    if slot_mapping.shape != (k_new.shape[0],) or slot_mapping.dtype != jnp.int32:
        raise ValueError(
            f"slot_mapping must be i32[{k_new.shape[0]}], got {slot_mapping.dtype}"
            f"{list(slot_mapping.shape)}"
        )
    kv_scales = check_kv_scales(k_cache.dtype, k_scale, v_scale)
    return _scatter(k_cache, v_cache, k_new, v_new, slot_mapping, kv_scales)
