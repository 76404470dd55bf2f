"""Per-row expert matmul for MoE decode: ``out[r] = x[r] @ w[expert_ids[r]]``, reading only the
experts some row uses.

Why (docs/benchmarks.md, "Model families"): at decode (``T * k`` of a few dozen rows) the Mosaic GPU
grouped GEMM (``pallas_kernels.grouped_matmul``) still streams every expert's weights: its
static grid gives each group a row tile, and an empty group's tile loads its weights before
finding no row to store. Mixtral's batch-1 TPOT sat near the all-experts floor. Gathering the
chosen experts' weights in XLA (``w[ids]``) instead writes a copy of them first (read, write,
read again: 3x the active bytes, for a saving of only 8 -> 6 expert reads at k = 2).

Design (same shape as ``pallas_kernels.lora_bgmv``). One ``pallas_call``; the grid is (row tiles,
output tiles, K splits). Each program walks the ``E`` experts; for an expert that a row of its
tile uses, it adds ``where(row's expert == e, x, 0)[:, K chunk] @ w[e, K chunk, out tile]`` to a
float32 accumulator in ``block_k`` steps; an expert no row of the tile uses costs a zero-trip
loop, so its weights are never read. Rows are in any order (no sort by expert); a row whose id is
outside ``[0, E)`` gives zeros. With ``split_k > 1`` each program covers a ``1 / split_k`` share
of K and writes a float32 partial; XLA sums the partials (``down_proj``'s N = 4096 gives only 32
output tiles of 128, too few programs to pull the weights at full bandwidth).

HBM bytes: ``u * K * N`` weight elements for ``u`` distinct experts in the row tile (once per
tile; at decode one tile holds every row), plus ``x`` and the output. Tiles: ``ExpertGemvTiling``
(unmeasured defaults; ``benchmarks/moe.py --sweep`` times a few).

Backend: Pallas Triton on GPU (``interpret=True`` on CPU). Triton's dot needs every dimension
>= 16 and power-of-two tiles: the row tile is ``M`` rounded up to a power of two, at least 16
(padding rows load as zero and are never stored); K and N tails are masked.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.online_softmax import MIN_DOT_DIM
from pallas_kernels.split_k import split_k_count


@dataclasses.dataclass(frozen=True)
class ExpertGemvTiling:
    """Static launch parameters of :func:`expert_gemv` (not yet measured on a GPU).

    Attributes:
        max_block_m: largest row tile (more rows take several tiles, each reading its own
            experts' weights again).
        block_n: output columns per program.
        block_k: K per step.
        split_k: K splits (float32 partials summed by XLA); None: ``pallas_kernels.split_k``'s
            choice (about two programs per SM, at most ``K / (4 * block_k)``).
        num_warps, num_stages: Triton's warps per program and software-pipelining depth.
    """

    max_block_m: int = 64
    block_n: int = 128
    block_k: int = 128
    split_k: int | None = None
    num_warps: int = 4
    num_stages: int = 3


DEFAULT_TILING = ExpertGemvTiling()


def _expert_gemv_kernel(
    ids_ref,  # i32[M]: each row's expert
    x_ref,  # [M, K]
    w_ref,  # [E * K, N]: expert e owns rows e*K .. (e+1)*K - 1
    o_ref,  # f32[split_k, M, N]
    *,
    num_experts: int,
    block_m: int,
    block_n: int,
    block_k: int,
    steps_per_split: int,
):
    num_rows, k_total = x_ref.shape
    n_total = o_ref.shape[2]
    m0 = pl.program_id(0) * block_m
    n0 = pl.program_id(1) * block_n
    split = pl.program_id(2)
    rows = pl.ds(m0, block_m)
    cols = pl.ds(n0, block_n)
    row_ok = m0 + lax.broadcasted_iota(jnp.int32, (block_m,), 0) < num_rows
    col_ok = n0 + lax.broadcasted_iota(jnp.int32, (1, block_n), 1) < n_total
    k_iota = lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    ids = pltriton.load(ids_ref.at[rows], mask=row_ok, other=-1)  # [block_m]
    first_step = split * steps_per_split
    num_steps = jnp.minimum(steps_per_split, pl.cdiv(k_total, block_k) - first_step)
    precision = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)  # IEEE for f32, none for bf16

    def expert_body(e, acc):
        mine = ids == e  # [block_m]
        used = jnp.max(mine.astype(jnp.int32)) > 0

        def step(i, acc):
            k0 = (first_step + i) * block_k
            k_ok = k0 + k_iota < k_total
            x = pltriton.load(
                x_ref.at[rows, pl.ds(k0, block_k)], mask=row_ok[:, None] & k_ok[None, :], other=0
            )
            x = jnp.where(mine[:, None], x, jnp.zeros_like(x))
            w = pltriton.load(
                w_ref.at[pl.ds(e * k_total + k0, block_k), cols],
                mask=k_ok[:, None] & col_ok,
                other=0,
            )
            return acc + lax.dot(x, w, precision=precision, preferred_element_type=jnp.float32)

        # An expert no row of the tile uses: zero steps, its weights never read.
        return lax.fori_loop(0, jnp.where(used, num_steps, 0), step, acc)

    acc = lax.fori_loop(0, num_experts, expert_body, jnp.zeros((block_m, block_n), jnp.float32))
    pltriton.store(o_ref.at[split, rows, cols], acc, mask=row_ok[:, None] & col_ok)


@functools.partial(jax.jit, static_argnames=("interpret", "tiling"))
def _expert_gemv(x, expert_ids, w, *, interpret, tiling):
    """The launch; arguments already checked."""
    (num_rows, k), (num_experts, _, n) = x.shape, w.shape
    block_m = min(max(MIN_DOT_DIM, pl.next_power_of_2(num_rows)), tiling.max_block_m)
    block_n = min(tiling.block_n, max(MIN_DOT_DIM, pl.next_power_of_2(n)))
    block_k = min(tiling.block_k, max(MIN_DOT_DIM, pl.next_power_of_2(k)))
    tiling = dataclasses.replace(tiling, block_k=block_k)
    grid_mn = (pl.cdiv(num_rows, block_m), pl.cdiv(n, block_n))
    split_k = split_k_count(tiling.split_k, tiling.block_k, k, grid_mn[0] * grid_mn[1])
    kernel = functools.partial(
        _expert_gemv_kernel,
        num_experts=num_experts,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        steps_per_split=pl.cdiv(pl.cdiv(k, block_k), split_k),
    )

    def whole(shape):  # every program sees the whole array and masks its own tile
        return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))

    w_flat = w.reshape(num_experts * k, n)  # free: contiguous
    partials = pl.pallas_call(
        kernel,
        grid=(*grid_mn, split_k),
        in_specs=[whole(expert_ids.shape), whole(x.shape), whole(w_flat.shape)],
        out_specs=whole((split_k, num_rows, n)),
        out_shape=jax.ShapeDtypeStruct((split_k, num_rows, n), jnp.float32),
        compiler_params=pltriton.CompilerParams(
            num_warps=tiling.num_warps, num_stages=tiling.num_stages
        ),
        interpret=interpret,
        name="expert_gemv",
    )(expert_ids, x, w_flat)
    return jnp.sum(partials, axis=0).astype(x.dtype)


def expert_gemv(
    x: jax.Array,
    expert_ids: jax.Array,
    w: jax.Array,
    *,
    interpret: bool = False,
    tiling: ExpertGemvTiling | None = None,
) -> jax.Array:
    """Each row times its own expert's weights, ``[M, N]``, in one kernel launch.

    Args:
        x: ``[M, K]`` (float32, bfloat16 or float16), rows in any order.
        expert_ids: ``i32[M]``, each row's expert in ``[0, E)``; any other value gives a
            zero row.
        w: ``[E, K, N]``, same dtype as ``x``.
        interpret: run the Pallas kernel in interpret mode (CPU tests).
        tiling: launch parameters; None reads the module's ``DEFAULT_TILING`` (at trace
            time, so the sweep can swap it).

    Returns:
        ``[M, N]`` in ``x.dtype``, accumulated in float32 (float32 inputs at full float32
        precision, no TF32).

    Raises:
        ValueError: ``x`` not 2-D, ``expert_ids`` not ``i32[M]``, or ``w`` not ``[E, K, N]``
            of ``x``'s dtype (each named with its shape or dtype).
    """
    if x.ndim != 2:
        raise ValueError(f"expert_gemv: x must be [M, K], got {x.shape}")
    num_rows, k = x.shape
    if expert_ids.shape != (num_rows,) or expert_ids.dtype != jnp.int32:
        raise ValueError(
            f"expert_gemv: expert_ids must be i32[M={num_rows}], got "
            f"{expert_ids.dtype}{list(expert_ids.shape)}"
        )
    if w.ndim != 3 or w.shape[1] != k or w.dtype != x.dtype:
        raise ValueError(
            f"expert_gemv: w must be [E, K={k}, N] of {x.dtype}, got {w.dtype}{list(w.shape)}"
        )
    tiling = DEFAULT_TILING if tiling is None else tiling
    return _expert_gemv(x, expert_ids, w, interpret=bool(interpret), tiling=tiling)
