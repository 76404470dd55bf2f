"""Stored 4-bit AWQ GEMM / GPTQ / compressed-tensors W4A16 layers in the W4A16 Pallas kernel's
layout, and the linear that runs the kernel (``linear_backend="pallas"``, ``models.linear_backends``).

The kernel's layout (``pallas_kernels.w4a16_matmul``): ``qweight i32[in / 8, out]`` whose slot
``j`` (bits ``[4 j, 4 j + 4)``) of word ``[r, o]`` holds ``q[j * in / 8 + r, o]``, unpacked zero
points ``i8[G, out]`` and the stored ``scales [G, out]``. The stored values are read with the
formats' own unpacks (``awq_unpack``, ``gptq_unpack``, ``unpack_wna16``) and packed by
:func:`kernel_layout`. ``LinearMethod.repack`` runs the ``*_to_kernel`` functions on the device
once at load (jitted: a few ms per layer on a GPU); ``repack_awq`` / ``repack_gptq`` return
numpy for tests and the micro-benchmark.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from models.quantization.awq import awq_unpack
from models.quantization.compressed_tensors import unpack_wna16
from models.quantization.gptq import gptq_unpack
from pallas_kernels.w4a16_matmul import MIN_TILE, w4a16_matmul

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
    """Whether ``w4a16_matmul``'s default tiles take a layer: ``out`` a multiple of 16, ``in`` of
    8, and ``in / 8`` and the group size sharing a power-of-two factor of at least 16."""
    if in_features % _PACK or out_features % MIN_TILE or in_features % groups:
        return False
    common = math.gcd(in_features // _PACK, in_features // groups)
    return (common & -common) >= MIN_TILE


def is_kernel_layout(params: Mapping[str, jax.Array]) -> bool:
    """Whether a layer's tensors are in the kernel's layout (``zeros``, not ``qzeros``)."""
    return "zeros" in params and "qweight" in params


@jax.jit
def awq_to_kernel(qweight, qzeros, scales) -> dict[str, jax.Array]:
    """AutoAWQ GEMM tensors (``models.quantization.awq``) -> the kernel layout, on the device."""
    values, zeros = awq_unpack(qweight, qzeros)
    return kernel_layout(values, zeros, scales)


@functools.partial(jax.jit, static_argnames="checkpoint_format")
def gptq_to_kernel(qweight, qzeros, scales, *, checkpoint_format: str) -> dict[str, jax.Array]:
    """4-bit GPTQ tensors without act-order -> the kernel layout, on the device."""
    values, zeros = gptq_unpack(qweight, qzeros, 4, checkpoint_format)
    return kernel_layout(values, zeros, scales)


@jax.jit
def wna16_to_kernel(weight_packed, weight_scale, weight_zero_point=None) -> dict[str, jax.Array]:
    """compressed-tensors 4-bit pack-quantized tensors (``[out, in]``, signed values offset by
    8, no act-order) -> the kernel layout, on the device: ``q + 8`` and ``zp + 8`` (8 when
    symmetric), transposed to ``[in, out]`` / ``[G, out]``."""
    values, zeros = unpack_wna16(
        weight_packed, weight_zero_point, bits=4, out_features=weight_scale.shape[0]
    )
    zeros = jnp.zeros(weight_scale.shape, jnp.int32) if zeros is None else zeros
    return kernel_layout(values.T + 8, zeros.T + 8, weight_scale.T)


def w4a16_linear(x: jax.Array, params: Mapping[str, jax.Array]) -> jax.Array:
    """``x @ W`` for ``x: [..., in]`` -> ``[..., out]`` in ``x.dtype`` through ``w4a16_matmul``
    (``params`` in the kernel layout; interpret mode when the default backend is not a GPU)."""
    qweight, scales = params["qweight"], params["scales"]
    in_features = qweight.shape[0] * _PACK
    y = w4a16_matmul(
        x.reshape(-1, in_features), qweight, scales, params["zeros"],
        group_size=in_features // scales.shape[0], interpret=jax.default_backend() != "gpu",
    )  # fmt: skip
    return y.reshape(*x.shape[:-1], y.shape[-1])


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
    qweight, qzeros, scales, *, bits: int = 4, checkpoint_format: str = "gptq", g_idx=None
) -> dict[str, np.ndarray]:
    """GPTQ tensors (symmetric or not, without act-order) -> the W4A16 kernel layout.

    Args:
        qweight: ``i32[in / 8, out]`` (``models.quantization.gptq``).
        qzeros: ``i32[G, out / 8]``; v1 (``checkpoint_format="gptq"``) stores ``zero - 1`` (a
            stored 15 reads as 16, as in vLLM), ``gptq_v2`` stores ``zero``.
        scales: ``[G, out]``, kept as is.
        bits: must be 4.
        checkpoint_format: ``"gptq"`` or ``"gptq_v2"``.
        g_idx: must be None (``load_gptq_layer`` drops a blocked one; act-order is refused).

    Returns:
        As :func:`to_w4a16_layout`; the kernel then equals ``gptq_linear``.

    Raises:
        ValueError: ``bits`` is not 4, a ``g_idx`` is given, or an unknown
            ``checkpoint_format``.
    """
    if bits != 4:
        raise ValueError(f"the W4A16 kernel takes bits=4 only, got bits={bits}")
    if g_idx is not None:
        raise ValueError("the W4A16 kernel does not take act-order (g_idx) GPTQ layers")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(
            f"checkpoint_format must be 'gptq' or 'gptq_v2', got {checkpoint_format!r}"
        )
    values, zeros = gptq_unpack(jnp.asarray(qweight), jnp.asarray(qzeros), 4, checkpoint_format)
    return to_w4a16_layout(values, zeros, scales)
