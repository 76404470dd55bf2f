"""Prefill / mixed attention: ragged query tokens over a paged KV cache with a cached prefix.

Layout of this file: the Pallas kernel body, the wrapper that maps query tiles to sequences,
the public ``ragged_paged_attention`` with its argument checks, and last the plain-JAX
``ragged_paged_attention_reference`` on contiguous K/V, which shares no code with the kernel.

Sequence ``b`` owns query tokens ``cu_q_lens[b]:cu_q_lens[b + 1]``; they are the last
``q_len_b`` positions of its context of ``seq_lens[b]`` tokens, so token ``i`` of sequence ``b``
sits at position ``seq_lens[b] - q_len_b + i`` and attends to every position up to its own
(cached prefix plus the new tokens before it). Their K/V are already in the cache.

Algorithm: PagedAttention (Kwon et al., SOSP 2023) block-table reads with an online softmax
(Milakov & Gimelshein, 2018). The grid is (query tile, KV head): a tile is up to ``q_tile``
consecutive tokens of one sequence; the tile-to-sequence map is built in plain JAX from
``cu_q_lens``, so the grid has a static size (``cdiv(T, q_tile) + B`` tiles, the unused ones
exit at once). Backend as in ``paged_attention``: Pallas Triton on GPU, ``interpret=True`` on CPU.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.paged_attention import _check_options, _largest_power_of_two_at_most

# Finite score for masked positions; their probabilities are zeroed explicitly as well.
_MASK_VALUE = -1e30
# Tokens of K/V handled per loop step (rounded to whole blocks), with and without a dot.
_TARGET_BLOCK_K = 64
_TARGET_BLOCK_K_NO_DOT = 16
# Query rows (tokens x padded query heads) per tile, the target for large prefills.
_TARGET_ROWS = 64
# Triton's tensor-core dot needs every dimension >= 16.
_MIN_DOT_DIM = 16


def _ragged_paged_attention_kernel(
    tile_seq_ref,  # i32[1]: sequence this tile belongs to
    tile_tok_ref,  # i32[1]: row of q holding the tile's first token
    tile_pos_ref,  # i32[1]: context position of the tile's first token
    tile_len_ref,  # i32[1]: real tokens in the tile (0 for an unused tile)
    block_tables_ref,  # i32[B, max_blocks_padded]: all block tables
    q_ref,  # [T + q_tile, Gp, D]: this KV head's query heads, zero-padded to Gp
    k_cache_ref,  # [num_blocks, block_size, D]: this KV head of the whole K cache
    v_cache_ref,  # [num_blocks, block_size, D]: this KV head of the whole V cache
    o_ref,  # f32[q_tile * Gp, D]: normalised output, row = token_in_tile * Gp + head
    *,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    blocks_per_step: int,
    use_dot: bool,
):
    num_blocks, block_size, head_dim = k_cache_ref.shape
    q_tile = o_ref.shape[0] // q_ref.shape[1]
    group_padded = q_ref.shape[1]
    rows = q_tile * group_padded
    block_k = blocks_per_step * block_size

    seq = tile_seq_ref[0]
    tok0 = tile_tok_ref[0]
    pos0 = tile_pos_ref[0]
    num_real = tile_len_ref[0]

    # Keys any row of this tile may see: [kv_first, kv_end).
    kv_end = pos0 + num_real
    kv_first = 0 if sliding_window is None else jnp.maximum(pos0 - sliding_window + 1, 0)
    start_step = (kv_first // block_size) // blocks_per_step
    end_step = pl.cdiv(pl.cdiv(kv_end, block_size), blocks_per_step)
    end_step = jnp.where(num_real > 0, end_step, start_step)

    q = q_ref[pl.ds(tok0, q_tile)].reshape(rows, head_dim)
    token_in_tile = lax.broadcasted_iota(jnp.int32, (q_tile, group_padded), 0).reshape(rows, 1)
    row_pos = pos0 + token_in_tile  # [rows, 1]
    row_real = token_in_tile < num_real

    def body(step, carry):
        o_prev, m_prev, l_prev = carry
        ids = block_tables_ref[seq, pl.ds(step * blocks_per_step, blocks_per_step)]
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
        s = s * scale  # [rows, block_k]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)

        kpos = step * block_k + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        visible = row_real & (kpos <= row_pos)  # causal, [rows, block_k]
        if sliding_window is not None:
            visible &= kpos > row_pos - sliding_window
        s = jnp.where(visible, s, _MASK_VALUE)

        m_next = jnp.maximum(m_prev, jnp.max(s, axis=-1))
        correction = jnp.exp(m_prev - m_next)
        p = jnp.where(visible, jnp.exp(s - m_next[:, None]), 0.0)
        l_next = correction * l_prev + jnp.sum(p, axis=-1)
        # Positions >= kv_end may be stale (NaN) and 0 * NaN = NaN: zero V there, not just p.
        v = jnp.where((kpos < kv_end).reshape(block_k, 1), v, jnp.zeros_like(v))
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
    o, _, row_sum = lax.fori_loop(start_step, end_step, body, init)
    # Rows with no visible key (padding rows, unused tiles) are 0, not NaN.
    o_ref[...] = o / jnp.where(row_sum > 0, row_sum, 1.0)[:, None]


def _default_tiling(num_tokens: int, group: int, block_size: int, max_blocks: int,
                    head_dim: int) -> tuple[int, int]:
    """(q_tile, blocks_per_step) for a shape: ~64 query rows and ~64 keys per step."""
    use_dot = head_dim >= _MIN_DOT_DIM
    target_block_k = _TARGET_BLOCK_K if use_dot else _TARGET_BLOCK_K_NO_DOT
    blocks_per_step = _largest_power_of_two_at_most(max(1, target_block_k // block_size))
    blocks_per_step = min(blocks_per_step, pl.next_power_of_2(max_blocks))
    while blocks_per_step * block_size < _MIN_DOT_DIM:
        blocks_per_step *= 2
    group_padded = pl.next_power_of_2(group)
    q_tile = max(_MIN_DOT_DIM, _largest_power_of_two_at_most(_TARGET_ROWS // group_padded))
    q_tile = min(q_tile, max(_MIN_DOT_DIM, pl.next_power_of_2(num_tokens)))
    return q_tile, blocks_per_step


def _tile_map(cu_q_lens, seq_lens, num_tiles: int, q_tile: int):
    """Per tile: (sequence, first q row, first position, real tokens); and per-seq first tile."""
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
    tok0 = jnp.where(used, cu_q_lens[seq] + offset, 0)
    pos0 = jnp.where(used, seq_lens[seq] - q_lens[seq] + offset, 0)
    num_real = jnp.where(used, jnp.clip(q_lens[seq] - offset, 0, q_tile), 0)
    as_i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    return (as_i32(seq), as_i32(tok0), as_i32(pos0), as_i32(num_real)), tile_begin


@functools.partial(
    jax.jit,
    static_argnames=("scale", "soft_cap", "sliding_window", "interpret", "q_tile",
                     "blocks_per_step"))
def _ragged_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_q_lens, *, scale,
                            soft_cap, sliding_window, interpret, q_tile, blocks_per_step):
    """The kernel launch and the tile-to-token gather; arguments already checked."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs, max_blocks = block_tables.shape
    group = num_q_heads // num_kv_heads
    group_padded = pl.next_power_of_2(group)
    rows = q_tile * group_padded
    num_tiles = pl.cdiv(num_tokens, q_tile) + num_seqs  # >= sum_b cdiv(q_len_b, q_tile)

    tile_meta, tile_begin = _tile_map(cu_q_lens, seq_lens, num_tiles, q_tile)
    # Extra columns point at block 0; keys from them are past kv_end and never used.
    block_tables = jnp.pad(
        block_tables, ((0, 0), (0, pl.cdiv(max_blocks, blocks_per_step) * blocks_per_step
                                - max_blocks)))
    # [T + q_tile, Hkv, Gp, D]: the extra q_tile rows let the last tile read a full tile.
    q_padded = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    q_padded = jnp.pad(q_padded, ((0, q_tile), (0, 0), (0, group_padded - group), (0, 0)))

    kernel = functools.partial(
        _ragged_paged_attention_kernel, scale=scale, soft_cap=soft_cap,
        sliding_window=sliding_window, blocks_per_step=blocks_per_step,
        use_dot=head_dim >= _MIN_DOT_DIM)
    scalar_spec = pl.BlockSpec((1,), lambda j, h: (j,))
    cache_spec = pl.BlockSpec((num_blocks, block_size, None, head_dim),
                              lambda j, h: (0, 0, h, 0))
    o = pl.pallas_call(
        kernel,
        grid=(num_tiles, num_kv_heads),
        in_specs=[
            scalar_spec, scalar_spec, scalar_spec, scalar_spec,  # tile map
            pl.BlockSpec(block_tables.shape, lambda j, h: (0, 0)),
            pl.BlockSpec((num_tokens + q_tile, None, group_padded, head_dim),
                         lambda j, h: (0, h, 0, 0)),  # q
            cache_spec,  # k_cache
            cache_spec,  # v_cache
        ],
        out_specs=pl.BlockSpec((None, None, rows, head_dim), lambda j, h: (j, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((num_tiles, num_kv_heads, rows, head_dim), jnp.float32),
        interpret=interpret,
        name="ragged_paged_attention",
    )(*tile_meta, block_tables, q_padded, k_cache, v_cache)

    # Token t of sequence b lives in tile tile_begin[b] + i // q_tile at row i % q_tile.
    tok = jnp.arange(num_tokens, dtype=jnp.int32)
    seq_of_tok = jnp.clip(jnp.searchsorted(cu_q_lens, tok, side="right") - 1, 0, num_seqs - 1)
    index_in_seq = tok - cu_q_lens[seq_of_tok]
    tile_of_tok = tile_begin[seq_of_tok] + index_in_seq // q_tile
    o = o.reshape(num_tiles, num_kv_heads, q_tile, group_padded, head_dim)
    out = o[tile_of_tok, :, index_in_seq % q_tile, :group, :]  # [T, Hkv, G, D]
    real = (tok >= cu_q_lens[0]) & (tok < cu_q_lens[num_seqs])
    out = jnp.where(real[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


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
    interpret: bool = False,
) -> jax.Array:
    """Causal attention of ragged query tokens over each sequence's paged K/V.

    Args:
        q: ``[T, Hq, D]``; tokens ``cu_q_lens[b]:cu_q_lens[b + 1]`` belong to sequence ``b``
            and are the last ``q_len_b`` positions of its context. Query head ``j`` uses KV head
            ``j // (Hq // Hkv)``.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, same shape and dtype, already
            holding the K/V of the new tokens.
        block_tables: ``i32[B, max_blocks]``, as in ``paged_attention``.
        seq_lens: ``i32[B]``, context lengths including the new tokens; padding sequences
            have ``seq_len == q_len == 0``.
        cu_q_lens: ``i32[B + 1]``, non-decreasing, ``cu_q_lens[0] == 0``,
            ``cu_q_lens[B] <= T``; tokens at or past ``cu_q_lens[B]`` are padding.
        scale, soft_cap, sliding_window, interpret: as in ``paged_attention``; the window
            applies to each token's own position ``p`` (keys ``p - w < pos <= p``).

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
            whose batch sizes disagree or that are not int32, or a bad
            ``scale``/``soft_cap``/``sliding_window``.

    Source: PagedAttention (Kwon et al., SOSP 2023); online softmax (Milakov & Gimelshein, 2018).
    """
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, Hkv, D] of one dtype, got "
            f"{k_cache.shape} {k_cache.dtype} and {v_cache.shape} {v_cache.dtype}")
    if q.ndim != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {q.shape}")
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if head_dim != cache_head_dim:
        raise ValueError(f"q has D={head_dim} but the cache has D={cache_head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"Hq must be a multiple of Hkv, got Hq={num_q_heads} and Hkv={num_kv_heads}")
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables must be [B, max_blocks], got {block_tables.shape}")
    num_seqs = block_tables.shape[0]
    if seq_lens.shape != (num_seqs,) or cu_q_lens.shape != (num_seqs + 1,):
        raise ValueError(
            f"block_tables has B={num_seqs} rows, so seq_lens must be [{num_seqs}] and cu_q_lens "
            f"[{num_seqs + 1}]; got {seq_lens.shape} and {cu_q_lens.shape}")
    for name, array in (("block_tables", block_tables), ("seq_lens", seq_lens),
                        ("cu_q_lens", cu_q_lens)):
        if array.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {array.dtype}")
    _check_options(scale, soft_cap, sliding_window)
    q_tile, blocks_per_step = _default_tiling(num_tokens, num_q_heads // num_kv_heads,
                                              block_size, block_tables.shape[1], head_dim)
    return _ragged_paged_attention(
        q, k_cache, v_cache, block_tables, seq_lens, cu_q_lens, scale=float(scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        sliding_window=None if sliding_window is None else int(sliding_window),
        interpret=bool(interpret), q_tile=q_tile, blocks_per_step=blocks_per_step)


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
) -> jax.Array:
    """Plain-JAX ragged causal attention on contiguous K/V, for testing the kernel.

    Args:
        q: ``[T, Hq, D]``, ragged as in ``ragged_paged_attention``.
        k, v: ``[B, S, Hkv, D]``, contiguous K/V of each sequence (``S >= max(seq_lens)``);
            positions ``>= seq_len`` may hold anything, NaN included.
        seq_lens: ``i32[B]``; cu_q_lens: ``i32[B + 1]``.
        scale, soft_cap, sliding_window: as in ``ragged_paged_attention``.

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
    k_tok = k.astype(jnp.float32)[seq]  # [T, S, Hkv, D]
    v_tok = jnp.where(mask[:, :, None, None], v.astype(jnp.float32)[seq], 0.0)
    scores = jnp.einsum("thgd,tshd->thgs", qf, k_tok, precision=lax.Precision.HIGHEST) * scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    mask4 = mask[:, None, None, :]
    scores = jnp.where(mask4, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.where(mask4, jnp.exp(scores - row_max), 0.0)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    out = jnp.einsum("thgs,tshd->thgd", weights, v_tok, precision=lax.Precision.HIGHEST)
    out = out / jnp.where(denom > 0, denom, 1.0)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
