"""GPTQ checkpoints (AutoGPTQ / gptqmodel conventions): 4- or 8-bit, optional act-order.

Stored per linear layer, for ``in`` inputs, ``out`` outputs, ``pack = 32 // bits`` and ``G``
groups (``in // group_size``; 1 when ``group_size`` is -1):

- ``qweight: i32[in / pack, out]``: ``pack`` weights per word along ``in``, slot ``j`` of word
  ``r`` holding row ``r * pack + j`` (gptqmodel ``nn_modules/qlinear/__init__.py``,
  ``BaseQuantLinear.pack_original``);
- ``qzeros: i32[G, out / pack]``: zero points packed along ``out`` the same way. The default
  ``checkpoint_format="gptq"`` (v1, what AutoGPTQ wrote and vLLM reads) stores ``zero - 1``
  (gptqmodel ``utils/model.py``, ``convert_gptq_v2_to_v1_format``); ``gptq_v2`` stores ``zero``.
  The stored field is read per slot and one added (vLLM's and exllama's ``zero + 1``), so a
  stored ``2 ** bits - 1`` reads as ``2 ** bits``, as in vLLM;
- ``scales: f16[G, out]``;
- ``g_idx: i32[in]``: the group of each input row. Without ``desc_act`` it is ``i // group_size``
  and the blocked layout is used; with ``desc_act`` (act-order) rows belong to groups in any
  order and ``g_idx`` is required.

The weight is ``W[i, o] = (q[i, o] - z[g_idx[i], o]) * s[g_idx[i], o]`` (gptqmodel
``dequantize_weight``) and the layer computes ``x @ W``.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from models.quantization.config import GPTQConfig
from models.quantization.packing import (
    dequantize_groups,
    matmul,
    pack_factor,
    permute_packed,
    unpack_int32,
)
from models.quantization.stored import TensorSpec, check_stored_tensors

_SCALE_DTYPES = ("float16", "bfloat16", "float32")


def gptq_num_groups(in_features: int, group_size: int) -> int:
    """``G``: scale rows of a layer (1 for ``group_size == -1``).

    Raises:
        ValueError: ``in_features`` is not a multiple of ``group_size``.
    """
    if group_size == -1:
        return 1
    if in_features % group_size:
        raise ValueError(
            f"gptq needs in_features ({in_features}) divisible by group_size ({group_size})"
        )
    return in_features // group_size


def gptq_tensor_specs(
    in_features: int, out_features: int, config: GPTQConfig
) -> dict[str, TensorSpec]:
    """The stored tensors of one GPTQ linear layer of ``in_features -> out_features``.

    Raises:
        ValueError: ``in_features`` or ``out_features`` not a multiple of ``32 // bits``, or
            ``in_features`` not a multiple of ``group_size``.
    """
    pack = pack_factor(config.weight_bits)
    for name, size in (("in_features", in_features), ("out_features", out_features)):
        if size % pack:
            raise ValueError(
                f"gptq {config.weight_bits}-bit needs {name} divisible by {pack}, got {size}"
            )
    groups = gptq_num_groups(in_features, config.group_size)
    return {
        "qweight": TensorSpec((in_features // pack, out_features), ("int32",)),
        "qzeros": TensorSpec((groups, out_features // pack), ("int32",)),
        "scales": TensorSpec((groups, out_features), _SCALE_DTYPES),
        "g_idx": TensorSpec((in_features,), ("int32", "int64"), optional=not config.desc_act),
    }


def load_gptq_layer(
    prefix: str,
    tensors: Mapping[str, np.ndarray],
    in_features: int,
    out_features: int,
    config: GPTQConfig,
) -> dict[str, np.ndarray]:
    """One layer's stored tensors from ``tensors`` (suffix -> array), checked.

    ``g_idx`` is kept (as int32) only with ``desc_act``; otherwise it must be the blocked
    ``i // group_size`` (if stored at all) and is dropped.

    Raises:
        ValueError: a missing tensor (``g_idx`` with ``desc_act``), a wrong shape or dtype, a
            ``g_idx`` entry outside ``[0, G)``, or a permuted ``g_idx`` without ``desc_act``,
            naming ``prefix.suffix``.
    """
    out = check_stored_tensors(
        prefix, tensors, gptq_tensor_specs(in_features, out_features, config)
    )
    if not config.desc_act:
        g_idx = out.pop("g_idx", None)
        blocked = np.arange(in_features) // (in_features // out["scales"].shape[0])
        if g_idx is not None and not np.array_equal(g_idx, blocked):
            raise ValueError(
                f"tensor {prefix}.g_idx is not the blocked i // group_size but "
                "quantization_config.desc_act is false"
            )
        return out
    g_idx = out["g_idx"]
    groups = out["scales"].shape[0]
    if g_idx.size and (g_idx.min() < 0 or g_idx.max() >= groups):
        raise ValueError(
            f"tensor {prefix}.g_idx must hold group ids in [0, {groups}), got values in "
            f"[{g_idx.min()}, {g_idx.max()}]"
        )
    out["g_idx"] = g_idx.astype(np.int32)
    return out


def gptq_sort_act_order(
    tensors: Mapping[str, np.ndarray], bits: int, *, prefix: str = "layer"
) -> dict[str, np.ndarray]:
    """An act-order layer with its rows sorted by group, for a gather-free dequantization.

    vLLM's and exllama's ``gptq_shuffle``: with ``perm = argsort(g_idx)`` (stable), row ``i`` of
    the sorted ``qweight`` is row ``perm[i]`` of the stored one, so the groups become the blocked
    ``i // group_size`` and the layer computes ``x[..., perm] @ W_sorted`` (a gather of the
    activations, not of the weight's scales). Host side, at load.

    Args:
        tensors: ``load_gptq_layer``'s result with ``g_idx``.
        bits: 4 or 8.
        prefix: the layer's name, for messages.

    Returns:
        ``qweight`` (rows sorted), ``qzeros``, ``scales`` and ``perm: i32[in]`` (no ``g_idx``).
        Only for a whole layer or a column-parallel one: a row split would cut ``perm``'s
        input axis, which the devices no longer hold in order (``tp_split`` refuses it).

    Raises:
        ValueError: a group that does not hold exactly ``in / G`` rows (then no blocked order
            exists), naming ``prefix.g_idx``.
    """
    g_idx = np.asarray(tensors["g_idx"])
    groups = tensors["scales"].shape[0]
    counts = np.bincount(g_idx, minlength=groups)
    if np.any(counts != g_idx.size // groups):
        raise ValueError(
            f"tensor {prefix}.g_idx does not give every one of its {groups} groups "
            f"{g_idx.size // groups} rows (counts {counts.min()}..{counts.max()})"
        )
    perm = np.argsort(g_idx, kind="stable")
    return {
        "qweight": permute_packed(tensors["qweight"], bits, 0, perm),
        "qzeros": tensors["qzeros"],
        "scales": tensors["scales"],
        "perm": perm.astype(np.int32),
    }


def gptq_unpack(
    qweight: jax.Array, qzeros: jax.Array, bits: int, checkpoint_format: str = "gptq"
) -> tuple[jax.Array, jax.Array]:
    """``(q: i32[in, out], z: i32[G, out])``; ``z`` with v1's offset of one undone."""
    values = unpack_int32(qweight, bits, axis=0)
    zeros = unpack_int32(qzeros, bits, axis=1)
    if checkpoint_format == "gptq":
        zeros = zeros + 1
    return values, zeros


def gptq_dequantize(
    qweight: jax.Array,
    qzeros: jax.Array,
    scales: jax.Array,
    g_idx: jax.Array | None = None,
    *,
    bits: int,
    checkpoint_format: str = "gptq",
    dtype=None,
) -> jax.Array:
    """``W: [in, out]`` in ``dtype`` (default ``scales.dtype``).

    ``g_idx: i32[in]`` (act-order) picks each row's zero and scale; None is the blocked layout
    (row ``i`` in group ``i // (in / G)``).
    """
    values, zeros = gptq_unpack(qweight, qzeros, bits, checkpoint_format)
    if g_idx is None:
        return dequantize_groups(values, zeros, scales, axis=0, dtype=dtype)
    dtype = scales.dtype if dtype is None else dtype
    rows_zeros = jnp.take(zeros, g_idx, axis=0)  # [in, out]
    rows_scales = jnp.take(scales, g_idx, axis=0)
    weight = (values - rows_zeros).astype(jnp.float32) * rows_scales.astype(jnp.float32)
    return weight.astype(dtype)  # one rounding, as in packing.dequantize_groups


def gptq_linear(
    x: jax.Array,
    qweight: jax.Array,
    qzeros: jax.Array,
    scales: jax.Array,
    g_idx: jax.Array | None = None,
    *,
    bits: int,
    checkpoint_format: str = "gptq",
    perm: jax.Array | None = None,
) -> jax.Array:
    """``x @ W`` for ``x: [..., in]`` -> ``[..., out]`` in ``x.dtype`` (float32 accumulation).

    The dequantization is elementwise on the weight (plus, with act-order, a row gather of the
    ``[G, out]`` zeros and scales), for XLA to fuse into the dot's operand. ``perm: i32[in]``
    (from :func:`gptq_sort_act_order`, instead of ``g_idx``) permutes ``x``'s features and
    keeps the weight's dequantization blocked and gather-free.
    """
    if perm is not None:
        x = jnp.take(x, perm, axis=-1)
    weight = gptq_dequantize(
        qweight,
        qzeros,
        scales,
        g_idx,
        bits=bits,
        checkpoint_format=checkpoint_format,
        dtype=x.dtype,
    )
    return matmul(x, weight, transposed=False)
