"""Tensor-parallel split of quantized layers' stored tensors: the rule table and its use.

A column-parallel layer (``qkv_proj``, ``gate_up_proj``) splits its output features over the
``tp`` devices, a row-parallel one (``o_proj``, ``down_proj``) its input features
(``models.sharding``). For a quantized layer every stored tensor that has that dimension splits
along it, in the tensor's own orientation; packing and groups only change the axis length:

Axis split by a column- / row-parallel layer (``--``: replicated):

    awq                 qweight [in, out/8]               1 / 0
                        qzeros [G, out/8], scales [G, out] 1 / 0
    gptq                qweight [in/p, out]               1 / 0
                        qzeros [G, out/p], scales [G, out] 1 / 0 (*)
                        g_idx [in]                        -- / 0
                        perm [in] (sorted act-order)      -- / refused
    compressed-tensors  weight_packed [out, in/p]         0 / 1
                        weight_scale [out, G]             0 / 1 (*)
                        weight_zero_point [out/p, G]      0 / 1 (*)
                        weight_g_idx [in]                 -- / 0
                        perm [in] (sorted act-order)      -- / refused
                        weight [out, in] (W8A8)           0 / 1
                        weight_scale [out] | [1] (W8A8)   0 / --
    fp8                 weight [out, in]                  0 / 1
                        weight_scale [1] | [out] (fused)  0 / --
    bitsandbytes        weight [out, in]                  0 / 1
                        SCB [out]                         0 / --
    any                 input_scale [1]                   -- / --

A scale or zero point is replicated along an axis of length 1 (per tensor ``[1]``, per
channel ``[out, 1]`` under a row split, one group with ``group_size=-1``). ``(*)``: also
replicated under a row split when the layer uses act-order (``g_idx``): a device's input rows
then belong to any group, so every device keeps all groups' scales and zeros (vLLM does the
same for GPTQ ``desc_act`` under TP).

A split is valid only if each shard is whole words and whole groups: the split axis must
divide by ``tp``, and the unpacked dimension per shard is then a multiple of the pack factor
and of the group size. :func:`shard_layer` checks this and names the tensor when it fails.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

# method -> tensor suffix -> (axis split by a column-parallel layer, by a row-parallel layer)
TP_SPLIT_AXES: dict[str, dict[str, tuple[int | None, int | None]]] = {
    "awq": {"qweight": (1, 0), "qzeros": (1, 0), "scales": (1, 0)},
    "gptq": {
        "qweight": (1, 0),
        "qzeros": (1, 0),
        "scales": (1, 0),
        "g_idx": (None, 0),
        "perm": (None, None),  # sorted act-order: column-parallel only (row split refused)
    },
    "compressed-tensors": {
        "weight_packed": (0, 1),
        "weight_scale": (0, 1),
        "weight_zero_point": (0, 1),
        "weight_g_idx": (None, 0),
        "perm": (None, None),  # sorted act-order: column-parallel only (row split refused)
        "weight": (0, 1),
        "input_scale": (None, None),
    },
    "fp8": {"weight": (0, 1), "weight_scale": (0, None), "input_scale": (None, None)},
    "bitsandbytes": {"weight": (0, 1), "SCB": (0, None)},
}
_WEIGHTS = frozenset({"qweight", "weight_packed", "weight"})
# Per-group tensors that act-order replicates in a row-parallel layer.
_GROUP_TENSORS = frozenset({"qzeros", "scales", "weight_scale", "weight_zero_point"})
PARALLEL_STYLES = ("column", "row")


def tp_split_axis(
    method: str, name: str, parallel: str, shape: tuple[int, ...], *, act_order: bool = False
) -> int | None:
    """The axis of stored tensor ``name`` (shape ``shape``) that ``tp`` splits; None: replicated.

    Args:
        method: a :data:`TP_SPLIT_AXES` key (vLLM's method name).
        name: the tensor's suffix (``qweight``, ``weight_scale``, ...).
        parallel: ``"column"`` or ``"row"``.
        shape: the tensor's stored shape (a length-1 axis is never split).
        act_order: the layer has ``g_idx`` (GPTQ ``desc_act``, compressed-tensors
            ``actorder: group``).

    Raises:
        ValueError: an unknown method, tensor or parallel style; ``perm`` (a sorted act-order
            layer) in a row-parallel layer.
    """
    if parallel not in PARALLEL_STYLES:
        raise ValueError(f"parallel must be 'column' or 'row', got {parallel!r}")
    if method not in TP_SPLIT_AXES:
        raise ValueError(f"no tensor-parallel rules for method {method!r}")
    if name not in TP_SPLIT_AXES[method]:
        raise ValueError(f"no tensor-parallel rule for {method} tensor {name!r}")
    if name == "perm" and parallel == "row":
        raise ValueError(
            "a row-parallel layer cannot hold a sorted act-order weight (perm): its input rows "
            "are split in the original order; keep g_idx (gptq_sort_act_order is for whole or "
            "column-parallel layers)"
        )
    axis = TP_SPLIT_AXES[method][name][PARALLEL_STYLES.index(parallel)]
    # A 1-D per-output scale (W8A8's loaded [out] or [1]) has no input axis to split; a
    # length-1 axis of a scale or zero-point tensor is a broadcast one (one group, per tensor).
    if axis is None or axis >= len(shape) or (shape[axis] == 1 and name not in _WEIGHTS):
        return None
    if parallel == "row" and act_order and name in _GROUP_TENSORS:
        return None
    return axis


def shard_layer(
    method: str,
    tensors: Mapping[str, np.ndarray],
    parallel: str,
    tp: int,
    rank: int,
    *,
    prefix: str = "layer",
) -> dict[str, np.ndarray]:
    """Device ``rank``'s slice of every stored tensor of one layer (numpy, host side).

    Args:
        method: vLLM's method name.
        tensors: suffix -> stored array, as the method's ``load_*_layer`` returns them.
        parallel: ``"column"`` or ``"row"``.
        tp: ``tensor_parallel_size``; ``rank`` in ``[0, tp)``.
        prefix: the layer's name, for messages.

    Returns:
        suffix -> the shard (replicated tensors whole). Dequantizing the shards gives exactly the
        corresponding column (row) block of the whole layer's weight.

    Raises:
        ValueError: a split axis whose length does not divide by ``tp`` (a shard would cut a
            packed word or a group), naming the tensor, its shape and ``tp``.
    """
    # Under a row split g_idx keeps global group ids, which index the replicated scales/zeros.
    act_order = "g_idx" in tensors or "weight_g_idx" in tensors
    out = {}
    for name, array in tensors.items():
        axis = tp_split_axis(method, name, parallel, array.shape, act_order=act_order)
        if axis is None:
            out[name] = array
            continue
        size = array.shape[axis]
        if size % tp:
            raise ValueError(
                f"tensor {prefix}.{name} of shape {tuple(array.shape)} cannot be split "
                f"{parallel}-parallel over tensor_parallel_size={tp}: axis {axis} ({size}) does "
                "not divide by it"
            )
        step = size // tp
        out[name] = np.take(array, np.arange(rank * step, (rank + 1) * step), axis=axis)
    return out
