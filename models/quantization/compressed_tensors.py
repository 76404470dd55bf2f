"""compressed-tensors checkpoints (llm-compressor): W4A16/W8A16 packed, INT8 and FP8 W8A8.

Stored per linear layer (``[out, in]`` orientation, the layer computes ``x @ W.T``), by scheme
kind (:class:`models.quantization.config.QuantizationScheme`):

- ``wna16`` (format ``pack-quantized``; ``compressors/pack_quantized/base.py``):
  ``weight_packed: i32[out, in * bits / 32]`` (``pack_to_int32``: signed values offset by
  ``2 ** (bits - 1)``, element ``j`` of a word in bits ``[bits * j, bits * (j + 1))``),
  ``weight_scale: [out, G]`` (``G = 1`` for strategy ``channel``), ``weight_shape: [2]``
  (``(out, in)``), ``weight_zero_point: i32[out * bits / 32, G]`` packed along ``out`` when
  asymmetric, ``weight_g_idx: i32[in]`` with ``actorder: group``. The weight is
  ``W[o, i] = (q[o, i] - zp[o, g(i)]) * s[o, g(i)]`` (``quantization/lifecycle/forward.py``,
  ``dequantize``).
- ``w8a8_int8`` / ``w8a8_fp8`` (formats ``int-quantized`` / ``float-quantized`` /
  ``naive-quantized``): ``weight: i8`` or ``f8e4m3fn[out, in]``, ``weight_scale: [out, 1]``
  (channel) or ``[1]`` / ``[]`` (tensor), ``input_scale: [1]`` / ``[]`` for static activation
  scales. Activations are quantized per call as in :mod:`models.quantization.w8a8`.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from models.quantization.config import QuantizationScheme
from models.quantization.packing import (
    dequantize_groups,
    matmul,
    pack_factor,
    permute_packed,
    unpack_int32,
)
from models.quantization.stored import TensorSpec, check_stored_tensors
from models.quantization.w8a8 import w8a8_linear

_FLOAT_DTYPES = ("float16", "bfloat16", "float32")
_INDEX_DTYPES = ("int32", "int64")


def _num_groups(scheme: QuantizationScheme, in_features: int) -> int:
    group_size = scheme.weights.group_size
    if group_size is None:  # strategy "channel": one scale per output row
        return 1
    if in_features % group_size:
        raise ValueError(
            f"compressed-tensors needs in_features ({in_features}) divisible by "
            f"weights.group_size ({group_size})"
        )
    return in_features // group_size


def compressed_tensors_specs(
    in_features: int, out_features: int, scheme: QuantizationScheme
) -> dict[str, TensorSpec]:
    """The stored tensors of one layer of ``in_features -> out_features`` under ``scheme``.

    ``weight_scale`` and ``input_scale`` of per-tensor W8A8 are listed as ``[1]``; a stored
    0-d scale is accepted by :func:`load_compressed_tensors_layer`.

    Raises:
        ValueError: a dimension that the packing or the groups do not divide.
    """
    if scheme.kind == "wna16":
        bits = scheme.weights.num_bits
        pack = pack_factor(bits)
        if in_features % pack:
            raise ValueError(
                f"compressed-tensors {bits}-bit needs in_features divisible by {pack}, got "
                f"{in_features}"
            )
        groups = _num_groups(scheme, in_features)
        specs = {
            "weight_packed": TensorSpec((out_features, in_features // pack), ("int32",)),
            "weight_scale": TensorSpec((out_features, groups), _FLOAT_DTYPES),
            "weight_shape": TensorSpec((2,), _INDEX_DTYPES),
        }
        if not scheme.weights.symmetric:
            specs["weight_zero_point"] = TensorSpec((-(-out_features // pack), groups), ("int32",))
        if scheme.weights.actorder == "group":
            specs["weight_g_idx"] = TensorSpec((in_features,), _INDEX_DTYPES)
        return specs
    weight_dtype = "int8" if scheme.kind == "w8a8_int8" else "float8_e4m3fn"
    per_channel = scheme.weights.strategy == "channel"
    specs = {
        "weight": TensorSpec((out_features, in_features), (weight_dtype,)),
        "weight_scale": TensorSpec((out_features, 1) if per_channel else (1,), _FLOAT_DTYPES),
    }
    if not scheme.input_activations.dynamic:
        specs["input_scale"] = TensorSpec((1,), _FLOAT_DTYPES)
    return specs


def load_compressed_tensors_layer(
    prefix: str,
    tensors: Mapping[str, np.ndarray],
    in_features: int,
    out_features: int,
    scheme: QuantizationScheme,
) -> dict[str, np.ndarray]:
    """One layer's stored tensors, checked, in the form the linear takes.

    ``weight_shape`` is checked against ``(out_features, in_features)`` and dropped; W8A8 scales
    become ``f32[out]`` or ``f32[1]``; ``weight_g_idx`` becomes int32.

    Raises:
        ValueError: a missing tensor, a wrong shape, dtype or ``weight_shape``, naming
            ``prefix.suffix``.
    """
    tensors = {
        k: (v.reshape(1) if k.endswith("_scale") and v.ndim == 0 else v) for k, v in tensors.items()
    }
    out = check_stored_tensors(
        prefix, tensors, compressed_tensors_specs(in_features, out_features, scheme)
    )
    if scheme.kind == "wna16":
        shape = tuple(int(v) for v in out.pop("weight_shape"))
        if shape != (out_features, in_features):
            raise ValueError(
                f"tensor {prefix}.weight_shape holds {shape}; expected "
                f"{(out_features, in_features)}"
            )
        if "weight_g_idx" in out:
            out["weight_g_idx"] = out["weight_g_idx"].astype(np.int32)
        return out
    out["weight_scale"] = out["weight_scale"].astype(np.float32).reshape(-1)
    if "input_scale" in out:
        out["input_scale"] = out["input_scale"].astype(np.float32)
    return out


def unpack_wna16(
    weight_packed: jax.Array, weight_zero_point: jax.Array | None, *, bits: int, out_features: int
) -> tuple[jax.Array, jax.Array | None]:
    """``(q: i32[out, in], zp: i32[out, G] or None)``, both signed (offset removed)."""
    offset = 1 << (bits - 1)
    values = unpack_int32(weight_packed, bits, axis=1) - offset
    if weight_zero_point is None:
        return values, None
    zeros = unpack_int32(weight_zero_point, bits, axis=0)[:out_features] - offset
    return values, zeros


def dequantize_wna16(
    weight_packed: jax.Array,
    weight_scale: jax.Array,
    weight_zero_point: jax.Array | None = None,
    weight_g_idx: jax.Array | None = None,
    *,
    bits: int,
    dtype=None,
) -> jax.Array:
    """``W: [out, in]`` in ``dtype`` (default ``weight_scale.dtype``).

    ``weight_g_idx: i32[in]`` (act-order) picks each input column's group; None is the blocked
    layout (column ``i`` in group ``i // (in / G)``).
    """
    values, zeros = unpack_wna16(
        weight_packed, weight_zero_point, bits=bits, out_features=weight_scale.shape[0]
    )
    if weight_g_idx is None:
        return dequantize_groups(values, zeros, weight_scale, axis=1, dtype=dtype)
    dtype = weight_scale.dtype if dtype is None else dtype
    if zeros is not None:
        values = values - jnp.take(zeros, weight_g_idx, axis=1)
    weight = values.astype(jnp.float32) * jnp.take(weight_scale, weight_g_idx, axis=1).astype(
        jnp.float32
    )
    return weight.astype(dtype)  # one rounding, as in packing.dequantize_groups


def sort_wna16_act_order(
    tensors: Mapping[str, np.ndarray], bits: int, *, prefix: str = "layer"
) -> dict[str, np.ndarray]:
    """An ``actorder: group`` layer with its input columns sorted by group (gather-free).

    As :func:`models.quantization.gptq.gptq_sort_act_order`: with ``perm =
    argsort(weight_g_idx)`` (stable), column ``i`` of the sorted ``weight_packed`` is column
    ``perm[i]`` of the stored one, the groups become blocked, and the layer computes
    ``x[..., perm] @ W_sorted.T``. Returns the tensors with ``perm: i32[in]`` instead of
    ``weight_g_idx``. Whole or column-parallel layers only (``tp_split`` refuses a row split).

    Raises:
        ValueError: a group without exactly ``in / G`` columns, naming ``prefix.weight_g_idx``.
    """
    g_idx = np.asarray(tensors["weight_g_idx"])
    groups = tensors["weight_scale"].shape[1]
    counts = np.bincount(g_idx, minlength=groups)
    if np.any(counts != g_idx.size // groups):
        raise ValueError(
            f"tensor {prefix}.weight_g_idx does not give every one of its {groups} groups "
            f"{g_idx.size // groups} columns (counts {counts.min()}..{counts.max()})"
        )
    perm = np.argsort(g_idx, kind="stable")
    out = {k: v for k, v in tensors.items() if k != "weight_g_idx"}
    out["weight_packed"] = permute_packed(tensors["weight_packed"], bits, 1, perm)
    out["perm"] = perm.astype(np.int32)
    return out


def compressed_tensors_linear(
    x: jax.Array, params: Mapping[str, jax.Array], scheme: QuantizationScheme
) -> jax.Array:
    """``x @ W.T`` for ``x: [..., in]`` -> ``[..., out]`` in ``x.dtype``.

    ``params`` is :func:`load_compressed_tensors_layer`'s result (on device). ``wna16``
    dequantizes into the dot's operand; W8A8 quantizes ``x`` (per token or per tensor,
    dynamic or with the static ``input_scale``) and runs the 8-bit matmul.
    """
    if scheme.kind == "wna16":
        if "perm" in params:  # sort_wna16_act_order: permute the activations, not the scales
            x = jnp.take(x, params["perm"], axis=-1)
        weight = dequantize_wna16(
            params["weight_packed"],
            params["weight_scale"],
            params.get("weight_zero_point"),
            params.get("weight_g_idx"),
            bits=scheme.weights.num_bits,
            dtype=x.dtype,
        )
        return matmul(x, weight, transposed=True)
    acts = scheme.input_activations
    return w8a8_linear(
        x,
        params["weight"],
        params["weight_scale"],
        params.get("input_scale"),
        per_token=acts.strategy == "token",
    )
