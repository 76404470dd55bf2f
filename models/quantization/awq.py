"""AWQ (AutoAWQ GEMM checkpoints): 4-bit weights with zero points and per-group scales.

Stored per linear layer (AutoAWQ ``awq/modules/linear/gemm.py``, ``WQLinear_GEMM``), for
``in`` inputs, ``out`` outputs and ``G = in // group_size`` groups:

- ``qweight: i32[in, out / 8]``: eight 4-bit weights per word along ``out``, slot ``i`` of a word
  holding column ``AWQ_PACK_ORDER[i]`` of its eight (``from_linear``'s ``order_map``);
- ``qzeros: i32[G, out / 8]``: zero points packed the same way;
- ``scales: f16[G, out]``.

The weight is ``W[i, o] = (q[i, o] - z[i // group_size, o]) * s[i // group_size, o]`` (AutoAWQ
``awq/utils/packing_utils.py``, ``dequantize_gemm``) and the layer computes ``x @ W`` (the
stored ``[in, out]`` orientation is the matmul's).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np

from models.quantization.config import AWQConfig
from models.quantization.packing import dequantize_groups, matmul, unpack_int32
from models.quantization.stored import TensorSpec, check_stored_tensors

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""Slot ``i`` of a packed word holds column ``AWQ_PACK_ORDER[i]`` of its group of eight."""
_SLOT_OF_COLUMN = tuple(int(s) for s in np.argsort(AWQ_PACK_ORDER))  # (0, 4, 1, 5, 2, 6, 3, 7)
_SCALE_DTYPES = ("float16", "bfloat16", "float32")


def awq_tensor_specs(
    in_features: int, out_features: int, config: AWQConfig
) -> dict[str, TensorSpec]:
    """The stored tensors of one AWQ linear layer of ``in_features -> out_features``.

    Raises:
        ValueError: ``out_features`` is not a multiple of 8 or ``in_features`` not a multiple of
            ``group_size``.
    """
    group_size = in_features if config.group_size == -1 else config.group_size
    if out_features % 8:
        raise ValueError(f"awq needs out_features divisible by 8 (packed), got {out_features}")
    if in_features % group_size:
        raise ValueError(
            f"awq needs in_features ({in_features}) divisible by group_size ({group_size})"
        )
    groups = in_features // group_size
    return {
        "qweight": TensorSpec((in_features, out_features // 8), ("int32",)),
        "qzeros": TensorSpec((groups, out_features // 8), ("int32",)),
        "scales": TensorSpec((groups, out_features), _SCALE_DTYPES),
    }


def load_awq_layer(
    prefix: str,
    tensors: Mapping[str, np.ndarray],
    in_features: int,
    out_features: int,
    config: AWQConfig,
) -> dict[str, np.ndarray]:
    """One layer's ``qweight``/``qzeros``/``scales`` from ``tensors`` (suffix -> array), checked.

    Raises:
        ValueError: a missing tensor or a wrong shape or dtype, naming ``prefix.suffix``.
    """
    return check_stored_tensors(
        prefix, tensors, awq_tensor_specs(in_features, out_features, config)
    )


def awq_unpack(qweight: jax.Array, qzeros: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(q: i32[in, out], z: i32[G, out])``, both in ``[0, 16)``, columns in natural order."""
    return (
        unpack_int32(qweight, 4, axis=1, slot_of_element=_SLOT_OF_COLUMN),
        unpack_int32(qzeros, 4, axis=1, slot_of_element=_SLOT_OF_COLUMN),
    )


def awq_dequantize(
    qweight: jax.Array, qzeros: jax.Array, scales: jax.Array, dtype=None
) -> jax.Array:
    """``W: [in, out]`` in ``dtype`` (default ``scales.dtype``), ``(q - z) * s`` per group."""
    values, zeros = awq_unpack(qweight, qzeros)
    return dequantize_groups(values, zeros, scales, axis=0, dtype=dtype)


def awq_linear(x: jax.Array, qweight: jax.Array, qzeros: jax.Array, scales: jax.Array) -> jax.Array:
    """``x @ W`` for ``x: [..., in]`` -> ``[..., out]`` in ``x.dtype`` (float32 accumulation).

    The unpack (shift, mask), the zero subtraction and the scale are elementwise on the
    weight, written so XLA fuses them into the dot's operand rather than writing ``W`` out.
    """
    return matmul(x, awq_dequantize(qweight, qzeros, scales, dtype=x.dtype), transposed=False)
