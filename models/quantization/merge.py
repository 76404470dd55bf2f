"""Fusing quantized q/k/v (gate/up) layers into one column-parallel layer, as stored.

``models.merged_linear`` lays the fused output out shard by shard (``[q_0 | k_0 | v_0 | q_1 |
...]`` for ``num_shards = tp``) so a plain column split hands each device its own parts. A
quantized layer is fused the same way, tensor by tensor, along each tensor's output axis
(``tp_split.TP_SPLIT_AXES``' column entry), which for packed tensors (AWQ ``qweight`` /
``qzeros``, GPTQ ``qzeros``, compressed-tensors ``weight_zero_point``) counts words: each part's
per-shard slice must then be whole words (its output size per shard a multiple of
``32 // bits``; ``Hkv * D / tp`` always is for ``D`` a multiple of 8).

Tensors without an output axis:

- per-tensor scales (``weight_scale: [1]`` of FP8 / W8A8) differ per part, so they become
  per-channel ``[out]`` (each part's scale repeated over its columns; the scaled matmul takes
  either);
- a static activation scale (``input_scale``) becomes the parts' maximum, vLLM's choice (one
  quantization of the shared input; the largest scale never overflows any part);
- GPTQ / compressed-tensors ``g_idx`` describe the shared input and must be equal in all
  parts (act-order permutes by the input's Hessian, which q/k/v share).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from models.quantization.tp_split import TP_SPLIT_AXES

_SHARED_INPUT_TENSORS = ("g_idx", "weight_g_idx")


def merge_column_parts(
    method: str,
    parts: Sequence[Mapping[str, np.ndarray]],
    output_sizes: Sequence[int],
    num_shards: int,
    *,
    prefix: str = "layer",
) -> dict[str, np.ndarray]:
    """One fused layer's tensors from its parts' loaded tensors (host side, numpy).

    Args:
        method: vLLM's method name.
        parts: per part (q, k, v or gate, up), suffix -> loaded array; all with the same suffixes.
        output_sizes: each part's whole output size (before any split).
        num_shards: the ``tp`` size the columns are laid out for.
        prefix: the fused layer's name, for messages.

    Returns:
        suffix -> the fused tensor, its output axis in ``merged_column_order(output_sizes,
        num_shards)`` order (dequantizing it gives the fused weight's columns in that order).

    Raises:
        ValueError: parts with different tensors, an output axis that does not split into
            ``num_shards`` whole words, or ``g_idx`` that differ between parts; naming the tensor.
    """
    names = set(parts[0])
    if any(set(p) != names for p in parts):
        raise ValueError(
            f"{prefix}: the fused parts hold different tensors: {[sorted(p) for p in parts]}"
        )
    merged = {}
    for name in sorted(names):
        arrays = [np.asarray(p[name]) for p in parts]
        if name in _SHARED_INPUT_TENSORS:
            if any(not np.array_equal(a, arrays[0]) for a in arrays[1:]):
                raise ValueError(f"tensor {prefix}.{name} differs between the fused parts")
            merged[name] = arrays[0]
        elif name == "input_scale":
            merged[name] = np.max(np.stack(arrays), axis=0)
        else:
            axis = TP_SPLIT_AXES[method][name][0]
            if axis is None and any(a.size != 1 for a in arrays):
                raise ValueError(f"tensor {prefix}.{name} has no output axis to fuse along")
            merged[name] = _interleave(name, arrays, axis, output_sizes, num_shards, prefix)
    return merged


def _interleave(name, arrays, axis, output_sizes, num_shards, prefix):
    widened = []
    for array, size in zip(arrays, output_sizes, strict=True):
        if axis is None or (array.ndim == 1 and array.size == 1 and size != 1):
            # A per-tensor scale: repeated over the part's columns.
            array = np.broadcast_to(array.reshape(-1)[:1], (size,)).copy()
            axis_p = 0
        else:
            axis_p = axis
        if array.shape[axis_p] % num_shards:
            raise ValueError(
                f"tensor {prefix}.{name} of shape {array.shape} cannot be fused for "
                f"{num_shards} shards: axis {axis_p} ({array.shape[axis_p]}) does not divide "
                "into whole words per shard"
            )
        widened.append((array, axis_p))
    out_axis = widened[0][1]
    pieces = []
    for shard in range(num_shards):
        for array, a in widened:
            step = array.shape[a] // num_shards
            pieces.append(np.take(array, np.arange(shard * step, (shard + 1) * step), axis=a))
    return np.concatenate(pieces, axis=out_axis)
