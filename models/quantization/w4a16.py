"""Stored 4-bit AWQ GEMM / GPTQ / compressed-tensors W4A16 layers in the W4A16 kernel's layout,
and the linears that run on it (``linear_backend`` ``pallas`` or ``auto``,
``models.linear_backends``).

The kernel's layout (``pallas_kernels.w4a16_matmul``): ``qweight i32[in / 8, out]`` whose slot
``j`` (bits ``[4 j, 4 j + 4)``) of word ``[r, o]`` holds ``q[j * in / 8 + r, o]``, unpacked zero
points ``i8[G, out]``, the stored ``scales [G, out]``, and for act-order layers ``perm: i32[in]``
(the input rows sorted by group at load, ``gptq_sort_act_order`` / ``sort_wna16_act_order``: the
layer computes ``x[..., perm] @ W_sorted``, so the groups are blocked and the kernel needs no
``g_idx``). The stored values are read with the formats' own unpacks (``awq_unpack``,
``gptq_unpack``, ``unpack_wna16``) and packed by :func:`kernel_layout`. ``LinearMethod.repack``
runs the ``*_to_kernel`` functions on the device once at load (jitted: a few ms per layer on a
GPU); ``repack_awq`` / ``repack_gptq`` return numpy for tests and the micro-benchmarks.

Per step (``T`` is a static shape while tracing), :func:`w4a16_apply` runs the kernel or, where
``models.linear_backends``' table says XLA is faster, :func:`w4a16_xla_linear` on the same
tensors.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from models.linear_backends import backend_for_tokens
from models.platform import target_platform
from models.quantization.awq import awq_unpack
from models.quantization.compressed_tensors import unpack_wna16
from models.quantization.gptq import gptq_unpack
from pallas_kernels.w4a16_matmul import MIN_TILE, default_tiling, largest_block_k, w4a16_matmul

_PACK = 8  # 4-bit values per int32 word


def kernel_layout(values, zeros, scales) -> dict[str, jax.Array]:
    """Unpacked ``q: i32[in, out]`` (``0 .. 15``), ``z: [G, out]`` and ``s: [G, out]`` -> the
    kernel's ``{"qweight": i32[in / 8, out], "zeros": i8[G, out], "scales": [G, out]}`` (jnp).

    Raises:
        ValueError: ``in`` is not a multiple of 8.
    """
    in_features, out_features = values.shape
    if in_features % _PACK:
        raise ValueError(f"in_features must be a multiple of {_PACK}, got {in_features}")
    planes = jnp.asarray(values).astype(jnp.uint32).reshape(_PACK, in_features // _PACK, -1)
    words = planes[0]
    for j in range(1, _PACK):  # word r, slot j <- q[j * in / 8 + r]
        words = words | (planes[j] << (4 * j))
    return {
        "qweight": jax.lax.bitcast_convert_type(words, jnp.int32),
        "zeros": jnp.asarray(zeros).astype(jnp.int8),
        "scales": jnp.asarray(scales),
    }


def to_w4a16_layout(values, zeros, scales) -> dict[str, np.ndarray]:
    """:func:`kernel_layout` as numpy arrays."""
    return {k: np.asarray(v) for k, v in kernel_layout(values, zeros, scales).items()}


def kernel_fits(in_features: int, out_features: int, groups: int) -> bool:
    """Whether ``w4a16_matmul`` takes a layer: ``in`` a multiple of 8 and of ``groups``, and
    ``in / 8`` and the group size sharing a power-of-two factor of at least 16 (its smallest
    ``block_k``). ``out`` may be anything (its tail is masked)."""
    del out_features
    if in_features % _PACK or in_features % groups:
        return False
    return largest_block_k(in_features, in_features // groups, 1 << 30) >= MIN_TILE


def is_kernel_layout(params: Mapping[str, jax.Array]) -> bool:
    """Whether a layer's tensors are in the kernel's layout (``zeros``, not ``qzeros``)."""
    return "zeros" in params and "qweight" in params


def _with_perm(layout: dict[str, jax.Array], perm) -> dict[str, jax.Array]:
    return layout if perm is None else {**layout, "perm": jnp.asarray(perm, jnp.int32)}


@jax.jit
def awq_to_kernel(qweight, qzeros, scales) -> dict[str, jax.Array]:
    """AutoAWQ GEMM tensors (``models.quantization.awq``) -> the kernel layout, on the device."""
    values, zeros = awq_unpack(qweight, qzeros)
    return kernel_layout(values, zeros, scales)


@functools.partial(jax.jit, static_argnames="checkpoint_format")
def gptq_to_kernel(
    qweight, qzeros, scales, perm=None, *, checkpoint_format: str
) -> dict[str, jax.Array]:
    """4-bit GPTQ tensors -> the kernel layout, on the device; an act-order layer comes sorted
    (``gptq_sort_act_order``: rows in group order, ``perm``) and keeps its ``perm``."""
    values, zeros = gptq_unpack(qweight, qzeros, 4, checkpoint_format)
    return _with_perm(kernel_layout(values, zeros, scales), perm)


@jax.jit
def wna16_to_kernel(
    weight_packed, weight_scale, weight_zero_point=None, perm=None
) -> dict[str, jax.Array]:
    """compressed-tensors 4-bit pack-quantized tensors (``[out, in]``, signed values offset by
    8; act-order layers sorted by ``sort_wna16_act_order``, with ``perm``) -> the kernel layout,
    on the device: ``q + 8`` and ``zp + 8`` (8 when symmetric), transposed to ``[in, out]`` /
    ``[G, out]``."""
    values, zeros = unpack_wna16(
        weight_packed, weight_zero_point, bits=4, out_features=weight_scale.shape[0]
    )
    zeros = jnp.zeros(weight_scale.shape, jnp.int32) if zeros is None else zeros
    return _with_perm(kernel_layout(values.T + 8, zeros.T + 8, weight_scale.T), perm)


def w4a16_linear(x: jax.Array, params: Mapping[str, jax.Array]) -> jax.Array:
    """``x @ W`` for ``x: [..., in]`` -> ``[..., out]`` in ``x.dtype`` through ``w4a16_matmul``
    (``params`` in the kernel layout; the default tiling of ``T`` with ``block_k`` cut to what
    the layer divides; interpret mode unless traced for a GPU, ``models.platform``)."""
    qweight, scales = params["qweight"], params["scales"]
    in_features = qweight.shape[0] * _PACK
    group_size = in_features // scales.shape[0]
    x2 = x.reshape(-1, in_features)
    if "perm" in params:  # act-order: rows sorted by group at load
        x2 = jnp.take(x2, params["perm"], axis=-1)
    tiling = default_tiling(x2.shape[0])
    block_k = largest_block_k(in_features, group_size, tiling.block_k)
    y = w4a16_matmul(
        x2, qweight, scales, params["zeros"], group_size=group_size,
        tiling=dataclasses.replace(tiling, block_k=block_k),
        interpret=target_platform() != "gpu",
    )  # fmt: skip
    return y.reshape(*x.shape[:-1], y.shape[-1])


def w4a16_xla_linear(x: jax.Array, params: Mapping[str, jax.Array]) -> jax.Array:
    """The same product as :func:`w4a16_linear` by XLA (for the token counts where its GEMM is
    faster than the kernel): the weight dequantized in ``x.dtype`` (``(q - z) * s`` in float32,
    rounded once, as ``dequantize_groups``) as the operand of one dot with float32
    accumulation. ``x: [..., in]`` -> ``[..., out]`` in ``x.dtype``."""
    qweight, zeros, scales = params["qweight"], params["zeros"], params["scales"]
    planes, out_features = qweight.shape
    groups = scales.shape[0]
    if "perm" in params:
        x = jnp.take(x, params["perm"], axis=-1)
    shifts = jnp.arange(0, 32, 4, dtype=jnp.int32).reshape(_PACK, 1, 1)
    q = jnp.bitwise_and(jnp.right_shift(qweight[None], shifts), 0xF)  # [8, P, out]
    q = q.reshape(groups, (_PACK * planes) // groups, out_features)  # row j * P + r, by group
    w = (q - zeros.astype(jnp.int32)[:, None, :]).astype(jnp.float32)
    w = (w * scales.astype(jnp.float32)[:, None, :]).astype(x.dtype)
    y = jnp.dot(x, w.reshape(_PACK * planes, out_features), preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def w4a16_apply(x: jax.Array, params: Mapping[str, jax.Array], backend: str) -> jax.Array:
    """A kernel-layout layer on ``backend`` (``pallas``, ``xla`` or ``auto``: the
    ``models.linear_backends`` table's choice for this step's token count on a GPU, ``xla``
    elsewhere, where the kernel only runs interpreted)."""
    tokens = math.prod(x.shape[:-1])
    if backend == "auto" and target_platform() != "gpu":
        backend = "xla"
    if backend_for_tokens("w4a16", backend, tokens) == "pallas":
        return w4a16_linear(x, params)
    return w4a16_xla_linear(x, params)


def repack_awq(qweight, qzeros, scales) -> dict[str, np.ndarray]:
    """AutoAWQ GEMM tensors -> the W4A16 kernel layout.

    Args:
        qweight: ``i32[in, out / 8]`` in AWQ's slot order (``models.quantization.awq``).
        qzeros: ``i32[G, out / 8]``, packed the same way.
        scales: ``[G, out]``, kept as is.

    Returns:
        As :func:`to_w4a16_layout`; ``w4a16_matmul(x, **result, group_size=in // G)`` equals
        ``awq_linear(x, qweight, qzeros, scales)``.

    Raises:
        ValueError: a packed tensor is not int32.
    """
    values, zeros = awq_unpack(jnp.asarray(qweight), jnp.asarray(qzeros))
    return to_w4a16_layout(values, zeros, scales)


def repack_gptq(
    qweight, qzeros, scales, *, bits: int = 4, checkpoint_format: str = "gptq", perm=None
) -> dict[str, np.ndarray]:
    """GPTQ tensors (symmetric or not; act-order ones sorted first) -> the W4A16 kernel layout.

    Args:
        qweight: ``i32[in / 8, out]`` (``models.quantization.gptq``); for an act-order layer,
            ``gptq_sort_act_order``'s rows sorted by group.
        qzeros: ``i32[G, out / 8]``; v1 (``checkpoint_format="gptq"``) stores ``zero - 1`` (a
            stored 15 reads as 16, as in vLLM), ``gptq_v2`` stores ``zero``.
        scales: ``[G, out]``, kept as is.
        bits: must be 4.
        checkpoint_format: ``"gptq"`` or ``"gptq_v2"``.
        perm: ``gptq_sort_act_order``'s ``perm: i32[in]`` of an act-order layer, kept.

    Returns:
        As :func:`to_w4a16_layout` (plus ``perm``); :func:`w4a16_linear` then equals
        ``gptq_linear``.

    Raises:
        ValueError: ``bits`` is not 4, or an unknown ``checkpoint_format``.
    """
    if bits != 4:
        raise ValueError(f"the W4A16 kernel takes bits=4 only, got bits={bits}")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(
            f"checkpoint_format must be 'gptq' or 'gptq_v2', got {checkpoint_format!r}"
        )
    values, zeros = gptq_unpack(jnp.asarray(qweight), jnp.asarray(qzeros), 4, checkpoint_format)
    out = to_w4a16_layout(values, zeros, scales)
    return out if perm is None else {**out, "perm": np.asarray(perm, np.int32)}
