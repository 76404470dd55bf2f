"""The tensors a quantized layer loads as stored: expected shapes and dtypes, and the check.

Each method module describes a layer's stored tensors as a ``{suffix: TensorSpec}`` table (the
suffix follows the layer's HF prefix, e.g. ``model.layers.0.mlp.down_proj.qweight``);
:func:`check_stored_tensors` checks a checkpoint's tensors against it before anything is placed
on a device, so a bad checkpoint fails whole and names the tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One stored tensor: its shape and the dtypes it may be stored in (numpy names)."""

    shape: tuple[int, ...]
    dtypes: tuple[str, ...]
    optional: bool = False  # may be absent (e.g. GPTQ's g_idx without desc_act)


def check_stored_tensors(
    prefix: str, tensors: Mapping[str, np.ndarray], specs: Mapping[str, TensorSpec]
) -> dict[str, np.ndarray]:
    """The tensors of ``specs`` taken from ``tensors``, checked.

    Args:
        prefix: the layer's HF name, for messages (``model.layers.0.self_attn.q_proj``).
        tensors: suffix -> array (numpy, including ml_dtypes float8); extra entries are ignored.
        specs: suffix -> expected shape and dtypes.

    Returns:
        suffix -> array for every present entry of ``specs``.

    Raises:
        ValueError: a required tensor is missing, or a tensor has another shape or dtype; the
            message names ``prefix.suffix`` and both values.
    """
    out = {}
    for suffix, spec in specs.items():
        name = f"{prefix}.{suffix}"
        if suffix not in tensors:
            if spec.optional:
                continue
            raise ValueError(f"tensor {name} is missing from the checkpoint")
        array = tensors[suffix]
        if tuple(array.shape) != spec.shape:
            raise ValueError(f"tensor {name} has shape {tuple(array.shape)}; expected {spec.shape}")
        if str(array.dtype) not in spec.dtypes:
            raise ValueError(
                f"tensor {name} has dtype {array.dtype}; expected one of {', '.join(spec.dtypes)}"
            )
        out[suffix] = array
    return out
