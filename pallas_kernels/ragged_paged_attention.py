"""Prefill / mixed attention: ragged query tokens over a paged KV cache with a cached prefix.

Layout of this file: the Pallas kernel body, the wrapper that maps query tiles to sequences,
the public ``ragged_paged_attention`` with its argument checks, and last the plain-JAX
``ragged_paged_attention_reference`` on contiguous K/V, which shares no code with the kernel.

Sequence ``b`` owns query tokens ``cu_q_lens[b]:cu_q_lens[b + 1]``; they are the last
``q_len_b`` positions of its context of ``seq_lens[b]`` tokens, so token ``i`` of sequence ``b``
sits at position ``seq_lens[b] - q_len_b + i`` and attends to every position up to its own
(cached prefix plus the new tokens before it). Their K/V are already in the cache.

Algorithm: PagedAttention (Kwon et al., SOSP 2023) block-table reads with an online softmax
(Milakov & Gimelshein, 2018), tiled as in FlashAttention-2 (Dao, 2023). The grid is
(query tile, KV head): a tile is up to ``q_tile`` consecutive tokens of one sequence times the
``Hq // Hkv`` query heads of one KV head; the tile-to-sequence map is built in plain JAX from
``cu_q_lens``, so the grid has a static size (``cdiv(T, q_tile) + B`` tiles, the unused ones
exit at once). Backend as in ``paged_attention``: Pallas Triton on GPU, ``interpret=True`` on CPU.
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
from pallas_kernels.paged_attention import _largest_power_of_two_at_most


@dataclasses.dataclass(frozen=True)
class RaggedTiling:
    """Static launch parameters of the ragged kernel (measured on the H200: docs/kernels.md).

    Attributes:
        rows: query rows (tokens x padded query heads of one KV head) per tile.
        block_k: K/V tokens per loop step (rounded to whole KV blocks); ``block_k_no_dot``
            when ``D < 16`` and the scores are a multiply-and-reduce instead of a dot.
        num_warps, num_stages: Triton's warps per program and software-pipelining depth.
    """

    rows: int = 64
    block_k: int = 64
    block_k_no_dot: int = 16
    num_warps: int = 4
    num_stages: int = 3


_TILING = RaggedTiling()


def _ragged_paged_attention_kernel(
    tile_seq_ref,  # i32[1]: sequence this tile belongs to
    tile_tok_ref,  # i32[1]: row of q holding the tile's first token
    tile_pos_ref,  # i32[1]: context position of the tile's first token
    tile_len_ref,  # i32[1]: real tokens in the tile (0 for an unused tile)
    tile_store_ref,  # i32[1]: rows of o the tile writes (an unused tile zeroes padding tokens)
    block_tables_ref,  # i32[B, max_blocks]: all block tables
    q_ref,  # [T, Hq, D]: all queries
    k_cache_ref,  # [num_blocks * block_size, D]: this KV head of the whole K cache, by slot
    v_cache_ref,  # [num_blocks * block_size, D]: this KV head of the whole V cache, by slot
    *refs,  # [kv_scales f32[2]], [alibi f32[Hq]], then o [T, Hq, D]: this program writes its
    # tile's real rows
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    use_kv_scales: bool,
    cache_dtype: Any,  # the caches' element dtype (an FP8 cache arrives as its bytes)
    use_alibi: bool,
    group: int,
    group_padded: int,
    q_tile: int,
    block_size: int,
    blocks_per_step: int,
    use_dot: bool,
):
    scales_ref, *refs = refs if use_kv_scales else (None, *refs)
    alibi_ref, o_ref = refs if use_alibi else (None, *refs)
    # FP8 cache: k_scale folds into the logit scale, v_scale into the output (as in
    # paged_attention).
    k_scale = scales_ref[0] if use_kv_scales else None
    head = pl.program_id(1)
    num_slots, head_dim = k_cache_ref.shape
    num_blocks = num_slots // block_size
    max_blocks = block_tables_ref.shape[1]
    rows = q_tile * group_padded
    block_k = blocks_per_step * block_size

    seq = tile_seq_ref[0]
    tok0 = tile_tok_ref[0]
    pos0 = tile_pos_ref[0]
    num_real = tile_len_ref[0]

    # Keys any row of this tile may see: [kv_first, kv_end). Steps before full_end lie wholly
    # at or before the tile's first position, so every row sees all their keys: no mask.
    kv_end = pos0 + num_real
    kv_first = 0 if sliding_window is None else jnp.maximum(pos0 - sliding_window + 1, 0)
    first = kv_first // block_k
    end = jnp.where(num_real > 0, pl.cdiv(kv_end, block_k), first)
    full_end = first if sliding_window is not None else jnp.clip((pos0 + 1) // block_k, first, end)

    # [q_tile, Gp, D] -> [rows, D], row = token_in_tile * Gp + head_in_group. Padding rows
    # (past the tile's tokens or the group) load 0 and are never stored.
    token_in_tile = lax.broadcasted_iota(jnp.int32, (q_tile, group_padded, 1), 0)
    head_in_group = lax.broadcasted_iota(jnp.int32, (q_tile, group_padded, 1), 1)
    real = (token_in_tile < num_real) & (head_in_group < group)
    tile_index = (pl.ds(tok0, q_tile), pl.ds(head * group, group_padded))
    q = pltriton.load(q_ref.at[tile_index], mask=real, other=0).reshape(rows, head_dim)
    stored = (token_in_tile < tile_store_ref[0]) & (head_in_group < group)
    row_pos = pos0 + token_in_tile.reshape(rows, 1)  # [rows, 1]
    row_real = (token_in_tile < num_real).reshape(rows, 1)
    if use_alibi:
        group_slopes = pltriton.load(
            alibi_ref.at[pl.ds(head * group, group_padded)],
            mask=lax.broadcasted_iota(jnp.int32, (group_padded,), 0) < group,  # no slices: Triton
            other=0,
        )  # [Gp]
        slopes = jnp.broadcast_to(group_slopes[None, :], (q_tile, group_padded)).reshape(rows, 1)
    token = lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    dim = lax.broadcasted_iota(jnp.int32, (1, head_dim), 1)

    def body(step, carry, *, masked):
        kpos = step * block_k + token  # [block_k]
        # 2-D slot gathers feed the dots directly, so Triton pipelines them (see
        # paged_attention); clipping keeps a bad table entry from reading out of bounds.
        column = step * blocks_per_step + token // block_size
        ids = pltriton.load(block_tables_ref.at[seq, column], mask=column < max_blocks, other=0)
        slots = (jnp.clip(ids, 0, num_blocks - 1) * block_size + token % block_size)[:, None]
        # Keys outside [kv_first, kv_end) may be stale (NaN), also those before a sliding
        # window inside seq_len: masked loads never read them and load 0.
        load_mask = None
        if masked:
            in_range = kpos < kv_end
            if sliding_window is not None:
                in_range &= kpos >= kv_first
            load_mask = in_range[:, None]
        other = 0 if masked else None
        k = pltriton.load(k_cache_ref.at[slots, dim], mask=load_mask, other=other)
        v = pltriton.load(v_cache_ref.at[slots, dim], mask=load_mask, other=other)
        k, v = from_cache_bytes(k, cache_dtype), from_cache_bytes(v, cache_dtype)
        s = block_scores(
            q, k.astype(q.dtype), scale=scale, soft_cap=soft_cap, use_dot=use_dot, k_scale=k_scale
        )
        if use_alibi:
            s = s + alibi_bias(slopes, row_pos, kpos)
        visible = None
        if masked:
            visible = row_real & (kpos[None, :] <= row_pos)  # causal, [rows, block_k]
            if sliding_window is not None:
                visible &= kpos[None, :] > row_pos - sliding_window
        return online_softmax_step(carry, s, v.astype(q.dtype), visible=visible, use_dot=use_dot)

    carry = initial_carry(rows, head_dim)
    carry = lax.fori_loop(first, full_end, functools.partial(body, masked=False), carry)
    o, _, row_sum = lax.fori_loop(full_end, end, functools.partial(body, masked=True), carry)
    # Rows with no visible key (padding tokens, unused tiles) are 0, not NaN.
    o = o / jnp.where(row_sum > 0, row_sum, 1.0)[:, None]
    if use_kv_scales:
        o = o * scales_ref[1]  # v_scale
    pltriton.store(
        o_ref.at[tile_index],
        o.reshape(q_tile, group_padded, head_dim).astype(o_ref.dtype),
        mask=stored,
    )


def _default_tiling(
    num_tokens: int,
    group: int,
    block_size: int,
    max_blocks: int,
    head_dim: int,
    tiling: RaggedTiling,
) -> tuple[int, int]:
    """(q_tile, blocks_per_step) for a shape: ``tiling.rows`` query rows, ``block_k`` keys."""
    use_dot = head_dim >= MIN_DOT_DIM
    target_block_k = tiling.block_k if use_dot else tiling.block_k_no_dot
    blocks_per_step = _largest_power_of_two_at_most(max(1, target_block_k // block_size))
    blocks_per_step = min(blocks_per_step, pl.next_power_of_2(max_blocks))
    while blocks_per_step * block_size < MIN_DOT_DIM:
        blocks_per_step *= 2
    group_padded = pl.next_power_of_2(group)
    q_tile = max(MIN_DOT_DIM, _largest_power_of_two_at_most(tiling.rows // group_padded))
    q_tile = min(q_tile, max(MIN_DOT_DIM, pl.next_power_of_2(num_tokens)))
    return q_tile, blocks_per_step


def _tile_map(cu_q_lens, seq_lens, num_tokens: int, num_tiles: int, q_tile: int):
    """Per tile: (sequence, first q row, first position, real tokens, rows to write).

    Tiles past the sequences' own cover the padding tokens ``cu_q_lens[B]:T`` and write zeros
    there; ``cdiv(T, q_tile) + B`` tiles always suffice for both.
    """
    num_seqs = seq_lens.shape[0]
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    tiles_per_seq = pl.cdiv(q_lens, q_tile)
    tile_end = jnp.cumsum(tiles_per_seq)
    tile_begin = tile_end - tiles_per_seq
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(tile_end, tile, side="right"), num_seqs - 1)
    seq = seq.astype(jnp.int32)
    used = tile < tile_end[-1]
    offset = (tile - tile_begin[seq]) * q_tile  # index of the tile's first token in its sequence
    padding_tok0 = cu_q_lens[num_seqs] + (tile - tile_end[-1]) * q_tile
    tok0 = jnp.where(used, cu_q_lens[seq] + offset, padding_tok0)
    pos0 = jnp.where(used, seq_lens[seq] - q_lens[seq] + offset, 0)
    num_real = jnp.where(used, jnp.clip(q_lens[seq] - offset, 0, q_tile), 0)
    num_store = jnp.where(used, num_real, jnp.clip(num_tokens - padding_tok0, 0, q_tile))
    as_i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    return as_i32(seq), as_i32(tok0), as_i32(pos0), as_i32(num_real), as_i32(num_store)


@functools.partial(
    jax.jit, static_argnames=("scale", "soft_cap", "sliding_window", "interpret", "tiling")
)
def _ragged_paged_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    cu_q_lens,
    alibi_slopes=None,
    kv_scales=None,
    *,
    scale,
    soft_cap,
    sliding_window,
    interpret,
    tiling,
):
    """The kernel launch; arguments already checked (``kv_scales``: ``f32[2]`` for an FP8
    cache, else None)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs, max_blocks = block_tables.shape
    group = num_q_heads // num_kv_heads
    q_tile, blocks_per_step = _default_tiling(
        num_tokens, group, block_size, max_blocks, head_dim, tiling
    )
    num_tiles = pl.cdiv(num_tokens, q_tile) + num_seqs  # >= sum_b cdiv(q_len_b, q_tile)
    tile_meta = _tile_map(cu_q_lens, seq_lens, num_tokens, num_tiles, q_tile)

    num_slots = num_blocks * block_size
    # An FP8 cache travels as its bytes (fp8_kv_cache.cache_bytes: masked loads pad with 0).
    k_slots = cache_bytes(k_cache).reshape(num_slots, num_kv_heads, head_dim)
    v_slots = cache_bytes(v_cache).reshape(num_slots, num_kv_heads, head_dim)
    kernel = functools.partial(
        _ragged_paged_attention_kernel,
        scale=scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        use_kv_scales=kv_scales is not None,
        cache_dtype=k_cache.dtype,
        use_alibi=alibi_slopes is not None,
        group=group,
        group_padded=pl.next_power_of_2(group),
        q_tile=q_tile,
        block_size=block_size,
        blocks_per_step=blocks_per_step,
        use_dot=head_dim >= MIN_DOT_DIM,
    )
    scalar_spec = pl.BlockSpec((1,), lambda j, h: (j,))
    cache_spec = pl.BlockSpec((num_slots, None, head_dim), lambda j, h: (0, h, 0))
    token_spec = pl.BlockSpec(q.shape, lambda j, h: (0, 0, 0))
    in_specs = [
        *[scalar_spec] * len(tile_meta),
        pl.BlockSpec(block_tables.shape, lambda j, h: (0, 0)),
        token_spec,  # q
        cache_spec,  # k_cache
        cache_spec,  # v_cache
    ]
    operands = [*tile_meta, block_tables, q, k_slots, v_slots]
    if kv_scales is not None:
        in_specs.append(pl.BlockSpec((2,), lambda j, h: (0,)))
        operands.append(kv_scales)
    if alibi_slopes is not None:
        in_specs.append(pl.BlockSpec((num_q_heads,), lambda j, h: (0,)))
        operands.append(alibi_slopes)
    return pl.pallas_call(
        kernel,
        grid=(num_tiles, num_kv_heads),
        in_specs=in_specs,
        out_specs=token_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltriton.CompilerParams(
            num_warps=tiling.num_warps, num_stages=tiling.num_stages
        ),
        interpret=interpret,
        name="ragged_paged_attention",
    )(*operands)


def ragged_paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    cu_q_lens: jax.Array,
    *,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    alibi_slopes: jax.Array | None = None,
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Causal attention of ragged query tokens over each sequence's paged K/V.

    Args:
        q: ``[T, Hq, D]``; tokens ``cu_q_lens[b]:cu_q_lens[b + 1]`` belong to sequence ``b``
            and are the last ``q_len_b`` positions of its context. Query head ``j`` uses KV head
            ``j // (Hq // Hkv)``.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, same shape and dtype, already
            holding the K/V of the new tokens; FP8 as in ``paged_attention``.
        block_tables: ``i32[B, max_blocks]``, as in ``paged_attention``.
        seq_lens: ``i32[B]``, context lengths including the new tokens; padding sequences
            have ``seq_len == q_len == 0``.
        cu_q_lens: ``i32[B + 1]``, non-decreasing, ``cu_q_lens[0] == 0``,
            ``cu_q_lens[B] <= T``; tokens at or past ``cu_q_lens[B]`` are padding.
        scale, soft_cap, sliding_window, alibi_slopes, k_scale, v_scale, interpret: as in
            ``paged_attention``;
            the window and the ALiBi distance use each token's own position ``p`` (keys
            ``p - w < pos <= p``; bias ``alibi_slopes[j] * (pos - p)``).

    Returns:
        ``[T, Hq, D]`` in ``q.dtype`` (float32 softmax and accumulation); padding tokens give 0.

    Assumes: ``q_len_b <= seq_lens[b]``; positions at or past ``seq_len`` hold stale data
    (possibly NaN) and never affect the result; block-table entries past
    ``ceil(seq_len / block_size)`` are arbitrary valid block ids. One program serves one tile of
    one sequence's tokens and all ``Hq // Hkv`` query heads of one KV head. On GPU,
    ``block_size`` and ``D`` must be powers of two.

    Raises:
        ValueError: mismatched K/V cache shapes or dtypes, ``Hq % Hkv != 0``, a ``D`` that
            differs between ``q`` and the cache, ``block_tables``/``seq_lens``/``cu_q_lens``
            whose batch sizes disagree or that are not int32, a bad
            ``scale``/``soft_cap``/``sliding_window``, ``alibi_slopes`` not ``f32[Hq]``, or
            ``k_scale``/``v_scale`` not scalars or given with a cache that is not FP8.

    Source: PagedAttention (Kwon et al., SOSP 2023); online softmax (Milakov & Gimelshein, 2018).
    """
    num_q_heads, _, _ = check_caches_and_query(q, k_cache, v_cache, "[T, Hq, D]")
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables must be [B, max_blocks], got {block_tables.shape}")
    num_seqs = block_tables.shape[0]
    if seq_lens.shape != (num_seqs,) or cu_q_lens.shape != (num_seqs + 1,):
        raise ValueError(
            f"block_tables has B={num_seqs} rows, so seq_lens must be [{num_seqs}] and cu_q_lens "
            f"[{num_seqs + 1}]; got {seq_lens.shape} and {cu_q_lens.shape}"
        )
    for name, array in (
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("cu_q_lens", cu_q_lens),
    ):
        if array.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {array.dtype}")
    check_options(scale, soft_cap, sliding_window, alibi_slopes, num_q_heads)
    return _ragged_paged_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        cu_q_lens,
        alibi_slopes,
        check_kv_scales(k_cache.dtype, k_scale, v_scale),
        scale=float(scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        sliding_window=None if sliding_window is None else int(sliding_window),
        interpret=bool(interpret),
        tiling=_TILING,
    )


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window"))
def ragged_paged_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    seq_lens: jax.Array,
    cu_q_lens: jax.Array,
    *,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    alibi_slopes: jax.Array | None = None,
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
) -> jax.Array:
    """Plain-JAX ragged causal attention on contiguous K/V, for testing the kernel.

    Args:
        q: ``[T, Hq, D]``, ragged as in ``ragged_paged_attention``.
        k, v: ``[B, S, Hkv, D]``, contiguous K/V of each sequence (``S >= max(seq_lens)``);
            positions ``>= seq_len`` may hold anything, NaN included.
        seq_lens: ``i32[B]``; cu_q_lens: ``i32[B + 1]``.
        scale, soft_cap, sliding_window, alibi_slopes: as in ``ragged_paged_attention``.
        k_scale, v_scale: as in ``paged_attention_reference`` (FP8 K/V dequantized first).

    Returns:
        ``[T, Hq, D]`` in ``q.dtype``, computed in float32; padding tokens give 0.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs, seq_capacity, num_kv_heads = k.shape[0], k.shape[1], k.shape[2]
    group = num_q_heads // num_kv_heads
    tok = jnp.arange(num_tokens)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, tok, side="right") - 1, 0, num_seqs - 1)
    is_real = (tok >= cu_q_lens[0]) & (tok < cu_q_lens[-1])
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    position = seq_lens[seq] - q_len + (tok - cu_q_lens[seq])  # [T]

    key_pos = jnp.arange(seq_capacity)[None, :]
    mask = is_real[:, None] & (key_pos <= position[:, None])  # [T, S]
    if sliding_window is not None:
        mask &= key_pos > position[:, None] - sliding_window

    qf = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
    k_tok = dequantize_kv(k, 1.0 if k_scale is None else k_scale)[seq]  # f32[T, S, Hkv, D]
    v_full = dequantize_kv(v, 1.0 if v_scale is None else v_scale)
    v_tok = jnp.where(mask[:, :, None, None], v_full[seq], 0.0)
    scores = jnp.einsum("thgd,tshd->thgs", qf, k_tok, precision=lax.Precision.HIGHEST) * scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    if alibi_slopes is not None:  # slope * (key position - query position), per query head
        distance = (key_pos - position[:, None]).astype(jnp.float32)  # [T, S]
        slopes = alibi_slopes.astype(jnp.float32).reshape(num_kv_heads, group)
        scores = scores + slopes[None, :, :, None] * distance[:, None, None, :]
    mask4 = mask[:, None, None, :]
    scores = jnp.where(mask4, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.where(mask4, jnp.exp(scores - row_max), 0.0)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    out = jnp.einsum("thgs,tshd->thgd", weights, v_tok, precision=lax.Precision.HIGHEST)
    out = out / jnp.where(denom > 0, denom, 1.0)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
