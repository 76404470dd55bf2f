"""Sub-byte integers packed in int32 words: unpacking with shifts and masks.

All four packers jaxpaged reads put ``32 // bits`` values in one little-endian int32 word, value
``j`` of a word in bits ``[bits * j, bits * (j + 1))``, with no value straddling two words (bits
4 and 8 only). They differ in the packed axis and in which value sits in which slot:

- GPTQ (gptqmodel ``nn_modules/qlinear/__init__.py``, ``BaseQuantLinear.pack_original``):
  ``qweight [in / pack, out]`` packed along ``in``, ``qzeros [G, out / pack]`` along ``out``,
  slot ``j`` holds element ``j``.
- AutoAWQ (``awq/modules/linear/gemm.py``, ``WQLinear_GEMM.from_linear``): ``qweight [in,
  out / 8]`` and ``qzeros [G, out / 8]`` packed along ``out``, slot ``i`` holding element
  ``AWQ_PACK_ORDER[i] = [0, 2, 4, 6, 1, 3, 5, 7][i]`` of its eight.
- compressed-tensors (``compressors/pack_quantized/helpers.py``, ``pack_to_int32``): signed
  values offset by ``2 ** (bits - 1)``, slot ``j`` holds element ``j``; ``weight_packed [out,
  in / pack]`` along ``in``, ``weight_zero_point [out / pack, G]`` along ``out``.

The unpack is written for XLA to fuse into the consumer (a matmul's operand): a broadcast
right shift by a constant vector and a mask, no gather.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

PACKABLE_BITS = (4, 8)


def pack_factor(bits: int) -> int:
    """Values per int32 word: 8 for int4, 4 for int8.

    Raises:
        ValueError: ``bits`` is not 4 or 8.
    """
    if bits not in PACKABLE_BITS:
        raise ValueError(f"bits must be 4 or 8 to unpack int32 words, got {bits}")
    return 32 // bits


def unpack_int32(
    packed: jax.Array, bits: int, axis: int, slot_of_element: Sequence[int] | None = None
) -> jax.Array:
    """Unsigned ``bits``-bit values out of int32 words.

    Args:
        packed: ``i32[..., n, ...]``, ``n`` words along ``axis``.
        bits: 4 or 8.
        axis: the packed axis.
        slot_of_element: for each of the ``32 // bits`` elements of a word, the slot (bit
            position ``bits * slot``) it is stored in; None is ``0, 1, 2, ...``. AWQ's is the
            inverse of its pack order, ``(0, 4, 1, 5, 2, 6, 3, 7)``.

    Returns:
        ``i32[..., n * 32 // bits, ...]`` in ``[0, 2 ** bits)``; element ``w * pack + e`` of the
        axis comes from word ``w``, slot ``slot_of_element[e]``.

    Raises:
        ValueError: ``bits`` is not 4 or 8, or ``packed`` is not int32.
    """
    pack = pack_factor(bits)
    if packed.dtype != np.int32:
        raise ValueError(f"packed weights must be int32, got {packed.dtype}")
    slots = np.arange(pack) if slot_of_element is None else np.asarray(slot_of_element)
    axis = axis % packed.ndim
    shape = [1] * (packed.ndim + 1)
    shape[axis + 1] = pack
    shifts = jnp.asarray((bits * slots).astype(np.int32).reshape(shape))
    # Arithmetic shift of a negative word brings ones in from the top; the mask drops them.
    values = jnp.right_shift(jnp.expand_dims(packed, axis + 1), shifts) & ((1 << bits) - 1)
    out_shape = list(packed.shape)
    out_shape[axis] *= pack
    return values.reshape(out_shape)


def dequantize_groups(
    values: jax.Array, zeros: jax.Array | None, scales: jax.Array, *, axis: int, dtype=None
) -> jax.Array:
    """``(values - zeros) * scales`` with one zero and scale per group of ``axis``.

    Args:
        values: ``i32[in, out]`` (or ``[out, in]``) integer weights.
        zeros: ``i32`` zero points shaped like ``scales``, or None (symmetric: ``values`` are
            already centred).
        scales: ``[G, out]`` (or ``[out, G]``) with ``G`` groups along ``axis``; group ``k``
            covers elements ``[k * n / G, (k + 1) * n / G)`` of that axis.
        axis: 0 or 1, the grouped axis of a 2-D weight.
        dtype: the result dtype; None is ``scales.dtype``. The product is formed in float32
            and rounded once to ``dtype``: for float16/bfloat16 scales and 4- or 8-bit values it
            is exact in float32 (at most 9 + 11 significant bits), so the result equals the
            tools' own ``(q - z) * s`` in the scales' dtype bit for bit, and a bfloat16 compute
            dtype with float16 scales loses nothing before that one rounding.

    Returns:
        The dequantized weight, shaped like ``values``.
    """
    dtype = scales.dtype if dtype is None else dtype
    num_groups = scales.shape[axis]
    split = list(values.shape)
    split[axis : axis + 1] = [num_groups, values.shape[axis] // num_groups]
    grouped = values.reshape(split)
    if zeros is not None:
        grouped = grouped - jnp.expand_dims(zeros, axis + 1)
    weight = grouped.astype(jnp.float32) * jnp.expand_dims(scales, axis + 1).astype(jnp.float32)
    return weight.astype(dtype).reshape(values.shape)


def matmul(x: jax.Array, weight: jax.Array, *, transposed: bool, out_dtype=None) -> jax.Array:
    """``x @ weight`` (``weight [in, out]``) or ``x @ weight.T`` (``weight [out, in]``).

    ``x: [..., in]``; ``weight`` is converted to ``x.dtype`` (fused into the dot's operand);
    returns ``[..., out]`` in ``out_dtype`` (default ``x.dtype``), accumulated in float32. With
    ``transposed`` the contraction reads the stored ``[out, in]`` weight as is (no transpose).
    """
    contract = 1 if transposed else 0
    y = jax.lax.dot_general(
        x,
        weight.astype(x.dtype),
        (((x.ndim - 1,), (contract,)), ((), ())),
        preferred_element_type=jnp.float32,
    )
    return y.astype(x.dtype if out_dtype is None else out_dtype)


def pack_int32(values: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """The inverse of :func:`unpack_int32` with the natural slot order (host side, numpy).

    ``values``: unsigned ints in ``[0, 2 ** bits)``, ``axis`` a multiple of ``32 // bits`` long;
    returns ``i32`` with that axis divided by ``32 // bits``, element ``j`` of each run of
    ``32 // bits`` in bits ``[bits * j, bits * (j + 1))`` (GPTQ's and compressed-tensors' order).

    Raises:
        ValueError: ``bits`` is not 4 or 8, or the axis length is not a multiple of the pack.
    """
    pack = pack_factor(bits)
    values = np.moveaxis(np.asarray(values, dtype=np.uint32), axis, 0)
    if values.shape[0] % pack:
        raise ValueError(f"cannot pack {values.shape[0]} values into words of {pack}")
    runs = values.reshape(values.shape[0] // pack, pack, *values.shape[1:])
    shifts = (bits * np.arange(pack, dtype=np.uint32)).reshape(1, pack, *[1] * (values.ndim - 1))
    words = np.bitwise_or.reduce(runs << shifts, axis=1)
    return np.moveaxis(words.view(np.int32), 0, axis)


def permute_packed(packed: np.ndarray, bits: int, axis: int, perm: np.ndarray) -> np.ndarray:
    """Packed words whose unpacked ``axis`` is reordered: element ``i`` <- element ``perm[i]``.

    Host side (numpy), natural slot order; used to sort act-order layers by group at load.
    """
    values = np.asarray(unpack_int32(jnp.asarray(packed), bits, axis))
    return pack_int32(np.take(values, perm, axis=axis), bits, axis)
