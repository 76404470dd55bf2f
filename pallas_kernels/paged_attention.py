"""Decode attention over a paged KV cache: one query token per sequence.

Layout of this file: the Pallas kernel body, the wrapper that builds the grid and merges the
split partials, the jitted public ``paged_attention`` with its argument checks, and last the
plain-JAX ``paged_attention_reference`` on contiguous K/V, which shares no code with the kernel.

Algorithm: PagedAttention (Kwon et al., "Efficient Memory Management for Large Language Model
Serving with PagedAttention", SOSP 2023) reads K/V through a per-sequence block table; the softmax
is computed online (Milakov & Gimelshein, "Online normalizer calculation for softmax", 2018) and
a long sequence is split over several programs whose (max, sum, out) partials are combined
afterwards (Flash-Decoding, Dao et al. 2023).

Backend: on GPU ``pallas_call`` lowers through the Pallas Triton backend (the default on jax
0.11.2 when no Mosaic GPU compiler params are given); on CPU it runs with ``interpret=True``.
Triton needs power-of-two tiles: ``block_size`` and ``D`` must be powers of two there.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

# Scores of masked positions. Finite, so that max/exp never meet inf - inf; the probabilities of
# masked positions are also zeroed explicitly, so this value never reaches the output.
_MASK_VALUE = -1e30
# Grid size the split heuristic aims for: two programs per SM of a 132-SM H200.
_TARGET_PROGRAMS = 264
# Tokens of K/V handled per loop step (rounded to whole blocks).
_TARGET_BLOCK_K = 64
# Triton's tensor-core dot needs every dimension >= 16.
_MIN_DOT_DIM = 16


def _paged_attention_kernel(
    seq_len_ref,  # i32[1]: seq_len of this program's sequence
    block_table_ref,  # i32[blocks_per_split]: this split's columns of the sequence's block table
    q_ref,  # [Gp, D]: the G query heads of this KV head, zero-padded to Gp rows
    k_cache_ref,  # [num_blocks, block_size, D]: this KV head of the whole K cache
    v_cache_ref,  # [num_blocks, block_size, D]: this KV head of the whole V cache
    o_ref,  # f32[Gp, D]: un-normalised output of this split
    m_ref,  # f32[Gp]: running max of the scores of this split
    l_ref,  # f32[Gp]: running sum of exp(score - max) of this split
    *,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    blocks_per_step: int,
    use_dot: bool,
):
    split = pl.program_id(2)
    num_blocks, block_size, head_dim = k_cache_ref.shape
    blocks_per_split = block_table_ref.shape[0]
    block_k = blocks_per_step * block_size
    rows = q_ref.shape[0]

    seq_len = seq_len_ref[0]
    # Key positions the query (at position seq_len - 1) may see: [kv_start, seq_len).
    kv_start = 0 if sliding_window is None else jnp.maximum(seq_len - sliding_window, 0)
    first_block = split * blocks_per_split  # first table column of this split
    # Steps of this split that hold a visible key; the rest of the table is never read.
    end_block = jnp.clip(pl.cdiv(seq_len, block_size) - first_block, 0, blocks_per_split)
    start_block = jnp.clip(kv_start // block_size - first_block, 0, blocks_per_split)
    start_step = start_block // blocks_per_step
    end_step = pl.cdiv(end_block, blocks_per_step)

    q = q_ref[...]

    def body(step, carry):
        o_prev, m_prev, l_prev = carry
        ids = block_table_ref[pl.ds(step * blocks_per_step, blocks_per_step)]
        ids = jnp.clip(ids, 0, num_blocks - 1)  # a bad table entry must not read out of bounds
        k = k_cache_ref[ids].reshape(block_k, head_dim).astype(q.dtype)
        v = v_cache_ref[ids].reshape(block_k, head_dim).astype(q.dtype)

        if use_dot:
            s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                precision=(lax.Precision.HIGHEST, lax.Precision.HIGHEST),
                                preferred_element_type=jnp.float32)
        else:  # D too small for a tensor-core dot: multiply and reduce.
            s = jnp.sum(q.astype(jnp.float32)[:, None, :] * k.astype(jnp.float32)[None, :, :],
                        axis=-1)
        s = s * scale  # [Gp, block_k]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)

        kpos = (first_block + step * blocks_per_step) * block_size + lax.broadcasted_iota(
            jnp.int32, (1, block_k), 1)
        visible = (kpos < seq_len) & (kpos >= kv_start)  # [1, block_k]
        s = jnp.where(visible, s, _MASK_VALUE)

        m_next = jnp.maximum(m_prev, jnp.max(s, axis=-1))
        correction = jnp.exp(m_prev - m_next)
        p = jnp.where(visible, jnp.exp(s - m_next[:, None]), 0.0)
        l_next = correction * l_prev + jnp.sum(p, axis=-1)
        # Stale positions may hold NaN and 0 * NaN = NaN: zero V there, not just p.
        v = jnp.where(visible.reshape(block_k, 1), v, jnp.zeros_like(v))
        if use_dot:
            pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 precision=(lax.Precision.HIGHEST, lax.Precision.HIGHEST),
                                 preferred_element_type=jnp.float32)
        else:
            pv = jnp.sum(p[:, :, None] * v.astype(jnp.float32)[None, :, :], axis=1)
        o_next = correction[:, None] * o_prev + pv
        return o_next, m_next, l_next

    init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), _MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    o, row_max, row_sum = lax.fori_loop(start_step, end_step, body, init)
    o_ref[...] = o
    m_ref[...] = row_max
    l_ref[...] = row_sum


def _largest_power_of_two_at_most(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _default_tiling(batch: int, num_kv_heads: int, block_size: int,
                    max_blocks: int) -> tuple[int, int]:
    """(num_splits, blocks_per_step) for a shape: ~64 tokens a step, ~264 programs."""
    blocks_per_step = _largest_power_of_two_at_most(max(1, _TARGET_BLOCK_K // block_size))
    blocks_per_step = min(blocks_per_step, pl.next_power_of_2(max_blocks))
    while blocks_per_step * block_size < _MIN_DOT_DIM:
        blocks_per_step *= 2
    num_steps = pl.cdiv(max_blocks, blocks_per_step)
    num_splits = max(1, min(num_steps, _TARGET_PROGRAMS // (batch * num_kv_heads)))
    return num_splits, blocks_per_step


@functools.partial(
    jax.jit,
    static_argnames=("scale", "soft_cap", "sliding_window", "interpret", "num_splits",
                     "blocks_per_step"))
def _paged_attention(q, k_cache, v_cache, block_tables, seq_lens, *, scale, soft_cap,
                     sliding_window, interpret, num_splits, blocks_per_step):
    """The kernel launch and split combine; arguments already checked, tiling chosen."""
    batch, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    max_blocks = block_tables.shape[1]
    group = num_q_heads // num_kv_heads
    use_dot = head_dim >= _MIN_DOT_DIM
    # Pad the query heads of one KV head to a power of two (>= 16 when they feed a dot).
    rows = pl.next_power_of_2(group)
    if use_dot:
        rows = max(rows, _MIN_DOT_DIM)

    num_steps = pl.cdiv(max_blocks, blocks_per_step)
    steps_per_split = pl.cdiv(num_steps, num_splits)
    num_splits = pl.cdiv(num_steps, steps_per_split)  # no empty trailing split
    blocks_per_split = steps_per_split * blocks_per_step
    # Extra columns point at block 0; the kernel never uses keys from them (masked by seq_len).
    block_tables = jnp.pad(block_tables, ((0, 0), (0, num_splits * blocks_per_split - max_blocks)))

    q = q.reshape(batch, num_kv_heads, group, head_dim)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, rows - group), (0, 0)))

    kernel = functools.partial(
        _paged_attention_kernel, scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
        blocks_per_step=blocks_per_step, use_dot=use_dot)
    cache_spec = pl.BlockSpec((num_blocks, block_size, None, head_dim),
                              lambda b, h, s: (0, 0, h, 0))
    o, m, row_sum = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, num_splits),
        in_specs=[
            pl.BlockSpec((1,), lambda b, h, s: (b,)),  # seq_lens
            pl.BlockSpec((None, blocks_per_split), lambda b, h, s: (b, s)),  # block_tables
            pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0)),  # q
            cache_spec,  # k_cache
            cache_spec,  # v_cache
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (b, s, h, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, s, h, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, s, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, num_splits, num_kv_heads, rows, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((batch, num_splits, num_kv_heads, rows), jnp.float32),
            jax.ShapeDtypeStruct((batch, num_splits, num_kv_heads, rows), jnp.float32),
        ],
        interpret=interpret,
        name="paged_attention",
    )(seq_lens, block_tables, q, k_cache, v_cache)

    # Flash-decoding combine of the splits' (max, sum, out) partials.
    m_all = jnp.max(m, axis=1, keepdims=True)
    weight = jnp.exp(m - m_all)  # 0 for a split that saw no key
    l_all = jnp.sum(weight * row_sum, axis=1)  # [B, Hkv, rows]
    o_all = jnp.sum(weight[..., None] * o, axis=1)  # [B, Hkv, rows, D]
    # A sequence with no visible key (seq_len 0: a padding row) returns 0, not NaN.
    out = o_all / jnp.where(l_all > 0, l_all, 1.0)[..., None]
    return out[:, :, :group, :].reshape(batch, num_q_heads, head_dim).astype(q.dtype)


def _check_options(scale, soft_cap, sliding_window):
    if not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a Python float, got {type(scale).__name__}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be positive or None, got {soft_cap}")
    if sliding_window is not None and (int(sliding_window) != sliding_window
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be an int >= 1 or None, got {sliding_window}")


def paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Decode attention: one query token per sequence against its paged K/V.

    Args:
        q: ``[B, Hq, D]``, the query of each sequence's newest token (position ``seq_len - 1``).
            Query head ``j`` uses KV head ``j // (Hq // Hkv)`` (grouped-query attention).
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, same shape and dtype.
        block_tables: ``i32[B, max_blocks]``; column ``i`` of row ``b`` is the block holding
            positions ``i * block_size ... (i + 1) * block_size - 1`` of sequence ``b``.
        seq_lens: ``i32[B]``, context lengths including the token being decoded. A length of
            0 (a padding row) gives an all-zero output row.
        scale: multiplies ``q . k`` (usually ``D ** -0.5``).
        soft_cap: if set to ``c``, scores become ``c * tanh(score / c)`` before masking.
        sliding_window: if set to ``w``, the query at position ``p`` sees keys
            ``p - w < pos <= p``.
        interpret: run the Pallas kernel in interpret mode (CPU tests).

    Returns:
        ``[B, Hq, D]`` in ``q.dtype``; softmax and accumulation run in float32.

    Assumes: positions at or past ``seq_len`` hold stale data (possibly NaN) and never affect
    the result; block-table entries past ``ceil(seq_len / block_size)`` are arbitrary valid
    block ids. One program serves all ``Hq // Hkv`` query heads of a KV head, so each K/V block
    is read once per sequence. On GPU, ``block_size`` and ``D`` must be powers of two.

    Raises:
        ValueError: mismatched K/V cache shapes or dtypes, ``Hq % Hkv != 0``, a ``D`` that
            differs between ``q`` and the cache, a batch mismatch between ``q``,
            ``block_tables`` and ``seq_lens``, ``block_tables``/``seq_lens`` not int32, or a bad
            ``scale``/``soft_cap``/``sliding_window``.

    Source: PagedAttention (Kwon et al., SOSP 2023); online softmax (Milakov & Gimelshein,
    2018); split-K combine as in Flash-Decoding (Dao et al., 2023).
    """
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, Hkv, D] of one dtype, got "
            f"{k_cache.shape} {k_cache.dtype} and {v_cache.shape} {v_cache.dtype}")
    if q.ndim != 3:
        raise ValueError(f"q must be [B, Hq, D], got shape {q.shape}")
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if head_dim != cache_head_dim:
        raise ValueError(f"q has D={head_dim} but the cache has D={cache_head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"Hq must be a multiple of Hkv, got Hq={num_q_heads} and Hkv={num_kv_heads}")
    if block_tables.ndim != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be [B={batch}, max_blocks], got {block_tables.shape}")
    if seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens must be [B={batch}], got {seq_lens.shape}")
    if block_tables.dtype != jnp.int32 or seq_lens.dtype != jnp.int32:
        raise ValueError(
            f"block_tables and seq_lens must be int32, got {block_tables.dtype} and "
            f"{seq_lens.dtype}")
    _check_options(scale, soft_cap, sliding_window)
    num_splits, blocks_per_step = _default_tiling(batch, num_kv_heads, block_size,
                                                  block_tables.shape[1])
    return _paged_attention(
        q, k_cache, v_cache, block_tables, seq_lens, scale=float(scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        sliding_window=None if sliding_window is None else int(sliding_window),
        interpret=bool(interpret), num_splits=num_splits, blocks_per_step=blocks_per_step)


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window"))
def paged_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    seq_lens: jax.Array,
    *,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> jax.Array:
    """Plain-JAX decode attention on contiguous K/V, for testing the kernel.

    Args:
        q: ``[B, Hq, D]``, each sequence's query at position ``seq_len - 1``.
        k, v: ``[B, S, Hkv, D]``, contiguous K/V of each sequence (``S >= max(seq_lens)``);
            positions ``>= seq_len`` may hold anything, NaN included.
        seq_lens: ``i32[B]``; 0 gives an all-zero row.
        scale, soft_cap, sliding_window: as in ``paged_attention``.

    Returns:
        ``[B, Hq, D]`` in ``q.dtype``, computed in float32 (einsum + masked softmax).
    """
    batch, num_q_heads, head_dim = q.shape
    seq_capacity, num_kv_heads = k.shape[1], k.shape[2]
    group = num_q_heads // num_kv_heads
    qf = q.astype(jnp.float32).reshape(batch, num_kv_heads, group, head_dim)
    scores = jnp.einsum("bhgd,bshd->bhgs", qf, k.astype(jnp.float32),
                        precision=lax.Precision.HIGHEST) * scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    pos = jnp.arange(seq_capacity)[None, :]
    lens = seq_lens[:, None]
    mask = pos < lens  # [B, S]
    if sliding_window is not None:
        mask &= pos > lens - 1 - sliding_window
    mask4 = mask[:, None, None, :]
    scores = jnp.where(mask4, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.where(mask4, jnp.exp(scores - row_max), 0.0)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    vf = jnp.where(mask[:, :, None, None], v.astype(jnp.float32), 0.0)
    out = jnp.einsum("bhgs,bshd->bhgd", weights, vf, precision=lax.Precision.HIGHEST)
    out = out / jnp.where(denom > 0, denom, 1.0)
    return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)
