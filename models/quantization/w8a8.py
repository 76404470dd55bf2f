"""8-bit weights times 8-bit activations (W8A8): activation quantization and scaled matmuls.

Shared by ``compressed_tensors`` (INT8 and FP8 W8A8), ``fp8`` and, for its weight quantization
at load, ``bitsandbytes``. The arithmetic follows vLLM's CUDA kernels, so that a checkpoint
serves the same numbers here as there:

- dynamic per-token INT8 (``csrc/quantization/compressed_tensors/int8_quant_kernels.cu``,
  ``dynamic_scaled_int8_quant``): ``scale = amax(|x_t|) / 127`` per token ``t``,
  ``q = round_half_even(x * (127 / amax))`` clamped to ``[-128, 127]`` (0 for an all-zero row);
  static: ``q = round_half_even(x / input_scale)``;
- dynamic per-token FP8 (``csrc/quantization/fp8/common.cu``,
  ``dynamic_per_token_scaled_fp8_quant``): ``scale = max(amax / 448, 1 / (448 * 512))``,
  ``q = e4m3(clip(x / scale, -448, 448))`` (the clip matters: e4m3fn has no infinity and a cast
  of anything past 448 gives NaN); per-tensor takes one ``amax`` over the whole ``x``;
- the matmul multiplies the 8-bit operands exactly (INT8 into an int32 accumulator; FP8 with
  ``preferred_element_type=float32``, the form XLA maps to FP8 tensor cores on Hopper) and
  applies ``x_scale[t] * w_scale[o]`` to the result.

Shapes: ``x: [..., in]`` (``T`` tokens after flattening), ``weight: [out, in]`` as stored,
``weight_scale: f32[out]`` (per channel) or ``f32[1]`` (per tensor).

Decode policy (docs/benchmarks.md, "Quantized linears"): a step of at most :data:`W8_GEMV_MAX_TOKENS` tokens on a platform in
:data:`W8_GEMV_PLATFORMS` skips the activation quantization and runs the weights through the
weight-only Pallas GEMV (``pallas_kernels.w8_gemv``, :func:`weight_only_linear`), which streams
8-bit weights faster than XLA's GEMV fusions should. This changes the numbers (activations
unquantized: closer to the float model than W8A8, not equal to vLLM's W8A8 kernels), so it is
off (0) until ``benchmarks/quant_kernels.py`` measures it faster on the H200. The kernel is written for one device: under tensor
parallelism XLA cannot split it and would gather its operands.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from models.linear_backends import auto_max_tokens
from models.platform import target_platform
from pallas_kernels.w8_gemv import w8_gemv

INT8_MAX = 127.0
FP8_E4M3_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448
FP8_MIN_SCALE = 1.0 / (FP8_E4M3_MAX * 512.0)  # vLLM's floor on a dynamic FP8 scale

# Steps of at most this many tokens take the weight-only GEMV (module docstring) when the
# target platform (``models.platform``) is in ``W8_GEMV_PLATFORMS``: the ``w8`` row of the one
# table of measured choices, ``models.linear_backends.AUTO_BACKENDS`` (0: never). Read while
# tracing (T is a compiled shape), so a change affects later compilations.
W8_GEMV_MAX_TOKENS = auto_max_tokens("w8", "pallas")
W8_GEMV_PLATFORMS = ("gpu",)  # off a GPU the kernel only runs interpreted (tests)


def use_w8_gemv(num_tokens: int) -> bool:
    """Whether a step of ``num_tokens`` tokens takes :func:`weight_only_linear`."""
    return num_tokens <= W8_GEMV_MAX_TOKENS and target_platform() in W8_GEMV_PLATFORMS


def weight_only_linear(x: jax.Array, weight: jax.Array, weight_scale: jax.Array) -> jax.Array:
    """``x @ (weight * weight_scale).T`` by the Pallas GEMV, ``x`` unquantized.

    ``x: [..., in]`` (float32, bfloat16 or float16), ``weight: i8`` or ``f8e4m3fn[out, in]``,
    ``weight_scale``: size 1 or ``out``. Returns ``[..., out]`` in ``x.dtype``; interpreted
    off a GPU. Raises ``ValueError`` as ``pallas_kernels.w8_gemv.w8_gemv``.
    """
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    scale = weight_scale.astype(jnp.float32).reshape(-1)
    y = w8_gemv(x2, weight, scale, interpret=target_platform() != "gpu")
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _amax(x: jax.Array, per_token: bool) -> jax.Array:
    ax = jnp.abs(x.astype(jnp.float32))
    if per_token:
        return jnp.max(ax, axis=-1, keepdims=True)  # [..., 1]
    return jnp.max(ax).reshape((1,) * x.ndim)


def quantize_int8(
    x: jax.Array, input_scale: jax.Array | None = None, *, per_token: bool = True
) -> tuple[jax.Array, jax.Array]:
    """``x: [..., in]`` -> ``(q: i8[..., in], scale: f32[..., 1])`` with ``x ~= q * scale``.

    ``input_scale`` (a static, calibrated per-tensor scale, ``f32[]`` or ``f32[1]``) is used as
    given; None computes dynamic scales, one per token (``per_token``) or one per call.
    """
    xf = x.astype(jnp.float32)
    if input_scale is None:
        amax = _amax(xf, per_token)
        scale = amax / INT8_MAX
        inv_scale = jnp.where(amax > 0, INT8_MAX / jnp.where(amax > 0, amax, 1.0), 0.0)
        q = jnp.round(xf * inv_scale)
    else:
        scale = jnp.reshape(input_scale.astype(jnp.float32), (1,) * x.ndim)
        q = jnp.round(xf / scale)
    return jnp.clip(q, -128, 127).astype(jnp.int8), jnp.broadcast_to(scale, (*x.shape[:-1], 1))


def quantize_fp8(
    x: jax.Array, input_scale: jax.Array | None = None, *, per_token: bool = True
) -> tuple[jax.Array, jax.Array]:
    """``x: [..., in]`` -> ``(q: f8e4m3fn[..., in], scale: f32[..., 1])``, ``x ~= q * scale``.

    As :func:`quantize_int8`, with vLLM's FP8 scale ``max(amax / 448, 1 / (448 * 512))`` and the
    saturating clip to ``[-448, 448]`` before the cast.
    """
    xf = x.astype(jnp.float32)
    if input_scale is None:
        scale = jnp.maximum(_amax(xf, per_token) / FP8_E4M3_MAX, FP8_MIN_SCALE)
    else:
        scale = jnp.reshape(input_scale.astype(jnp.float32), (1,) * x.ndim)
    q = jnp.clip(xf / scale, -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(jnp.float8_e4m3fn)
    return q, jnp.broadcast_to(scale, (*x.shape[:-1], 1))


def scaled_matmul(
    x_q: jax.Array, x_scale: jax.Array, weight: jax.Array, weight_scale: jax.Array, out_dtype
) -> jax.Array:
    """``(x_q @ weight.T) * x_scale * weight_scale`` in ``out_dtype``.

    Args:
        x_q: ``i8[..., in]`` or ``f8e4m3fn[..., in]``.
        x_scale: ``f32[..., 1]``.
        weight: ``[out, in]`` of the same 8-bit dtype as ``x_q``.
        weight_scale: ``f32[out]`` or ``f32[1]`` (any shape of that size).
        out_dtype: the result dtype.

    Returns:
        ``[..., out]``. INT8 products are summed exactly in int32 (exact while ``in * 127 * 128``
        stays below ``2 ** 31``, i.e. ``in`` up to 131,000); FP8 products are exact in float32
        and summed in float32.
    """
    if x_q.dtype != weight.dtype:
        raise ValueError(f"x_q ({x_q.dtype}) and weight ({weight.dtype}) must share a dtype")
    acc_dtype = jnp.int32 if weight.dtype == jnp.int8 else jnp.float32
    acc = jax.lax.dot_general(
        x_q, weight, (((x_q.ndim - 1,), (1,)), ((), ())), preferred_element_type=acc_dtype
    )
    w_scale = jnp.reshape(weight_scale.astype(jnp.float32), (-1,))
    if acc_dtype == jnp.float32 and w_scale.size == 1:
        # A per-tensor scale multiplied straight onto the FP8 dot: XLA's GEMM rewriter folds it
        # into cuBLASLt's FP8 GEMM as the B scale (docs/quantization.md, "FP8 on cuBLASLt").
        return (acc * w_scale[0] * x_scale).astype(out_dtype)
    return (acc.astype(jnp.float32) * x_scale * w_scale).astype(out_dtype)


def w8a8_linear(
    x: jax.Array,
    weight: jax.Array,
    weight_scale: jax.Array,
    input_scale: jax.Array | None = None,
    *,
    per_token: bool = True,
) -> jax.Array:
    """``x @ W.T`` with ``W = weight * weight_scale`` and ``x`` quantized like ``weight``.

    ``weight: i8[out, in]`` (INT8 W8A8) or ``f8e4m3fn[out, in]`` (FP8 W8A8); ``input_scale``:
    a static per-tensor activation scale, None for dynamic scales (per token with
    ``per_token``). Returns ``[..., out]`` in ``x.dtype``. A step that :func:`use_w8_gemv`
    accepts runs :func:`weight_only_linear` instead (``input_scale`` unused).
    """
    if use_w8_gemv(math.prod(x.shape[:-1])):
        return weight_only_linear(x, weight, weight_scale)
    if weight.dtype == jnp.int8:
        x_q, x_scale = quantize_int8(x, input_scale, per_token=per_token)
    elif weight.dtype == jnp.float8_e4m3fn:
        x_q, x_scale = quantize_fp8(x, input_scale, per_token=per_token)
    else:
        raise ValueError(f"W8A8 weight must be int8 or float8_e4m3fn, got {weight.dtype}")
    return scaled_matmul(x_q, x_scale, weight, weight_scale, x.dtype)
