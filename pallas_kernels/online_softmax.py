"""The K/V block step both paged-attention kernels share, and their shared argument checks.

``paged_attention`` (decode) and ``ragged_paged_attention`` (prefill / mixed) differ in how they
map programs to query rows and which keys a row may see; once a program holds its query rows
``q [rows, D]`` and one step of gathered keys and values ``k, v [block_k, D]``, the work is the
same: scores (a dot, or multiply-and-reduce when ``D < 16``), the optional soft cap and ALiBi
bias, the mask, the online-softmax update (Milakov & Gimelshein, "Online normalizer calculation
for softmax", 2018) and ``P . V``. These functions run inside the kernels' bodies (Pallas
Triton on GPU, interpret mode on CPU); the plain-JAX references share none of this code.

Scores are kept in base 2 (``exp2`` is one instruction, ``exp`` is ``exp2`` plus a multiply):
every score and bias is multiplied by ``log2(e)`` before the softmax.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

# Scores of masked positions. Finite, so that max/exp never meet inf - inf.
MASK_VALUE = -1e30
LOG2E = math.log2(math.e)
# Triton's tensor-core dot needs every dimension >= 16.
MIN_DOT_DIM = 16


def block_scores(
    q: jax.Array,
    k: jax.Array,
    *,
    scale: float,
    soft_cap: float | None,
    use_dot: bool,
    k_scale: jax.Array | None = None,
) -> jax.Array:
    """Base-2 scores ``f32[rows, block_k]`` of ``q [rows, D]`` against ``k [block_k, D]``.

    ``scale * q . k``, or ``soft_cap * tanh(scale * q . k / soft_cap)`` when ``soft_cap`` is set,
    times ``log2(e)``. The dot accumulates in float32 (``use_dot``: a tensor-core dot, needs
    ``D >= 16``; else multiply and reduce in float32). ``k_scale`` (``f32[]``, an FP8 cache's
    per-layer key scale, ``pallas_kernels.fp8_kv_cache``) joins ``scale``: ``k`` then holds the
    raw FP8 values converted to ``q``'s dtype, and ``scale * k_scale * q . k_fp8`` equals
    ``scale * q . (k_fp8 * k_scale)`` without a multiply per key element.
    """
    if k_scale is not None:
        scale = scale * k_scale
    if use_dot:
        s = lax.dot_general(
            q,
            k,
            (((1,), (1,)), ((), ())),
            precision=(lax.Precision.HIGHEST, lax.Precision.HIGHEST),
            preferred_element_type=jnp.float32,
        )
    else:
        s = jnp.sum(q.astype(jnp.float32)[:, None, :] * k.astype(jnp.float32)[None, :, :], axis=-1)
    if soft_cap is None:
        return s * (scale * LOG2E)
    return (soft_cap * LOG2E) * jnp.tanh(s * (scale / soft_cap))


def alibi_bias(slopes: jax.Array, query_pos: jax.Array, key_pos: jax.Array) -> jax.Array:
    """Base-2 ALiBi bias ``f32[rows, block_k]``: ``slope * (key_pos - query_pos) * log2(e)``.

    Args:
        slopes: ``f32[rows, 1]``, the slope of each query row's head (Press et al., "Train
            Short, Test Long", ICLR 2022).
        query_pos: ``i32[rows, 1]`` (or a scalar), each row's position in its sequence.
        key_pos: ``i32[block_k]``, the keys' positions.

    The bias is relative (0 at the query's own position, negative before it). HF BLOOM adds
    ``slope * key_pos`` instead; the two differ by a constant per row, which softmax cancels.
    """
    distance = (key_pos[None, :] - query_pos).astype(jnp.float32)
    return (slopes * LOG2E) * distance


def online_softmax_step(
    carry: tuple[jax.Array, jax.Array, jax.Array],
    s: jax.Array,
    v: jax.Array,
    *,
    visible: jax.Array | None,
    use_dot: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One online-softmax update with a block of base-2 scores and its values.

    Args:
        carry: ``(o f32[rows, D], m f32[rows], l f32[rows])``: the unnormalised output, the
            running maximum (base 2; ``MASK_VALUE`` before any visible key) and the running sum.
        s: ``f32[rows, block_k]`` base-2 scores (bias included).
        v: ``[block_k, D]``; rows of keys no query row sees must hold finite values (the
            kernels load them masked, as 0), since ``0 * NaN`` would poison ``P . V``.
        visible: ``bool[rows, block_k]`` (or broadcastable), or None when every row sees every
            key of the block.
        use_dot: ``P . V`` as a tensor-core dot (``D >= 16``) or multiply and reduce.

    Returns:
        The updated carry. A row that has seen no visible key yet keeps ``o = 0, l = 0``.
    """
    o_prev, m_prev, l_prev = carry
    if visible is not None:
        s = jnp.where(visible, s, MASK_VALUE)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=-1))
    correction = jnp.exp2(m_prev - m_next)
    p = jnp.exp2(s - m_next[:, None])
    if visible is not None:
        # A row may see no key of this block yet (m_next still MASK_VALUE): zero it.
        p = jnp.where(visible, p, 0.0)
    l_next = correction * l_prev + jnp.sum(p, axis=-1)
    if use_dot:
        pv = lax.dot_general(
            p.astype(v.dtype),
            v,
            (((1,), (0,)), ((), ())),
            precision=(lax.Precision.HIGHEST, lax.Precision.HIGHEST),
            preferred_element_type=jnp.float32,
        )
    else:
        pv = jnp.sum(p[:, :, None] * v.astype(jnp.float32)[None, :, :], axis=1)
    return correction[:, None] * o_prev + pv, m_next, l_next


def initial_carry(rows: int, head_dim: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The carry before any key: ``o = 0``, ``m = MASK_VALUE``, ``l = 0``."""
    return (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )


def check_caches_and_query(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, q_name: str):
    """Checks shared by both kernels; returns ``(Hq, Hkv, D)``.

    Raises:
        ValueError: K/V caches not both ``[num_blocks, block_size, Hkv, D]`` of one dtype,
            ``q`` not 3-D (``q_name`` names its expected shape), a ``D`` that differs between
            ``q`` and the cache, or ``Hq % Hkv != 0``.
    """
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, Hkv, D] of one dtype, got "
            f"{k_cache.shape} {k_cache.dtype} and {v_cache.shape} {v_cache.dtype}"
        )
    if q.ndim != 3:
        raise ValueError(f"q must be {q_name}, got shape {q.shape}")
    _, num_q_heads, head_dim = q.shape
    _, _, num_kv_heads, cache_head_dim = k_cache.shape
    if head_dim != cache_head_dim:
        raise ValueError(f"q has D={head_dim} but the cache has D={cache_head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"Hq must be a multiple of Hkv, got Hq={num_q_heads} and Hkv={num_kv_heads}"
        )
    return num_q_heads, num_kv_heads, head_dim


def check_options(scale, soft_cap, sliding_window, alibi_slopes, num_q_heads: int) -> None:
    """Checks of the static options and of ``alibi_slopes``.

    Raises:
        ValueError: ``scale`` not a Python number, ``soft_cap`` not positive, ``sliding_window``
            not an int >= 1, or ``alibi_slopes`` not ``f32[Hq]``.
    """
    if not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a Python float, got {type(scale).__name__}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be positive or None, got {soft_cap}")
    if sliding_window is not None and (int(sliding_window) != sliding_window or sliding_window < 1):
        raise ValueError(f"sliding_window must be an int >= 1 or None, got {sliding_window}")
    if alibi_slopes is not None and (
        alibi_slopes.shape != (num_q_heads,) or alibi_slopes.dtype != jnp.float32
    ):
        raise ValueError(
            f"alibi_slopes must be float32[Hq={num_q_heads}] or None, got "
            f"{alibi_slopes.dtype}{list(alibi_slopes.shape)}"
        )
