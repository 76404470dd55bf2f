"""Weight-only 8-bit GEMV for decode: ``out = (x @ w.T) * scale`` with ``w`` in FP8 or INT8.

Why (docs/benchmarks.md, "Quantized linears"): at batch-1 decode a linear layer only streams its weights,
so 8-bit weights should take about half bf16's time; XLA's GEMV fusions read 8-bit weights at
1.3-1.8 TB/s against bf16's 2.5-2.8 TB/s, leaving FP8 at 0.87x bf16 per layer.

Formula: ``out[t, o] = scale[o] * sum_i x[t, i] * float(w[o, i])`` (``scale[0]`` for every
``o`` when per tensor), the weight layout vLLM's ``Fp8LinearMethod`` and compressed-tensors'
W8A8 store (``[out, in]``, see ``models.quantization.w8a8``). Only the weights are 8-bit: ``x``
is used as given (weight-only, not W8A8), each weight tile is converted to ``x``'s dtype in
registers (exact: every e4m3 value and every int8 is a bfloat16), products are summed in
float32, and the scale multiplies the sum at the end.

Design (same shape as ``pallas_kernels.expert_gemv``). One ``pallas_call``; the grid is (token
tiles, output tiles, K splits). A program loads its token tile of ``x`` and its
``[block_n, block_k]`` weight tile (contiguous along ``in``) per step, and adds
``x_tile @ w_tile.T`` to a float32 accumulator; with ``split_k > 1`` it covers a
``1 / split_k`` share of ``in`` and writes a float32 partial, which XLA sums and scales in one
fusion (a 4096-wide output gives only 32 tiles of 128, too few programs for 132 SMs to pull
the weights at full bandwidth). Token, K and N tails are masked (padding loads as zero, never
stored). A second token tile reads every weight again: the kernel is for ``T`` up to
``max_block_t`` (decode); larger steps belong to XLA's GEMM.

HBM bytes: ``out * in`` weight bytes per token tile, plus ``x``, the partials and the output.
Tiles: ``W8GemvTiling``; ``benchmarks/quant_kernels.py`` sweeps them beside bf16 and XLA's
W8A8 (first H100 figures: docs/benchmarks.md, "Quantized kernels").

Backend: Pallas Triton on GPU (``interpret=True`` on CPU; the e4m3 -> bfloat16 convert needs
compute capability >= 8.9). Triton's dot needs every dimension >= 16 and power-of-two tiles:
the token tile is ``T`` rounded up to a power of two, at least 16.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.online_softmax import MIN_DOT_DIM
from pallas_kernels.split_k import split_k_count

W8_DTYPES = (jnp.float8_e4m3fn, jnp.int8)
X_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class W8GemvTiling:
    """Static launch parameters of :func:`w8_gemv` (not yet measured on a GPU).

    Attributes:
        max_block_t: largest token tile (more tokens take several tiles, each reading all
            the weights again).
        block_n: output features per program.
        block_k: input features per step. Shared memory per program, estimated: ``num_stages``
            x (the 8-bit weight tile, 16 KiB at the defaults, + the ``x`` tile, 8 KiB in
            bfloat16) + the tile converted to bfloat16 (32 KiB) if Triton's layout change goes
            through shared memory: about 104 KiB, well under the H200's 227 KiB.
        split_k: K splits (float32 partials summed by XLA); None: ``pallas_kernels.split_k``'s
            choice (about two programs per SM, at most ``in / (4 * block_k)``).
        num_warps, num_stages: Triton's warps per program and software-pipelining depth.
        dot: tensor-core dots (True; the token tile is at least 16) or, for a few tokens,
            elementwise products summed after the loop (False: no padding of ``T`` to 16 rows
            and no layout change of the converted tile into a dot operand).
        bits: INT8 weights converted to float through bit patterns (``(w + 128) | 0x4B000000``
            is the float ``2^23 + w + 128``) instead of Triton's ``int8 -> float`` convert,
            which runs at a fraction of the FMA rate. FP8 weights always take Triton's convert
            (Hopper converts e4m3 pairs in hardware; a bit-pattern version needs a branch for
            subnormals).
        reduce_steps: with ``dot=False``, sum each step's products over ``k`` at once into a
            ``[block_t, block_n]`` accumulator (a warp reduction along the contiguous axis per
            step) instead of keeping ``[block_t, block_n, block_k]`` partial products to the
            end: ``block_n * block_k / (32 * num_warps)`` fewer registers, so long K-steps
            (many bytes in flight per program) fit.
    """

    max_block_t: int = 16
    block_n: int = 64
    block_k: int = 256
    split_k: int | None = None
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = True
    bits: bool = False
    reduce_steps: bool = False


DEFAULT_TILING = W8GemvTiling()


def _float_from_int8(w: jax.Array) -> jax.Array:
    """int8 values -> their exact float32 values through bit patterns, without an
    integer-to-float convert: ``float(2^23 + (w + 128)) - (2^23 + 128) = w``."""
    b = w.astype(jnp.int32) + 128  # 0 .. 255
    return lax.bitcast_convert_type(b | 0x4B000000, jnp.float32) - float(2**23 + 128)


def _load(ref, mask):
    """A load of ``ref``, masked (padding zero) where ``mask`` is given."""
    return pltriton.load(ref) if mask is None else pltriton.load(ref, mask=mask, other=0)


def _w8_gemv_kernel(
    x_ref,  # [T, K]
    w_ref,  # [N, K], 8-bit (FP8 as uint8 bytes)
    o_ref,  # f32[split_k, T, N]
    *,
    block_t: int,
    block_n: int,
    block_k: int,
    steps_per_split: int,
    weight_dtype: Any,
    dot: bool,
    bits: bool,
    reduce_steps: bool,
):
    num_tokens, k_total = x_ref.shape
    n_total = w_ref.shape[0]
    t0 = pl.program_id(0) * block_t
    n0 = pl.program_id(1) * block_n
    split = pl.program_id(2)
    toks = pl.ds(t0, block_t)
    cols = pl.ds(n0, block_n)
    t_ok = t0 + lax.broadcasted_iota(jnp.int32, (block_t, 1), 0) < num_tokens
    n_ok = n0 + lax.broadcasted_iota(jnp.int32, (block_n, 1), 0) < n_total
    k_iota = lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
    first_step = split * steps_per_split
    num_steps = jnp.minimum(steps_per_split, pl.cdiv(k_total, block_k) - first_step)
    precision = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)  # IEEE for f32, none for bf16

    # Masks only where a tail exists (static shapes): an unmasked load vectorizes freely.
    t_tail, n_tail, k_tail = num_tokens % block_t, n_total % block_n, k_total % block_k

    def masked(rows_ok, rows_tail, k_ok, shape):
        if rows_tail and k_tail:
            return rows_ok & k_ok
        if rows_tail:
            return jnp.broadcast_to(rows_ok, shape)
        return jnp.broadcast_to(k_ok, shape) if k_tail else None

    def step(i, acc):
        k0 = pl.multiple_of((first_step + i) * block_k, block_k)
        k_ok = k0 + k_iota < k_total  # [1, block_k]
        x_mask = masked(t_ok, t_tail, k_ok, (block_t, block_k))
        w_mask = masked(n_ok, n_tail, k_ok, (block_n, block_k))
        x = _load(x_ref.at[toks, pl.ds(k0, block_k)], x_mask)
        w = _load(w_ref.at[cols, pl.ds(k0, block_k)], w_mask)
        if bits and weight_dtype == jnp.int8:
            w = _float_from_int8(w)
        elif w.dtype != weight_dtype:  # FP8 travels as its bytes (see _w8_gemv)
            w = lax.bitcast_convert_type(w, weight_dtype)
        if not dot:  # [bt, bn, bk] products in float32, summed over k now or after the loop
            products = x.astype(jnp.float32)[:, None, :] * w.astype(jnp.float32)[None]
            return acc + (jnp.sum(products, axis=2) if reduce_steps else products)
        w = w.astype(x.dtype)  # exact: e4m3 and int8 values are all representable
        dims = (((1,), (1,)), ((), ()))  # x_tile @ w_tile.T
        return acc + lax.dot_general(
            x, w, dims, precision=precision, preferred_element_type=jnp.float32
        )

    acc_shape = (block_t, block_n) if dot or reduce_steps else (block_t, block_n, block_k)
    acc = lax.fori_loop(0, num_steps, step, jnp.zeros(acc_shape, jnp.float32))
    if not dot and not reduce_steps:
        acc = jnp.sum(acc, axis=2)
    n_ok_row = n0 + lax.broadcasted_iota(jnp.int32, (1, block_n), 1) < n_total
    pltriton.store(o_ref.at[split, toks, cols], acc, mask=t_ok & n_ok_row)


@functools.partial(jax.jit, static_argnames=("interpret", "tiling"))
def _w8_gemv(x, w, scale, *, interpret, tiling):
    """The launch; arguments already checked."""
    (num_tokens, k), n = x.shape, w.shape[0]
    min_t = MIN_DOT_DIM if tiling.dot else 1
    block_t = max(min_t, min(pl.next_power_of_2(num_tokens), tiling.max_block_t))
    block_n = min(tiling.block_n, max(MIN_DOT_DIM, pl.next_power_of_2(n)))
    block_k = min(tiling.block_k, max(MIN_DOT_DIM, pl.next_power_of_2(k)))
    tiling = dataclasses.replace(tiling, block_k=block_k)
    grid_tn = (pl.cdiv(num_tokens, block_t), pl.cdiv(n, block_n))
    split_k = split_k_count(tiling.split_k, tiling.block_k, k, grid_tn[0] * grid_tn[1])
    kernel = functools.partial(
        _w8_gemv_kernel,
        block_t=block_t,
        block_n=block_n,
        block_k=block_k,
        steps_per_split=pl.cdiv(pl.cdiv(k, block_k), split_k),
        weight_dtype=w.dtype,
        dot=tiling.dot,
        bits=tiling.bits,
        reduce_steps=tiling.reduce_steps,
    )
    # Pallas Triton pads a masked load with an integer zero it cannot cast to FP8, so FP8
    # weights enter the kernel as their bytes (a free bitcast) and are reinterpreted after.
    if jnp.issubdtype(w.dtype, jnp.floating):
        w = lax.bitcast_convert_type(w, jnp.uint8)

    def whole(shape):  # every program sees the whole array and masks its own tile
        return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))

    partials = pl.pallas_call(
        kernel,
        grid=(*grid_tn, split_k),
        in_specs=[whole(x.shape), whole(w.shape)],
        out_specs=whole((split_k, num_tokens, n)),
        out_shape=jax.ShapeDtypeStruct((split_k, num_tokens, n), jnp.float32),
        compiler_params=pltriton.CompilerParams(
            num_warps=tiling.num_warps, num_stages=tiling.num_stages
        ),
        interpret=interpret,
        name="w8_gemv",
    )(x, w)
    return (jnp.sum(partials, axis=0) * scale.reshape(-1)).astype(x.dtype)


def _check(x: jax.Array, w: jax.Array, scale: jax.Array) -> None:
    if x.ndim != 2 or x.dtype not in X_DTYPES:
        raise ValueError(
            f"w8_gemv: x must be [T, in] of float32, bfloat16 or float16, got "
            f"{x.dtype}{list(x.shape)}"
        )
    if w.ndim != 2 or w.shape[1] != x.shape[1] or w.dtype not in W8_DTYPES:
        raise ValueError(
            f"w8_gemv: w must be [out, in={x.shape[1]}] of float8_e4m3fn or int8, got "
            f"{w.dtype}{list(w.shape)}"
        )
    if scale.size not in (1, w.shape[0]) or scale.ndim > 2 or scale.dtype != jnp.float32:
        raise ValueError(
            f"w8_gemv: scale must be float32 of size 1 (per tensor) or out={w.shape[0]} (per "
            f"channel), got {scale.dtype}{list(scale.shape)}"
        )


def w8_gemv(
    x: jax.Array,
    w: jax.Array,
    scale: jax.Array,
    *,
    tiling: W8GemvTiling | None = None,
    interpret: bool = False,
) -> jax.Array:
    """``(x @ w.T) * scale`` with 8-bit weights converted in registers, ``[T, out]``.

    Args:
        x: ``[T, in]`` activations, float32, bfloat16 or float16 (used as given: weight-only).
        w: ``[out, in]`` weights, ``float8_e4m3fn`` or ``int8`` (vLLM's stored layout).
        scale: ``f32`` of size 1 (per tensor: ``[1]`` or ``[]``) or ``out`` (per channel:
            ``[out]`` or ``[out, 1]``); the weight is ``w * scale`` along ``out``.
        tiling: launch parameters; None reads the module's ``DEFAULT_TILING`` (at trace time).
        interpret: run the Pallas kernel in interpret mode (CPU tests).

    Returns:
        ``[T, out]`` in ``x.dtype``, accumulated in float32 (float32 inputs at full float32
        precision, no TF32), scaled in float32, then rounded once.

    Raises:
        ValueError: ``x`` not a 2-D float array, ``w`` not ``[out, in]`` of an 8-bit dtype,
            or ``scale`` not float32 of size 1 or ``out`` (each named with its shape and dtype).
    """
    _check(x, w, scale)
    tiling = DEFAULT_TILING if tiling is None else tiling
    return _w8_gemv(x, w, scale, interpret=bool(interpret), tiling=tiling)


def w8_gemv_reference(x: jax.Array, w: jax.Array, scale: jax.Array) -> jax.Array:
    """Plain-JAX :func:`w8_gemv` (same arguments and checks): the weights dequantized to
    float32, one float32 dot at full precision, scaled, cast to ``x.dtype``."""
    _check(x, w, scale)
    y = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32).T, precision=lax.Precision.HIGHEST)
    return (y * scale.reshape(-1)).astype(x.dtype)
