"""Stored 4-bit AWQ GEMM / GPTQ layers repacked for the W4A16 Pallas kernel (host side, at load).

The kernel's layout (``pallas_kernels.w4a16_matmul``): ``qweight i32[in / 8, out]`` whose slot
``j`` (bits ``[4 j, 4 j + 4)``) of word ``[r, o]`` holds ``q[j * in / 8 + r, o]``, unpacked zero
points ``i8[G, out]`` and the stored ``scales [G, out]``. The stored values are read with the
formats' own unpacks (``awq_unpack``, ``gptq_unpack``) and written with ``pack_int32``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from models.quantization.awq import awq_unpack
from models.quantization.gptq import gptq_unpack
from models.quantization.packing import pack_int32

_PACK = 8  # 4-bit values per int32 word


def to_w4a16_layout(values, zeros, scales) -> dict[str, np.ndarray]:
    """Unpacked ``q: i32[in, out]`` (``0 .. 15``), ``z: [G, out]`` and ``s: [G, out]`` -> the
    kernel's ``{"qweight": i32[in / 8, out], "zeros": i8[G, out], "scales": [G, out]}`` (numpy).

    Raises:
        ValueError: ``in`` is not a multiple of 8.
    """
    values = np.asarray(values)
    in_features, out_features = values.shape
    if in_features % _PACK:
        raise ValueError(f"in_features must be a multiple of {_PACK}, got {in_features}")
    planes = values.reshape(_PACK, in_features // _PACK, out_features)  # [j, r, o]
    runs = planes.transpose(1, 0, 2).reshape(in_features, out_features)  # row 8 r + j
    return {
        "qweight": pack_int32(runs, 4, axis=0),  # word r, slot j <- q[j * in / 8 + r]
        "zeros": np.asarray(zeros).astype(np.int8),
        "scales": np.asarray(scales),
    }


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
