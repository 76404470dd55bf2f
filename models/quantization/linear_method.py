"""One object per quantized linear layer: what it loads, how it splits, how it multiplies.

docs/architecture.md, "Quantized linears and LoRA inside the step": a linear layer's method is chosen once from the checkpoint's
``quantization_config`` (or the flag). :func:`get_linear_method` returns it for a layer name
(None: the layer stays unquantized, e.g. ``lm_head`` or an ``ignore``d module), and the model and
loaders then only call its four members; no method-specific code outside this package:

- ``tensor_specs(in, out)``: the stored tensors (suffix -> shape, dtypes) the loader reads;
- ``load(prefix, tensors, in, out)``: checked host arrays in the form ``apply`` takes (online
  methods quantize here, so the device only ever holds the quantized form);
- ``sort_act_order(tensors)``: an act-order layer's input rows sorted by group (whole or
  column-parallel layers; others unchanged);
- ``split_axis(name, parallel, shape)``: the ``tp`` axis of each loaded tensor (or None);
- ``repack(tensors)``: the placed tensors in the layout of the layer's linear backend
  (``models.linear_backends``; unchanged on ``xla``);
- ``apply(x, params)``: ``x [..., in] -> [..., out]`` in ``x.dtype``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import numpy as np

from models.quantization import awq, bitsandbytes, compressed_tensors, fp8, gptq, w4a16
from models.quantization.config import (
    AWQConfig,
    BitsAndBytesConfig,
    CompressedTensorsConfig,
    Fp8Config,
    GPTQConfig,
    QuantizationConfig,
    QuantizationScheme,
)
from models.quantization.gptq import gptq_sort_act_order
from models.quantization.stored import TensorSpec
from models.quantization.tp_split import tp_split_axis

_FLOAT_DTYPES = ("float16", "bfloat16", "float32")


@dataclasses.dataclass(frozen=True)
class LinearMethod:
    """The quantization of one linear layer (see the module docstring for the members)."""

    config: QuantizationConfig
    scheme: QuantizationScheme | None = None  # compressed-tensors: this layer's scheme

    @property
    def method(self) -> str:
        """vLLM's method name (``awq``, ``gptq``, ``compressed-tensors``, ...)."""
        return self.config.method

    @property
    def quantizes_at_load(self) -> bool:
        """Whether :meth:`load` takes the float ``weight`` of an unquantized checkpoint and
        quantizes it (online ``fp8``, ``bitsandbytes`` with ``load_format="bitsandbytes"``)."""
        c = self.config
        return (isinstance(c, Fp8Config) and not c.is_checkpoint_fp8_serialized) or (
            isinstance(c, BitsAndBytesConfig) and not c.is_prequantized
        )

    def tensor_specs(self, in_features: int, out_features: int) -> dict[str, TensorSpec]:
        """The checkpoint tensors of one layer (for online methods, the float ``weight``)."""
        c = self.config
        if isinstance(c, AWQConfig):
            return awq.awq_tensor_specs(in_features, out_features, c)
        if isinstance(c, GPTQConfig):
            return gptq.gptq_tensor_specs(in_features, out_features, c)
        if isinstance(c, CompressedTensorsConfig):
            return compressed_tensors.compressed_tensors_specs(
                in_features, out_features, self.scheme
            )
        if isinstance(c, Fp8Config) and c.is_checkpoint_fp8_serialized:
            return fp8.fp8_tensor_specs(in_features, out_features, c)
        if isinstance(c, BitsAndBytesConfig) and c.is_prequantized:
            return {
                "weight": TensorSpec((out_features, in_features), ("int8",)),
                "SCB": TensorSpec((out_features,), _FLOAT_DTYPES),
            }
        return {"weight": TensorSpec((out_features, in_features), _FLOAT_DTYPES)}

    def load(
        self,
        prefix: str,
        tensors: Mapping[str, np.ndarray],
        in_features: int,
        out_features: int,
    ) -> dict[str, np.ndarray]:
        """Checked host arrays for :meth:`apply`.

        Raises:
            ValueError: a missing tensor, wrong shape or dtype, naming ``prefix.suffix``.
        """
        c, args = self.config, (prefix, tensors, in_features, out_features)
        if isinstance(c, AWQConfig):
            return awq.load_awq_layer(*args, c)
        if isinstance(c, GPTQConfig):
            return gptq.load_gptq_layer(*args, c)
        if isinstance(c, CompressedTensorsConfig):
            return compressed_tensors.load_compressed_tensors_layer(*args, self.scheme)
        if isinstance(c, Fp8Config):
            return fp8.load_fp8_layer(*args, c)
        return bitsandbytes.load_bitsandbytes_layer(*args, c)

    def sort_act_order(
        self, tensors: Mapping[str, np.ndarray], *, prefix: str = "layer"
    ) -> dict[str, np.ndarray]:
        """``tensors`` (:meth:`load`'s, possibly fused) with an act-order layer's rows sorted by
        group (``gptq_sort_act_order`` / ``sort_wna16_act_order``: ``g_idx`` becomes ``perm``);
        any other layer unchanged. For whole and column-parallel layers only.

        Raises:
            ValueError: a group without exactly ``in / G`` rows, naming ``prefix.g_idx``.
        """
        if isinstance(self.config, GPTQConfig) and "g_idx" in tensors:
            return gptq_sort_act_order(tensors, self.config.weight_bits, prefix=prefix)
        if self.scheme is not None and "weight_g_idx" in tensors:
            bits = self.scheme.weights.num_bits
            return compressed_tensors.sort_wna16_act_order(tensors, bits, prefix=prefix)
        return dict(tensors)

    def split_axis(self, name: str, parallel: str, shape: tuple[int, ...]) -> int | None:
        """The axis of loaded tensor ``name`` that ``tp`` splits (``models.quantization.tp_split``)."""
        act_order = (isinstance(self.config, GPTQConfig) and self.config.desc_act) or (
            self.scheme is not None and self.scheme.weights.actorder == "group"
        )
        return tp_split_axis(self.method, name, parallel, shape, act_order=act_order)

    def repack(
        self, tensors: Mapping[str, jax.Array], in_features: int, out_features: int
    ) -> dict[str, jax.Array]:
        """The layer's placed tensors in its linear backend's layout: on ``linear_backend``
        ``pallas`` or ``auto`` (``models.linear_backends``) a 4-bit layer the W4A16 kernel
        tiles (``w4a16.kernel_fits``; AWQ, GPTQ, compressed-tensors W4A16, act-order ones
        sorted at load) is repacked on the device to the kernel's ``qweight`` / ``zeros`` /
        ``scales`` (/ ``perm``); any other layer, and every layer on ``xla``, is returned
        unchanged. Whole (unsharded) layers only."""
        c = self.config
        if getattr(c, "linear_backend", "xla") not in ("pallas", "auto"):
            return dict(tensors)
        if isinstance(c, AWQConfig) or (isinstance(c, GPTQConfig) and c.weight_bits == 4):
            scales = tensors["scales"]
        elif (self.scheme is not None and self.scheme.kind == "wna16"
              and self.scheme.weights.num_bits == 4):  # fmt: skip
            scales = tensors["weight_scale"].T
        else:
            return dict(tensors)
        if "g_idx" in tensors or "weight_g_idx" in tensors:  # act-order not sorted: keep
            return dict(tensors)
        if not w4a16.kernel_fits(in_features, out_features, scales.shape[0]):
            return dict(tensors)
        if isinstance(c, AWQConfig):
            return w4a16.awq_to_kernel(tensors["qweight"], tensors["qzeros"], tensors["scales"])
        if isinstance(c, GPTQConfig):
            return w4a16.gptq_to_kernel(
                tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors.get("perm"),
                checkpoint_format=c.checkpoint_format,
            )  # fmt: skip
        return w4a16.wna16_to_kernel(
            tensors["weight_packed"], tensors["weight_scale"], tensors.get("weight_zero_point"),
            tensors.get("perm"),
        )  # fmt: skip

    def apply(self, x: jax.Array, params: Mapping[str, jax.Array]) -> jax.Array:
        """``x: [..., in]`` -> ``[..., out]`` in ``x.dtype``; ``params`` as :meth:`load` (then
        :meth:`repack`) made them."""
        if w4a16.is_kernel_layout(params):
            return w4a16.w4a16_apply(x, params, self.config.linear_backend)
        c = self.config
        if isinstance(c, AWQConfig):
            return awq.awq_linear(x, params["qweight"], params["qzeros"], params["scales"])
        if isinstance(c, GPTQConfig):
            return gptq.gptq_linear(
                x,
                params["qweight"],
                params["qzeros"],
                params["scales"],
                params.get("g_idx"),
                bits=c.weight_bits,
                checkpoint_format=c.checkpoint_format,
                perm=params.get("perm"),
            )
        if isinstance(c, CompressedTensorsConfig):
            return compressed_tensors.compressed_tensors_linear(x, params, self.scheme)
        if isinstance(c, Fp8Config):
            return fp8.fp8_linear(x, params)
        return bitsandbytes.bitsandbytes_linear(x, params["weight"], params["SCB"])


def get_linear_method(config: QuantizationConfig | None, layer_name: str) -> LinearMethod | None:
    """The method of linear layer ``layer_name`` (HF name, e.g. ``model.layers.0.mlp.up_proj``).

    None when the model is unquantized or the checkpoint leaves this layer in float
    (``modules_to_not_convert``, GPTQ's ``lm_head: false``, compressed-tensors ``ignore`` or no
    matching target, FP8 ``ignored_layers``, ``llm_int8_skip_modules``).
    """
    if config is None:
        return None
    if isinstance(config, CompressedTensorsConfig):
        scheme = config.scheme_for(layer_name)
        return None if scheme is None else LinearMethod(config, scheme)
    if config.is_skipped(layer_name):
        return None
    return LinearMethod(config)
