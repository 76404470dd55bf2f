"""Attention over the paged KV cache, dispatched to a backend.

``"pallas"`` runs the kernels of ``pallas_kernels`` on the cache itself; ``"reference"`` gathers
each sequence's blocks into contiguous K/V and runs the plain-JAX references (slow, exact; for
tests and for checking the kernels inside a whole model). Shape letters as in ``pallas_kernels``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

import pallas_kernels
from models.attention_backends import ATTENTION_BACKENDS
from models.attention_metadata import AttentionMetadata
from models.sharding import TP_AXIS, shard_over_heads
from pallas_kernels.fp8_kv_cache import check_kv_scales


def kv_cache_head_dim(head_dim: int, backend: str) -> int:
    """``D`` of the KV cache (and of the attention call) for a model whose heads have
    ``head_dim``.

    The Pallas kernels lower through Triton on GPU, whose tiles must be powers of two, so with
    ``backend="pallas"`` a head dim that is not one (Phi-3's 96) is zero-padded up to the next
    (128): zero columns add nothing to ``q . k``, and the output's zero columns are cut off.
    ``"reference"`` keeps ``head_dim``. The cost is KV memory and reads in the ratio (4/3 for
    Phi-3).
    """
    if backend == "pallas":
        return 1 << (int(head_dim) - 1).bit_length()
    return int(head_dim)


def gather_kv(cache: jax.Array, block_tables: jax.Array) -> jax.Array:
    """Contiguous per-sequence K or V from the paged cache.

    Args:
        cache: ``[num_blocks, block_size, Hkv, D]``.
        block_tables: ``i32[B, max_blocks]``.

    Returns:
        ``[B, max_blocks * block_size, Hkv, D]``; row ``b``, position ``p`` is slot
        ``block_tables[b, p // block_size] * block_size + p % block_size``. Positions at or past
        ``seq_lens[b]`` hold whatever the cache held (stale data): the references mask them.
    """
    num_seqs, max_blocks = block_tables.shape
    _, block_size, num_kv_heads, head_dim = cache.shape
    gathered = cache[block_tables]  # [B, max_blocks, block_size, Hkv, D]
    return gathered.reshape(num_seqs, max_blocks * block_size, num_kv_heads, head_dim)


def attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    metadata: AttentionMetadata,
    *,
    backend: str,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    alibi_slopes: Sequence[float] | jax.Array | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    interpret: bool = False,
    mesh: Mesh | None = None,
) -> jax.Array:
    """Causal attention of this step's queries over the cached context (already updated).

    Args:
        q: ``[T, Hq, D]``, packed as described by ``metadata`` (``T == B`` when
            ``metadata.decode_only``).
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, holding this step's K/V too;
            an FP8 cache (``kv_cache_dtype="fp8"``) holds ``k / k_scale`` and ``v / v_scale``.
        metadata: block tables, ``seq_lens``, ``cu_q_lens`` and the static ``decode_only``.
        backend: "pallas" (kernels on the paged cache) or "reference" (gather + references).
        scale: multiplier of ``q . k`` (usually ``D ** -0.5``).
        soft_cap: if set, scores become ``soft_cap * tanh(scores / soft_cap)``.
        sliding_window: if set, a query at position ``p`` sees keys at ``p - w < k <= p``.
        alibi_slopes: ``Hq`` slopes (the whole model's heads, also under ``mesh``) or None; if
            set, head ``j``'s score of key position ``k`` gains ``slope_j * (k - p)`` (ALiBi).
        k_scale, v_scale: the layer's FP8 cache scales (``f32[]``; None means 1.0), or None
            with any other cache. Both backends dequantize ``float(k_fp8) * k_scale``: the
            kernels fold the scales into the logits and the output, the references multiply
            each element.
        interpret: run Pallas kernels in interpret mode (CPU).
        mesh: tensor parallelism: this same function runs per device on its heads inside
            ``jax.shard_map`` (``models.sharding.shard_over_heads``); None on one device.

    Returns:
        ``[T, Hq, D]``; rows of padding tokens are unspecified.

    Raises:
        ValueError: unknown ``backend``; scales with a cache that is not FP8.
    """
    if mesh is not None:
        per_device = functools.partial(
            _attention_per_device,
            backend=backend,
            scale=scale,
            soft_cap=soft_cap,
            sliding_window=sliding_window,
            alibi_slopes=alibi_slopes,
            interpret=interpret,
        )
        # The scales travel with the metadata: replicated on every device.
        return shard_over_heads(per_device, mesh)(
            q, k_cache, v_cache, (metadata, k_scale, v_scale)
        )
    if alibi_slopes is not None:
        alibi_slopes = jnp.asarray(alibi_slopes, jnp.float32)
    kwargs = dict(
        scale=scale, soft_cap=soft_cap, sliding_window=sliding_window, alibi_slopes=alibi_slopes,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    if backend == "pallas":
        if metadata.decode_only:
            return pallas_kernels.paged_attention(
                q, k_cache, v_cache, metadata.block_tables, metadata.seq_lens,
                interpret=interpret, **kwargs,
            )
        return pallas_kernels.ragged_paged_attention(
            q, k_cache, v_cache, metadata.block_tables, metadata.seq_lens, metadata.cu_q_lens,
            interpret=interpret, **kwargs,
        )
    if backend == "reference":
        check_kv_scales(k_cache.dtype, k_scale, v_scale)
        k = gather_kv(k_cache, metadata.block_tables)
        v = gather_kv(v_cache, metadata.block_tables)
        if metadata.decode_only:
            return pallas_kernels.paged_attention_reference(q, k, v, metadata.seq_lens, **kwargs)
        return pallas_kernels.ragged_paged_attention_reference(
            q, k, v, metadata.seq_lens, metadata.cu_q_lens, **kwargs
        )
    raise ValueError(
        f"attention backend must be one of {list(ATTENTION_BACKENDS)}, got {backend!r}"
    )


def _attention_per_device(q, k_cache, v_cache, replicated, *, alibi_slopes, **kwargs):
    """:func:`attention` on one device's heads inside ``shard_map``: device ``i`` of the ``tp``
    axis holds query heads ``[i * n, (i + 1) * n)`` (``n = Hq / tp``), so it takes those
    heads' ALiBi slopes. ``replicated`` is ``(metadata, k_scale, v_scale)``."""
    metadata, k_scale, v_scale = replicated
    if alibi_slopes is not None:
        num_local = q.shape[1]
        slopes = jnp.asarray(alibi_slopes, jnp.float32)
        start = jax.lax.axis_index(TP_AXIS) * num_local
        alibi_slopes = jax.lax.dynamic_slice_in_dim(slopes, start, num_local)
    return attention(
        q, k_cache, v_cache, metadata, alibi_slopes=alibi_slopes, k_scale=k_scale,
        v_scale=v_scale, **kwargs,
    )  # fmt: skip
