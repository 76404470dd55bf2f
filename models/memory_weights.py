"""Weights from memory: a JAX pytree checked against a model and planned for placement.

Two layouts are accepted (``docs/model_protocol.md``):

- **HF names**: a flat mapping ``{"model.layers.0.self_attn.q_proj.weight": array, ...}`` with
  each tensor as the safetensors checkpoint stores it (linear weights ``[out, in]``). It is read
  through the loaders' own map (``models.weights.plan_params`` / ``read_param``, and the
  family's ``models.registry.checkpoint_view``): an :class:`ArrayDictReader` stands in for the
  safetensors files, so a name, shape or fused-module rule is the loader's, not a copy.
- **Our layout**: the model's own nested parameter tree (``nnx.State`` or its pure dict, as
  ``LLM.get_weights()`` returns it): the same paths and shapes as the engine's parameters
  (kernels ``[in, out]``, fused ``qkv_proj`` / ``gate_up_proj``).

Arrays may be numpy or JAX, on the host or on any device, sharded or not; floating dtypes
(float16, bfloat16, float32, float64) are cast to the engine's dtype. Everything is checked
before anything is placed: a missing, extra or misshapen parameter, or a non-float dtype, is a
``ValueError`` naming it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.hf_names import hf_names, merged_output_sizes
from models.weights import ParamPlan, plan_params, read_param

# What check_tensor's messages call the source of the tensors.
SOURCE = "update_weights' params"


class ArrayDictReader:
    """``models.weights._TensorReader``'s interface over an in-memory ``{HF name: array}``."""

    def __init__(self, params: Mapping[str, Any]):
        self._params = params

    def __contains__(self, name: str) -> bool:
        return name in self._params

    def is_view(self, name: str) -> bool:
        return False

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(np.shape(self._params[name]))

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(self._params[name].dtype)

    def read(self, name: str):
        return self._params[name]

    def read_slice(self, name: str, index: tuple[slice, ...]):
        return self._params[name][index]


def is_hf_names(params: Any) -> bool:
    """Whether ``params`` is a flat ``{HF name: array}`` mapping (else: our nested layout).

    Raises:
        ValueError: ``params`` is not a mapping, or is empty.
    """
    if not isinstance(params, Mapping):
        raise ValueError(
            "params must be a mapping: {HF name: array} or the engine's own parameter tree "
            f"(LLM.get_weights()), got {type(params).__name__}"
        )
    if not params:
        raise ValueError("params is empty: every parameter of the model is needed")
    check_params_tree(params)
    return all(isinstance(k, str) and not isinstance(v, Mapping) for k, v in params.items())


def check_params_tree(params: Mapping) -> None:
    """Refuse, naming the path, what no layout can hold: a leaf that is not an array (a list
    raised AttributeError deep in the loaders) and a mapping whose keys are neither all
    strings nor all integers (the engine's own layout numbers its layers; a key of another
    type raised a pytree-sorting error that named nothing).

    Raises:
        ValueError: the first such path, in the mappings' order.
    """
    stack = [(params, ())]
    while stack:
        mapping, path = stack.pop()
        kinds = {str if isinstance(key, str) else int if _is_int(key) else None for key in mapping}
        if None in kinds or len(kinds) > 1:
            odd = next(k for k in mapping if not isinstance(k, str)) if str in kinds else None
            odd = odd if odd is not None else next(k for k in mapping if not _is_int(k))
            where = _dotted(path) or "the top level"
            raise ValueError(
                f"params at {where} has the key {odd!r} ({type(odd).__name__}): keys are "
                "parameter names (strings), or layer numbers (integers) in the engine's own "
                "layout (LLM.get_weights()), one kind per mapping"
            )
        for key, value in reversed(list(mapping.items())):
            if isinstance(value, Mapping):
                stack.append((value, (*path, key)))
                continue
            leaf = value.get_value() if isinstance(value, nnx.Variable) else value
            if not isinstance(leaf, (np.ndarray, np.generic, jax.Array)):
                what = "None" if leaf is None else f"a {type(leaf).__name__}"
                raise ValueError(
                    f"parameter {_dotted((*path, key))} is {what}; expected an array (numpy "
                    "or JAX), as LLM.get_weights() or safetensors give them"
                )


def _is_int(key) -> bool:
    return isinstance(key, (int, np.integer)) and not isinstance(key, bool)


def _check_float(name: str, dtype: Any) -> None:
    if not jnp.issubdtype(dtype, jnp.floating) or jnp.dtype(dtype).itemsize < 2:
        raise ValueError(
            f"parameter {name} has dtype {jnp.dtype(dtype).name}; expected a floating dtype "
            "(float16, bfloat16, float32 or float64), cast to the engine's dtype"
        )


@dataclasses.dataclass(frozen=True)
class UpdatePlan:
    """Per parameter path (``nnx.to_flat_state``'s): a function making its new value in
    ``dtype`` (on the default device or where the source array lives), or None where the caller
    passed the engine's own array back (nothing to do). Paths not listed keep their value."""

    makers: dict[tuple, Callable[[], jax.Array] | None]


def plan_hf_update(
    model: Any,
    hf_config: Any,
    params: Mapping[str, Any],
    dtype: Any,
    view: Any = None,
    assemble: Any = None,
) -> UpdatePlan:
    """Check ``params`` (HF names) against ``model``'s parameters through the loaders' map.

    ``view``: the family's ``models.registry.checkpoint_view`` (GPT-2, BLOOM), which then also
    decides which names are used; extra names are only detected without one. A tied model's
    ``lm_head.weight`` (in HF ``state_dict()`` s of tied models) is ignored.

    Raises:
        ValueError: a missing or misshapen tensor (named with its parameter path, as the
            loaders do), an extra name, or a non-float dtype.
    """
    flat_state = list(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    reader = ArrayDictReader(params)
    source = reader if view is None else view(reader)
    plans = plan_params(flat_state, merged_output_sizes(model), source, SOURCE)
    if view is None:
        used = {name for plan in plans for name in plan.names}
        if getattr(hf_config, "tie_word_embeddings", False):
            used.add("lm_head.weight")
        extra = sorted(set(params) - used)
        if extra:
            raise ValueError(
                f"params hold {len(extra)} name(s) the model has no parameter for, e.g. "
                f"{extra[0]!r}; expected the HF names of the checkpoint "
                f"(e.g. {plans[0].names[0]!r})"
            )
        for name in sorted(used & set(params)):
            _check_float(name, reader.dtype(name))
    return UpdatePlan({plan.path: _hf_maker(source, plan, dtype, assemble) for plan in plans})


def _hf_maker(reader, plan: ParamPlan, dtype, assemble) -> Callable[[], jax.Array]:
    return lambda: read_param(reader, plan, dtype, assemble)


def _key_name(key) -> str | int | None:
    if isinstance(key, jax.tree_util.DictKey):
        return key.key
    if isinstance(key, jax.tree_util.SequenceKey):
        return key.idx
    if isinstance(key, jax.tree_util.GetAttrKey):
        return None if key.name == "value" else key.name
    return str(key)


def flatten_own_layout(params: Any) -> dict[tuple, Any]:
    """``{path: array}`` of a nested parameter tree (``nnx.State`` or its pure dict); paths as
    ``nnx.to_flat_state`` gives them (``('model', 'layers', 0, 'mlp', 'down_proj', 'kernel')``)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(params)
    flat = {}
    for key_path, leaf in leaves:
        path = tuple(n for n in (_key_name(k) for k in key_path) if n is not None)
        flat[path] = leaf
    return flat


def plan_own_update(current: list[tuple[tuple, Any]], params: Any, dtype: Any) -> UpdatePlan:
    """Check ``params`` (our layout) against the engine's ``current`` ``(path, array)`` s.

    Raises:
        ValueError: a missing or extra path, another shape, or a non-float dtype (named).
    """
    given = flatten_own_layout(params)
    paths = [path for path, _ in current]
    missing = [p for p in paths if p not in given]
    if missing:
        raise ValueError(f"parameter {_dotted(missing[0])} is missing from {SOURCE}")
    extra = sorted((p for p in given if p not in set(paths)), key=str)
    if extra:
        raise ValueError(
            f"params hold {len(extra)} path(s) the model has no parameter for, e.g. "
            f"{_dotted(extra[0])}; expected the engine's own layout (LLM.get_weights())"
        )
    makers = {}
    for path, old in current:
        new = given[path]
        if tuple(np.shape(new)) != tuple(old.shape):
            raise ValueError(
                f"parameter {_dotted(path)} has shape {tuple(np.shape(new))} in {SOURCE}; "
                f"expected {tuple(old.shape)}"
            )
        _check_float(_dotted(path), new.dtype)
        makers[path] = None if new is old else _own_maker(new, dtype)
    return UpdatePlan(makers)


def _own_maker(value, dtype) -> Callable[[], jax.Array]:
    def make():
        if isinstance(value, jax.Array):
            # Same dtype: the array itself (no copy); else cast where it lives.
            return value if value.dtype == dtype else value.astype(dtype)
        return jnp.asarray(np.asarray(value), dtype=dtype)

    return make


def _dotted(path: tuple) -> str:
    return ".".join(str(p) for p in path)


__all__ = [
    "ArrayDictReader",
    "UpdatePlan",
    "flatten_own_layout",
    "hf_names",
    "is_hf_names",
    "plan_hf_update",
    "plan_own_update",
]
