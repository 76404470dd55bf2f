"""Linear layers whose weight stays quantized on the device (``models.quantization``).

The Llama family (``models.llama``) builds one of these instead of ``nnx.Linear`` /
``MergedColumnParallelLinear`` for each projection that ``get_linear_method`` quantizes
(``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``); ``lm_head`` and the embeddings stay
float. A layer holds its :class:`~models.quantization.linear_method.LinearMethod` (a static,
hashable attribute) and one :class:`QuantizedWeight` variable per loaded tensor (``qweight``,
``scales``, ``weight``, ``SCB``, ...; int32 / int8 / float8 / float leaves as the method's
``load`` made them), named by the tensor's suffix. The tensors' shapes depend on the checkpoint
(act-order adds ``perm``, fused per-tensor scales become per-channel), so the layer is built
without them and the loaders (``models.quantized_weights``) attach them with
:meth:`QuantizedLinear.set_tensors`. An optional float bias (``nnx.Param [out]``) is a plain
parameter, filled by the float loaders like any other bias.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models.merged_linear import (
    MergedColumnParallelLinear,
    check_output_sizes,
    split_merged_columns,
)
from models.quantization.config import QuantizationConfig
from models.quantization.linear_method import LinearMethod, get_linear_method


class QuantizedWeight(nnx.Variable):
    """A stored tensor of a quantized layer: model state, not a trainable ``nnx.Param``."""


class QuantizedLinear(nnx.Module):
    """``x [..., in_features] -> [..., out_features]`` in the compute ``dtype``:
    ``method.apply(x, tensors) + bias``.

    Args:
        method: the layer's quantization.
        in_features, out_features: the layer's logical sizes (all shards).
        use_bias: add a float ``bias [out_features]`` parameter.
        dtype: compute dtype; ``param_dtype``: the bias's dtype.
        rngs: unused (the bias starts at zero; loaders fill it); kept for the common signature.
    """

    def __init__(self, method: LinearMethod, in_features: int, out_features: int, *,
                 use_bias: bool, dtype: Any, param_dtype: Any, rngs: nnx.Rngs, **unused: Any):
        del rngs, unused  # nnx.Linear's precision: the methods choose their own accumulation
        self.method = method
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.dtype = dtype
        self.tensor_names: tuple[str, ...] = ()
        self.bias = nnx.data(None)
        if use_bias:
            self.bias = nnx.Param(jnp.zeros((out_features,), dtype=param_dtype))

    def set_tensors(self, tensors: Mapping[str, jax.Array]) -> None:
        """Attach the loaded tensors (suffix -> array, as ``method.load`` and the loaders made
        them, already placed on the device(s)); replaces any earlier set."""
        for name in self.tensor_names:
            delattr(self, name)
        for name, value in tensors.items():
            setattr(self, name, QuantizedWeight(value))
        self.tensor_names = tuple(tensors)

    def tensors(self) -> dict[str, jax.Array]:
        """suffix -> the attached tensor."""
        return {name: getattr(self, name)[...] for name in self.tensor_names}

    def __call__(self, x: jax.Array) -> jax.Array:
        if not self.tensor_names:
            raise ValueError(
                f"quantized {self.method.method} layer has no tensors: load the model through "
                "models.weights / models.sharded_weights"
            )
        y = self.method.apply(x.astype(self.dtype), self.tensors())
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)
        return y


class QuantizedMergedColumnParallelLinear(QuantizedLinear):
    """:class:`~models.merged_linear.MergedColumnParallelLinear` with a quantized weight: the
    fused tensors' output axis in that class's per-shard column order
    (``models.quantization.merge.merge_column_parts``); calling it returns the parts.

    Raises:
        ValueError: an output size that does not divide by ``num_shards``.
    """

    def __init__(self, method: LinearMethod, in_features: int, output_sizes: Sequence[int], *,
                 num_shards: int, **kwargs: Any):
        check_output_sizes(output_sizes, num_shards)
        super().__init__(method, in_features, sum(output_sizes), **kwargs)
        self.output_sizes = tuple(int(size) for size in output_sizes)
        self.num_shards = int(num_shards)

    def __call__(  # type: ignore[override]
        self, x: jax.Array, delta: jax.Array | None = None
    ) -> tuple[jax.Array, ...]:
        """``delta``: as ``MergedColumnParallelLinear``'s (a LoRA update, added before the split)."""
        y = super().__call__(x)
        if delta is not None:
            y = y + delta
        return split_merged_columns(y, self.output_sizes, self.num_shards)


def projection_method(
    config: QuantizationConfig | None, prefix: str, parts: Sequence[str]
) -> LinearMethod | None:
    """The method of the projection fusing HF modules ``parts`` under ``prefix``
    (``model.layers.0.self_attn`` + ``("q_proj", "k_proj", "v_proj")``); None: float.

    Raises:
        ValueError: the parts resolve to different methods (one quantized, one ignored, or two
            schemes), naming them: a fused projection has one method.
    """
    methods = [get_linear_method(config, f"{prefix}.{part}") for part in parts]
    if any(m != methods[0] for m in methods[1:]):
        names = ", ".join(f"{prefix}.{p}" for p in parts)
        raise ValueError(
            f"the fused modules {names} must share one quantization; got "
            f"{[None if m is None else m.method for m in methods]} (scheme or ignore list differs)"
        )
    return methods[0]


def make_linear(
    config: QuantizationConfig | None, prefix: str, parts: Sequence[str], in_features: int,
    output_sizes: Sequence[int], *, num_shards: int = 1, **kwargs: Any,
) -> nnx.Module:
    """The layer of one projection: ``nnx.Linear`` / ``MergedColumnParallelLinear`` (float) or
    their quantized twins, by :func:`projection_method`. One part: a plain linear of
    ``output_sizes[0]`` outputs; several: a fused one returning the parts. ``kwargs``:
    ``nnx.Linear``'s (``use_bias``, ``dtype``, ``param_dtype``, ``precision``, ``rngs``)."""
    method = projection_method(config, prefix, parts)
    if len(parts) > 1:
        if method is None:
            return MergedColumnParallelLinear(in_features, output_sizes, num_shards=num_shards,
                                              **kwargs)
        return QuantizedMergedColumnParallelLinear(method, in_features, output_sizes,
                                                   num_shards=num_shards, **kwargs)
    (out_features,) = output_sizes
    if method is None:
        return nnx.Linear(in_features, out_features, **kwargs)
    return QuantizedLinear(method, in_features, out_features, **kwargs)
