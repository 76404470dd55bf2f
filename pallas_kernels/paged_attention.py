"""Decode attention over a paged KV cache: one query token per sequence.

Layout of this file: the Pallas kernel body, the wrapper that builds the grid and merges the
split partials, the public ``paged_attention`` with its argument checks, and last the plain-JAX
``paged_attention_reference`` on contiguous K/V, which shares no code with the kernel.

Algorithm: PagedAttention (Kwon et al., "Efficient Memory Management for Large Language Model
Serving with PagedAttention", SOSP 2023) reads K/V through a per-sequence block table; the softmax
is computed online (Milakov & Gimelshein, "Online normalizer calculation for softmax", 2018) and
a long sequence is split over several programs whose (max, sum, out) partials are combined
afterwards (Flash-Decoding, Dao et al. 2023).

Backend: on GPU ``pallas_call`` lowers through the Pallas Triton backend; on CPU it runs with
``interpret=True``. Triton needs power-of-two tiles: ``block_size`` and ``D`` must be powers of
two there. ``docs/kernels.md`` gives the H200 measurements behind the backend, the layout and the
tiling defaults (``_TILING``).
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.fp8_kv_cache import (
    cache_bytes,
    check_kv_scales,
    dequantize_kv,
    from_cache_bytes,
)
from pallas_kernels.online_softmax import (
    MIN_DOT_DIM,
    alibi_bias,
    block_scores,
    check_caches_and_query,
    check_options,
    initial_carry,
    online_softmax_step,
)


@dataclasses.dataclass(frozen=True)
class DecodeTiling:
    """Static launch parameters of the decode kernel (measured on the H200: docs/kernels.md).

    Attributes:
        block_k: K/V tokens loaded per loop step (rounded to whole KV blocks, at least 16).
        target_programs: the split count is chosen so that ``B * Hkv * num_splits`` reaches
            about this many programs, never splitting below ``min_split_tokens`` tokens.
        min_split_tokens: smallest number of tokens one split may cover.
        num_warps, num_stages: Triton's warps per program and software-pipelining depth.
    """

    block_k: int = 64
    target_programs: int = 256
    min_split_tokens: int = 512
    num_warps: int = 4
    num_stages: int = 3


_TILING = DecodeTiling()


def _paged_attention_kernel(
    seq_len_ref,  # i32[1]: seq_len of this program's sequence
    block_table_ref,  # i32[max_blocks]: the sequence's block table
    q_ref,  # [Hq, D]: all query heads of the sequence; this program reads its KV head's group
    k_cache_ref,  # [num_blocks * block_size, D]: this KV head of the whole K cache, by slot
    v_cache_ref,  # [num_blocks * block_size, D]: this KV head of the whole V cache, by slot
    *refs,  # [kv_scales f32[2]], [alibi f32[Hq]], then one split: o [Hq, D] (normalised,
    # q.dtype); several: o f32[Hq, D], m, l f32[Hq]
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    use_kv_scales: bool,
    cache_dtype: Any,  # the caches' element dtype (an FP8 cache arrives as its bytes)
    use_alibi: bool,
    group: int,
    rows: int,
    block_size: int,
    blocks_per_step: int,
    steps_per_split: int,
    use_dot: bool,
):
    scales_ref, *refs = refs if use_kv_scales else (None, *refs)
    alibi_ref, *out_refs = refs if use_alibi else (None, *refs)
    # FP8 cache: the raw values feed the dots; k_scale folds into the logit scale and v_scale
    # into the output (pallas_kernels.fp8_kv_cache).
    k_scale = scales_ref[0] if use_kv_scales else None
    head = pl.program_id(1)
    split = pl.program_id(2)
    num_slots, head_dim = k_cache_ref.shape
    num_blocks = num_slots // block_size
    max_blocks = block_table_ref.shape[0]
    block_k = blocks_per_step * block_size

    seq_len = seq_len_ref[0]
    # Key positions the query (at position seq_len - 1) may see: [kv_start, seq_len).
    kv_start = 0 if sliding_window is None else jnp.maximum(seq_len - sliding_window, 0)
    # Loop steps (of block_k keys) of this split that hold a visible key: [first, end).
    lo = split * steps_per_split
    first = jnp.maximum(lo, kv_start // block_k)
    end = jnp.maximum(first, jnp.minimum(lo + steps_per_split, pl.cdiv(seq_len, block_k)))

    # The G query heads of this KV head, zero-padded to `rows` (a dot needs >= 16 rows). The
    # mask keeps the padding rows from reading the next head's queries or past the array.
    row = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    head_rows = pl.ds(head * group, rows)
    q = pltriton.load(q_ref.at[head_rows], mask=row < group, other=0)
    if use_alibi:
        slopes = pltriton.load(alibi_ref.at[head_rows], mask=row[:, 0] < group, other=0)
        slopes = slopes[:, None]  # [rows, 1]
    token = lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    dim = lax.broadcasted_iota(jnp.int32, (1, head_dim), 1)

    def body(step, carry):
        kpos = step * block_k + token  # [block_k]
        visible = (kpos >= kv_start) & (kpos < seq_len)
        # Each key's cache row (slot), gathered token by token so that K and V load as 2-D
        # [block_k, D] tiles that feed the dots directly: Triton then pipelines both loads
        # through shared memory (a [blocks, block_size, D] tile needs a reshape, which it does
        # not pipeline). Columns past the table (max_blocks not a multiple of blocks_per_step)
        # read block 0; clipping keeps a bad table entry from reading out of bounds.
        column = step * blocks_per_step + token // block_size
        ids = pltriton.load(block_table_ref.at[column], mask=column < max_blocks, other=0)
        slots = (jnp.clip(ids, 0, num_blocks - 1) * block_size + token % block_size)[:, None]
        # Masked loads: keys outside [kv_start, seq_len) are never read (they may be stale or
        # NaN) and load as 0, so V there adds nothing to P.V.
        k = pltriton.load(k_cache_ref.at[slots, dim], mask=visible[:, None], other=0)
        v = pltriton.load(v_cache_ref.at[slots, dim], mask=visible[:, None], other=0)
        k, v = from_cache_bytes(k, cache_dtype), from_cache_bytes(v, cache_dtype)
        s = block_scores(
            q, k.astype(q.dtype), scale=scale, soft_cap=soft_cap, use_dot=use_dot, k_scale=k_scale
        )
        if use_alibi:
            s = s + alibi_bias(slopes, seq_len - 1, kpos)
        # Every step holds at least one visible key, so the running maximum is a real score.
        return online_softmax_step(
            carry, s, v.astype(q.dtype), visible=visible[None, :], use_dot=use_dot
        )

    o, row_max, row_sum = lax.fori_loop(first, end, body, initial_carry(rows, head_dim))
    if use_kv_scales:
        o = o * scales_ref[1]  # v_scale; linear, so the split combine is unchanged
    if len(out_refs) == 1:
        # A sequence with no visible key (seq_len 0: a padding row) returns 0, not NaN.
        o = o / jnp.where(row_sum > 0, row_sum, 1.0)[:, None]
        [o_ref] = out_refs
        pltriton.store(o_ref.at[head_rows], o.astype(o_ref.dtype), mask=row < group)
    else:
        o_ref, m_ref, l_ref = out_refs
        pltriton.store(o_ref.at[head_rows], o, mask=row < group)
        pltriton.store(m_ref.at[head_rows], row_max, mask=row[:, 0] < group)
        pltriton.store(l_ref.at[head_rows], row_sum, mask=row[:, 0] < group)


def _largest_power_of_two_at_most(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _split_plan(
    batch: int, num_kv_heads: int, block_size: int, max_blocks: int, tiling: DecodeTiling
) -> tuple[int, int]:
    """(blocks_per_step, num_splits) for a shape and a tiling."""
    blocks_per_step = _largest_power_of_two_at_most(max(1, tiling.block_k // block_size))
    blocks_per_step = min(blocks_per_step, pl.next_power_of_2(max_blocks))
    while blocks_per_step * block_size < MIN_DOT_DIM:
        blocks_per_step *= 2
    block_k = blocks_per_step * block_size
    num_steps = pl.cdiv(max_blocks, blocks_per_step)
    min_split_steps = max(1, tiling.min_split_tokens // block_k)
    num_splits = pl.cdiv(tiling.target_programs, batch * num_kv_heads)
    num_splits = max(1, min(num_splits, num_steps // min_split_steps))
    return blocks_per_step, num_splits


@functools.partial(
    jax.jit,
    static_argnames=("scale", "soft_cap", "sliding_window", "interpret", "tiling", "heads_major"),
)
def _paged_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    alibi_slopes=None,
    kv_scales=None,
    *,
    scale,
    soft_cap,
    sliding_window,
    interpret,
    tiling,
    heads_major=False,
):
    """The kernel launch and split combine; arguments already checked (``kv_scales``:
    ``f32[2]`` for an FP8 cache, else None).

    ``heads_major=True`` takes caches ``[Hkv, num_blocks, block_size, D]`` instead of the
    public ``[num_blocks, block_size, Hkv, D]``; it exists only so that
    ``benchmarks/attention_kernels.py --tune`` can repeat the layout measurement of
    ``docs/kernels.md`` with this very kernel body.
    """
    batch, num_q_heads, head_dim = q.shape
    if heads_major:
        num_kv_heads, num_blocks, block_size, _ = k_cache.shape
    else:
        num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    max_blocks = block_tables.shape[1]
    group = num_q_heads // num_kv_heads
    use_dot = head_dim >= MIN_DOT_DIM
    rows = pl.next_power_of_2(group)
    if use_dot:
        rows = max(rows, MIN_DOT_DIM)
    blocks_per_step, num_splits = _split_plan(batch, num_kv_heads, block_size, max_blocks, tiling)
    num_steps = pl.cdiv(max_blocks, blocks_per_step)
    steps_per_split = pl.cdiv(num_steps, num_splits)
    num_splits = pl.cdiv(num_steps, steps_per_split)  # no empty trailing split

    kernel = functools.partial(
        _paged_attention_kernel,
        scale=scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        use_kv_scales=kv_scales is not None,
        cache_dtype=k_cache.dtype,
        use_alibi=alibi_slopes is not None,
        group=group,
        rows=rows,
        block_size=block_size,
        blocks_per_step=blocks_per_step,
        steps_per_split=steps_per_split,
        use_dot=use_dot,
    )
    # Views of the caches by slot (a free reshape): [num_blocks * block_size, Hkv, D].
    num_slots = num_blocks * block_size
    if heads_major:
        slot_shape = (num_kv_heads, num_slots, head_dim)
        cache_spec = pl.BlockSpec((None, num_slots, head_dim), lambda b, h, s: (h, 0, 0))
    else:
        slot_shape = (num_slots, num_kv_heads, head_dim)
        cache_spec = pl.BlockSpec((num_slots, None, head_dim), lambda b, h, s: (0, h, 0))
    # An FP8 cache travels as its bytes (fp8_kv_cache.cache_bytes: masked loads pad with 0).
    k_slots = cache_bytes(k_cache).reshape(slot_shape)
    v_slots = cache_bytes(v_cache).reshape(slot_shape)
    in_specs = [
        pl.BlockSpec((1,), lambda b, h, s: (b,)),  # seq_lens
        pl.BlockSpec((None, max_blocks), lambda b, h, s: (b, 0)),  # block_tables
        pl.BlockSpec((None, num_q_heads, head_dim), lambda b, h, s: (b, 0, 0)),  # q
        cache_spec,  # k_cache
        cache_spec,  # v_cache
    ]
    operands = [seq_lens, block_tables, q, k_slots, v_slots]
    if kv_scales is not None:
        in_specs.append(pl.BlockSpec((2,), lambda b, h, s: (0,)))
        operands.append(kv_scales)
    if alibi_slopes is not None:
        in_specs.append(pl.BlockSpec((num_q_heads,), lambda b, h, s: (0,)))
        operands.append(alibi_slopes)
    if num_splits == 1:  # the kernel normalises and writes the final output: no combine pass
        out_specs = pl.BlockSpec((None, num_q_heads, head_dim), lambda b, h, s: (b, 0, 0))
        out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    else:
        out_specs = [
            pl.BlockSpec((None, None, num_q_heads, head_dim), lambda b, h, s: (b, s, 0, 0)),
            pl.BlockSpec((None, None, num_q_heads), lambda b, h, s: (b, s, 0)),
            pl.BlockSpec((None, None, num_q_heads), lambda b, h, s: (b, s, 0)),
        ]
        out_shape = [
            jax.ShapeDtypeStruct((batch, num_splits, num_q_heads, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((batch, num_splits, num_q_heads), jnp.float32),
            jax.ShapeDtypeStruct((batch, num_splits, num_q_heads), jnp.float32),
        ]
    result = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(
            num_warps=tiling.num_warps, num_stages=tiling.num_stages
        ),
        interpret=interpret,
        name="paged_attention",
    )(*operands)
    if num_splits == 1:
        return result

    # Flash-decoding combine of the splits' (max, sum, out) partials; maxima are base 2.
    o, m, row_sum = result
    m_all = jnp.max(m, axis=1, keepdims=True)
    weight = jnp.exp2(m - m_all)  # 0 for a split that saw no key
    l_all = jnp.sum(weight * row_sum, axis=1)  # [B, Hq]
    o_all = jnp.sum(weight[..., None] * o, axis=1)  # [B, Hq, D]
    # A sequence with no visible key (seq_len 0: a padding row) returns 0, not NaN.
    return (o_all / jnp.where(l_all > 0, l_all, 1.0)[..., None]).astype(q.dtype)


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
    alibi_slopes: jax.Array | None = None,
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Decode attention: one query token per sequence against its paged K/V.

    Args:
        q: ``[B, Hq, D]``, the query of each sequence's newest token (position ``seq_len - 1``).
            Query head ``j`` uses KV head ``j // (Hq // Hkv)`` (grouped-query attention).
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, same shape and dtype; an FP8
            dtype (``float8_e4m3fn``, ``float8_e5m2``: ``kv_cache_dtype="fp8"``) holds
            ``k / k_scale`` and ``v / v_scale`` (``pallas_kernels.fp8_kv_cache``).
        block_tables: ``i32[B, max_blocks]``; column ``i`` of row ``b`` is the block holding
            positions ``i * block_size ... (i + 1) * block_size - 1`` of sequence ``b``.
        seq_lens: ``i32[B]``, context lengths including the token being decoded
            (``seq_lens[b] <= max_blocks * block_size``). A length of 0 (a padding row) gives an
            all-zero output row.
        scale: multiplies ``q . k`` (usually ``D ** -0.5``).
        soft_cap: if set to ``c``, scores become ``c * tanh(score / c)`` before masking.
        sliding_window: if set to ``w``, the query at position ``p`` sees keys
            ``p - w < pos <= p``.
        alibi_slopes: ``f32[Hq]`` or None. If set, head ``j``'s score of the key at position
            ``pos`` gains ``alibi_slopes[j] * (pos - p)`` (after the scale and soft cap; ALiBi,
            Press et al., ICLR 2022; slopes as HF BLOOM's ``build_alibi_tensor``).
        k_scale, v_scale: an FP8 cache's per-layer scales (``f32[]``, may be traced; None means
            1.0); must be None for any other cache. The kernel converts the FP8 values to
            ``q.dtype`` (exact for bf16/f16/f32) and folds the scales: scores
            ``(q . k_fp8) * (scale * k_scale)``, output ``(P . v_fp8) * v_scale``.
        interpret: run the Pallas kernel in interpret mode (CPU tests).

    Returns:
        ``[B, Hq, D]`` in ``q.dtype``. K/V are cast to ``q.dtype`` for the two dots, which
        accumulate in float32; the softmax runs in float32.

    Assumes: positions at or past ``seq_len`` hold stale data (possibly NaN) and never affect
    the result; block-table entries past ``ceil(seq_len / block_size)`` are arbitrary valid
    block ids. One program serves all ``Hq // Hkv`` query heads of a KV head, so each K/V block
    is read once per sequence. On GPU, ``block_size`` and ``D`` must be powers of two.

    Raises:
        ValueError: mismatched K/V cache shapes or dtypes, ``Hq % Hkv != 0``, a ``D`` that
            differs between ``q`` and the cache, a batch mismatch between ``q``,
            ``block_tables`` and ``seq_lens``, ``block_tables``/``seq_lens`` not int32, a bad
            ``scale``/``soft_cap``/``sliding_window``, or ``k_scale``/``v_scale`` not scalars or
            given with a cache that is not FP8.

    Source: PagedAttention (Kwon et al., SOSP 2023); online softmax (Milakov & Gimelshein,
    2018); split-K combine as in Flash-Decoding (Dao et al., 2023).
    """
    num_q_heads, _, _ = check_caches_and_query(q, k_cache, v_cache, "[B, Hq, D]")
    batch = q.shape[0]
    if block_tables.ndim != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be [B={batch}, max_blocks], got {block_tables.shape}")
    if seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens must be [B={batch}], got {seq_lens.shape}")
    if block_tables.dtype != jnp.int32 or seq_lens.dtype != jnp.int32:
        raise ValueError(
            f"block_tables and seq_lens must be int32, got {block_tables.dtype} and "
            f"{seq_lens.dtype}"
        )
    check_options(scale, soft_cap, sliding_window, alibi_slopes, num_q_heads)
    return _paged_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        alibi_slopes,
        check_kv_scales(k_cache.dtype, k_scale, v_scale),
        scale=float(scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        sliding_window=None if sliding_window is None else int(sliding_window),
        interpret=bool(interpret),
        tiling=_TILING,
    )


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
    alibi_slopes: jax.Array | None = None,
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
) -> jax.Array:
    """Plain-JAX decode attention on contiguous K/V, for testing the kernel.

    Args:
        q: ``[B, Hq, D]``, each sequence's query at position ``seq_len - 1``.
        k, v: ``[B, S, Hkv, D]``, contiguous K/V of each sequence (``S >= max(seq_lens)``);
            positions ``>= seq_len`` may hold anything, NaN included.
        seq_lens: ``i32[B]``; 0 gives an all-zero row.
        scale, soft_cap, sliding_window, alibi_slopes: as in ``paged_attention``.
        k_scale, v_scale: with FP8 ``k``/``v``, each element is dequantized first,
            ``float(k) * k_scale`` (``fp8_kv_cache.dequantize_kv``; None means 1.0).

    Returns:
        ``[B, Hq, D]`` in ``q.dtype``, computed in float32 (einsum + masked softmax).
    """
    batch, num_q_heads, head_dim = q.shape
    seq_capacity, num_kv_heads = k.shape[1], k.shape[2]
    group = num_q_heads // num_kv_heads
    k = dequantize_kv(k, 1.0 if k_scale is None else k_scale)
    v = dequantize_kv(v, 1.0 if v_scale is None else v_scale)
    qf = q.astype(jnp.float32).reshape(batch, num_kv_heads, group, head_dim)
    scores = (
        jnp.einsum("bhgd,bshd->bhgs", qf, k.astype(jnp.float32), precision=lax.Precision.HIGHEST)
        * scale
    )
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    pos = jnp.arange(seq_capacity)[None, :]
    lens = seq_lens[:, None]
    if alibi_slopes is not None:  # slope * (key position - query position), per query head
        distance = (pos - (lens - 1)).astype(jnp.float32)  # [B, S]
        slopes = alibi_slopes.astype(jnp.float32).reshape(num_kv_heads, group)
        scores = scores + slopes[None, :, :, None] * distance[:, None, None, :]
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
