"""Grouped matmul for mixtures of experts: row group ``g`` of ``lhs`` times ``rhs[g]``.

Rows come sorted by group (expert): group ``g`` owns rows ``cumsum(group_sizes)[g - 1] ..
cumsum(group_sizes)[g] - 1``. Two backends, one contract:

- ``"xla"``: ``jax.lax.ragged_dot``. Exact and portable, but XLA:GPU's ``RaggedDotRewriter``
  expands it into a dense dot over a group-masked ``[M, G, K]`` operand (``G`` times the FLOPs,
  and every group's weights are read); XLA:CPU's lowering is dense too. The CPU/test path.
- ``"mosaic_gpu"``: JAX's Hopper grouped GEMM (``jax.experimental.pallas.ops.gpu.
  ragged_dot_mgpu``: TMA + wgmma, a persistent grid over the SMs, each ``block_m`` row tile
  inside one group), which does only the rows' own work. bf16/f16 operands of one dtype,
  ``K % 64 == 0`` and ``N % 128 == 0``; it still streams the weights of a group that owns no
  row but shares a row tile's start with its neighbour (decode batches touch every expert).

Shape letters: ``M`` rows (``T * k`` routed tokens), ``K`` in, ``N`` out, ``G`` groups.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

BACKENDS = ("xla", "mosaic_gpu")
# Mosaic GPU tile sizes: 128 x 128 output tiles (one warpgroup's wgmma accumulator), K in steps
# of 64 bf16 (128-byte TMA rows), 4 stages in flight; the configuration JAX's own sweep of this
# kernel favours at K=2048 (scripts/benchmark_moe.py re-measures it on the H200).
_MOSAIC_TILES = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4,
                     grid_block_n=1)  # fmt: skip


@functools.partial(jax.jit, static_argnames=("backend", "precision"))
def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    backend: str = "xla",
    precision: jax.lax.Precision | None = None,
) -> jax.Array:
    """``out[r] = lhs[r] @ rhs[g(r)]`` for rows sorted by group.

    Args:
        lhs: ``[M, K]``, rows sorted by group.
        rhs: ``[G, K, N]``, same dtype as ``lhs`` for ``"mosaic_gpu"``.
        group_sizes: ``i32[G]``, summing to at most ``M`` (rows past the sum are unspecified).
        backend: "xla" or "mosaic_gpu" (module docstring).
        precision: of the "xla" matmul (``HIGHEST`` for true float32 on GPUs).

    Returns:
        ``[M, N]`` in ``lhs``'s dtype.

    Raises:
        ValueError: unknown backend, mismatched shapes, or a shape/dtype "mosaic_gpu" cannot
            take (named with the value).
    """
    (_, k), (g, k2, n) = lhs.shape, rhs.shape
    if k != k2 or group_sizes.shape != (g,):
        raise ValueError(
            f"grouped_matmul: lhs {lhs.shape}, rhs {rhs.shape} and group_sizes "
            f"{group_sizes.shape} must be [M, K], [G, K, N] and [G]"
        )
    if backend == "xla":
        return jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32), precision=precision)
    if backend == "mosaic_gpu":
        if lhs.dtype != rhs.dtype or lhs.dtype not in (jnp.bfloat16, jnp.float16):
            raise ValueError(
                f"grouped_matmul mosaic_gpu needs bf16 or f16 operands of one dtype, got "
                f"{lhs.dtype} and {rhs.dtype}"
            )
        if k % _MOSAIC_TILES["block_k"] or n % _MOSAIC_TILES["block_n"]:
            raise ValueError(
                f"grouped_matmul mosaic_gpu needs K % {_MOSAIC_TILES['block_k']} == 0 and "
                f"N % {_MOSAIC_TILES['block_n']} == 0, got K={k}, N={n}"
            )
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu  # GPU-only imports

        # Its TMA loads need M below 8 or a multiple of 8 (M = 130 failed on the H200): pad
        # with zero rows counted in the last group, and drop their output rows.
        m = lhs.shape[0]
        padded = m if m < 8 else -(-m // 8) * 8
        sizes = group_sizes.astype(jnp.int32)
        if padded != m:
            lhs = jnp.pad(lhs, ((0, padded - m), (0, 0)))
            sizes = sizes.at[-1].add(padded - m)
        out = ragged_dot_mgpu.ragged_dot(lhs, rhs, group_sizes=sizes, **_MOSAIC_TILES)
        return out[:m]
    raise ValueError(f"grouped_matmul backend must be one of {list(BACKENDS)}, got {backend!r}")


def grouped_matmul_reference(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Plain-JAX reference of :func:`grouped_matmul`: each row's group found by
    ``searchsorted`` over the group ends, its weight matrix gathered, float32 accumulation.
    ``[M, K] x [G, K, N] -> f32[M, N]``; rows past ``sum(group_sizes)`` are zero."""
    ends = jnp.cumsum(group_sizes)
    rows = jnp.arange(lhs.shape[0])
    group = jnp.searchsorted(ends, rows, side="right")
    valid = rows < ends[-1]
    weights = rhs[jnp.minimum(group, rhs.shape[0] - 1)].astype(jnp.float32)  # [M, K, N]
    out = jnp.einsum("mk,mkn->mn", lhs.astype(jnp.float32), weights,
                     precision=jax.lax.Precision.HIGHEST)  # fmt: skip
    return jnp.where(valid[:, None], out, 0.0)
