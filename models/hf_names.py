"""Hugging Face tensor names of the models' parameters: which checkpoint tensors fill each
NNX parameter path (:func:`hf_names`), the fused modules and stacked expert parameters whose
parameter is filled from several tensors (:data:`FUSED_MODULES`, :data:`EXPERT_PARAMS`), and the
shape check of one tensor (:func:`check_tensor`). Used by every loader (``models.weights``,
``models.sharded_weights``) and by ``update_weights`` (``models.memory_weights``).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx

from models.merged_linear import MergedColumnParallelLinear

# Fused modules of the models (``models.merged_linear``) -> the checkpoint modules of their
# parts, in column order: one parameter is filled from several HF tensors.
FUSED_MODULES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


# Stacked expert parameters (``models.moe.MoEExperts``, leaves of an ``experts`` module) -> the
# per-expert checkpoint modules of their parts, in column order (Mixtral: w1 gate, w3 up, w2 down).
EXPERT_PARAMS = {
    "gate_up_proj": ("w1", "w3"),
    "down_proj": ("w2",),
}


def is_expert_param(path: tuple) -> bool:
    """Whether ``path`` is a stacked expert parameter ``[E, in, out]`` (see :data:`EXPERT_PARAMS`)."""
    return len(path) >= 2 and str(path[-2]) == "experts" and str(path[-1]) in EXPERT_PARAMS


def expert_hf_names(path: tuple, num_experts: int) -> tuple[tuple[str, ...], ...]:
    """Per expert, the HF tensors (``[out, in]``, so transposed) that fill its slice of the
    stacked parameter ``path``, in column order:
    ``('model', 'layers', 0, 'block_sparse_moe', 'experts', 'gate_up_proj')``, expert ``e`` ->
    ``('model.layers.0.block_sparse_moe.experts.e.w1.weight', '....experts.e.w3.weight')``."""
    prefix = ".".join(str(p) for p in path[:-1])
    parts = EXPERT_PARAMS[str(path[-1])]
    return tuple(tuple(f"{prefix}.{e}.{part}.weight" for part in parts) for e in range(num_experts))


def hf_names(path: tuple) -> tuple[tuple[str, ...], bool]:
    """HF tensor names of an NNX parameter path, and whether the HF tensors are transposed.

    ``('model', 'layers', 0, 'self_attn', 'o_proj', 'kernel')`` ->
    ``(('model.layers.0.self_attn.o_proj.weight',), True)``: HF ``nn.Linear`` stores
    ``[out, in]``, ``nnx.Linear`` ``[in, out]``. Embeddings and norm weights map as they are.
    A fused module (:data:`FUSED_MODULES`) names one tensor per part, in column order:
    ``(..., 'self_attn', 'qkv_proj', 'bias')`` -> ``(('model.layers.0.self_attn.q_proj.bias',
    '...k_proj.bias', '...v_proj.bias'), False)``; the parameter's last (output) axis holds
    their columns as ``models.merged_linear`` lays them out. A stacked expert parameter gives its
    expert 0's names (all experts: :func:`expert_hf_names`).
    """
    *parents, module, leaf = (str(p) for p in path)
    if is_expert_param(path):
        return expert_hf_names(path, 1)[0], True
    if leaf == "kernel":
        suffix, transposed = "weight", True
    elif leaf in ("embedding", "weight"):
        suffix, transposed = "weight", False
    elif leaf == "bias":
        suffix, transposed = "bias", False
    else:
        raise ValueError(f"no HF name for parameter path {path_str(path)!r}")
    parts = FUSED_MODULES.get(module, (module,))
    return tuple(".".join([*parents, part, suffix]) for part in parts), transposed


def merged_output_sizes(model: nnx.Module) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Module path (``str`` parts, as ``nnx`` flat-state paths minus the leaf) -> the
    ``output_sizes`` of each :class:`~models.merged_linear.MergedColumnParallelLinear` in
    ``model`` (abstract or concrete); the loaders split fused parameters by them."""
    return {
        tuple(str(p) for p in path): node.output_sizes
        for path, node in nnx.iter_graph(model)
        if isinstance(node, MergedColumnParallelLinear)
    }


def check_tensor(
    reader: Any, path: tuple, name: str, expected: tuple[int, ...], model_dir: str
) -> None:
    """Check that the checkpoint holds tensor ``name`` of shape ``expected`` (HF layout, e.g.
    ``[out, in]`` for a linear weight) and of a floating dtype (where ``reader.dtype`` tells
    it) for the parameter ``path``.

    Raises:
        ValueError: the tensor is missing, has another shape or a non-float dtype; the message
            names the parameter, the HF tensor, both shapes (or the dtype) and ``model_dir``.
    """
    if name not in reader:
        raise ValueError(
            f"parameter {path_str(path)} (HF name {name!r}) is missing from {model_dir}"
        )
    shape = reader.shape(name)
    if shape != tuple(expected):
        raise ValueError(
            f"parameter {path_str(path)} (HF name {name!r}) has shape {shape} in {model_dir}; "
            f"expected {tuple(expected)}"
        )
    # A float parameter read from integers is cast without a word and changes every output
    # (a header that says I32 for a float tensor loaded silently): refused, as update_weights
    # refuses them. Readers that know no dtype (a family's view of one that does) are trusted.
    stored = reader.dtype(name) if hasattr(reader, "dtype") else None
    if stored is not None and not jnp.issubdtype(stored, jnp.floating):
        raise ValueError(
            f"parameter {path_str(path)} (HF name {name!r}) has dtype {jnp.dtype(stored).name} "
            f"in {model_dir}; expected a floating dtype (the model's parameters are floats, "
            "cast to the engine's dtype)"
        )


def path_str(path: tuple) -> str:
    """``('model', 'layers', 0, ...)`` -> ``'model.layers.0....'``."""
    return ".".join(str(p) for p in path)
