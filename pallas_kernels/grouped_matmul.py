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

import dataclasses
import functools

import jax
import jax.numpy as jnp

BACKENDS = ("xla", "mosaic_gpu")


@dataclasses.dataclass(frozen=True)
class MosaicTiles:
    """Static tiles of JAX's Mosaic GPU grouped GEMM (``ragged_dot_mgpu.ragged_dot``'s
    keyword arguments of the same names).

    Attributes:
        block_m, block_n: output tile (one warpgroup's wgmma accumulator, ``block_m x
            block_n`` float32). A row tile never spans two groups: a tile that straddles a
            group boundary is computed once per group, so ``M`` rows cost up to
            ``cdiv(M, block_m) + G - 1`` row tiles.
        block_k: K per pipeline step (64 bf16 = one 128-byte TMA row).
        max_concurrent_steps: pipeline stages in flight (shared memory: ``(block_m +
            block_n) * block_k * 2`` bytes each, plus the ``block_m x block_n`` output tile).
        grid_block_n: width, in output tiles, of the strips the persistent grid snakes over.
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_block_n: int = 1


# 128 x 128 output tiles, K in steps of 64 bf16, 4 stages in flight: the configuration JAX's own
# sweep of this kernel favours at K=2048; measured on the H200 at Mixtral's shapes at T = 1024
# as 48.3% of peak for the whole MoE layer (docs/benchmarks.md).
DEFAULT_TILES = MosaicTiles()

# Per-shape tiles, keyed by what is static at trace time: ``(max_m, k, n, tiles)``; the first
# entry with ``M <= max_m`` and matching ``k`` and ``n`` (None matches any) wins, else
# DEFAULT_TILES. ``benchmarks/moe.py --sweep`` prints entries in this form.
# Winners of the H200 sweep at Mixtral-8x7B's shapes (benchmarks/results/h200-round7-2026-12-01/
# call2/moe_sweep.log; % of 716 TFLOP/s): 64-row tiles waste less of the grid on tiles that
# straddle two experts (the kernel computes such a tile once per expert).
_WIDE = MosaicTiles(block_m=64, block_n=256, block_k=64, max_concurrent_steps=4, grid_block_n=1)
TILE_TABLE: tuple[tuple[int, int | None, int | None, MosaicTiles], ...] = (
    (512, 14336, 4096, _WIDE),  # down, T=256: 32.5% (default 26.7%)
    (512, 4096, 28672, _WIDE),  # gate_up, T=256: 31.9% (default 27.7%)
    (2048, 14336, 4096, _WIDE),  # down, T=1024: 67.9%
    (2048, 4096, 28672, _WIDE),  # gate_up, T=1024: 65.8% (default 60.7%)
)  # T=4096 (M=8192): the default's 73.6% won


def mosaic_tiles(m: int, k: int, n: int) -> MosaicTiles:
    """The tiles :func:`grouped_matmul` gives the Mosaic GPU kernel for an ``[M, K] x [G, K,
    N]`` product (module constant ``TILE_TABLE``, else ``DEFAULT_TILES``)."""
    for max_m, k_key, n_key, tiles in TILE_TABLE:
        if m <= max_m and k_key in (None, k) and n_key in (None, n):
            return tiles
    return DEFAULT_TILES


@functools.partial(jax.jit, static_argnames=("backend", "precision", "tiles"))
def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    backend: str = "xla",
    precision: jax.lax.Precision | None = None,
    tiles: MosaicTiles | None = None,
) -> jax.Array:
    """``out[r] = lhs[r] @ rhs[g(r)]`` for rows sorted by group.

    Args:
        lhs: ``[M, K]``, rows sorted by group.
        rhs: ``[G, K, N]``, same dtype as ``lhs`` for ``"mosaic_gpu"``.
        group_sizes: ``i32[G]``, summing to at most ``M`` (rows past the sum are unspecified).
        backend: "xla" or "mosaic_gpu" (module docstring).
        precision: of the "xla" matmul (``HIGHEST`` for true float32 on GPUs).
        tiles: of "mosaic_gpu"; None looks them up (:func:`mosaic_tiles`).

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
        if tiles is None:
            tiles = mosaic_tiles(lhs.shape[0], k, n)
        if k % tiles.block_k or n % tiles.block_n:
            raise ValueError(
                f"grouped_matmul mosaic_gpu needs K % {tiles.block_k} == 0 and "
                f"N % {tiles.block_n} == 0, got K={k}, N={n}"
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
        out = ragged_dot_mgpu.ragged_dot(lhs, rhs, group_sizes=sizes, **dataclasses.asdict(tiles))
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
