"""vLLM's ``fp8``: e4m3 weights with one scale per tensor, FP8 activations, FP8 matmul.

Two sources (vLLM ``model_executor/layers/quantization/fp8.py``, ``Fp8LinearMethod``):

- an FP8 checkpoint (``quant_method: fp8``): ``weight: f8e4m3fn[out, in]``, ``weight_scale:
  f32[]`` or ``[1]``, and ``input_scale`` with ``activation_scheme: static``;
- an unquantized checkpoint (or ``load_format="dummy"``) with ``quantization="fp8"``: each
  weight is quantized while loading (:func:`quantize_weight_fp8`, vLLM's ``scaled_fp8_quant``
  without a given scale: ``scale = amax(|W|) / 448``), so the device holds only FP8 weights.

Activations are quantized per call: with dynamic scales jaxpaged takes one per token (vLLM's
``Fp8LinearMethod`` defaults to one per tensor; per token is never less accurate and costs the
same scaled-matmul epilogue), with static scales the checkpoint's ``input_scale``.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from models.quantization.config import Fp8Config
from models.quantization.stored import TensorSpec, check_stored_tensors
from models.quantization.w8a8 import FP8_E4M3_MAX, w8a8_linear

_FLOAT_DTYPES = ("float16", "bfloat16", "float32")


@jax.jit
def _quantize_fp8(weight: jax.Array, fp8_max: jax.Array) -> tuple[jax.Array, jax.Array]:
    # fp8_max is an argument, not a constant: XLA rewrites a division by a constant into a
    # multiplication by its rounded reciprocal, one ulp off amax / 448 for about half the
    # weights. initial=0: an empty weight gets the smallest scale (max has no identity).
    w = weight.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w), initial=0.0)
    scale = jnp.maximum(amax / fp8_max, jnp.finfo(jnp.float32).tiny)
    q = jnp.clip(w / scale, -fp8_max, fp8_max).astype(jnp.float8_e4m3fn)
    return q, scale.reshape(1)


def quantize_weight_fp8(weight: np.ndarray | jax.Array) -> dict[str, np.ndarray]:
    """Online FP8 of one unquantized weight, computed on the default device (one jitted pass;
    the host numpy version took minutes for an 8B model) and returned to the host.

    Args:
        weight: ``[out, in]`` in any float dtype (HF layout), numpy or a jax array.

    Returns:
        ``{"weight": f8e4m3fn[out, in], "weight_scale": f32[1]}`` with ``weight * weight_scale
        ~= W``, ``scale = amax(|W|) / 448`` correctly rounded in float32 (vLLM's
        ``scaled_fp8_quant``; at least float32's smallest normal, also for an empty weight); every
        element's relative error is at most ``2 ** -4`` (e4m3's half ulp) above e4m3's
        smallest normal ``2 ** -6 * scale``, absolute at most ``2 ** -10 * scale`` below.
    """
    q, scale = _quantize_fp8(weight, np.float32(FP8_E4M3_MAX))
    return {"weight": np.asarray(q), "weight_scale": np.asarray(scale)}


def fp8_tensor_specs(
    in_features: int, out_features: int, config: Fp8Config
) -> dict[str, TensorSpec]:
    """The stored tensors of one layer of an FP8 checkpoint (``is_checkpoint_fp8_serialized``)."""
    specs = {
        "weight": TensorSpec((out_features, in_features), ("float8_e4m3fn",)),
        "weight_scale": TensorSpec((1,), _FLOAT_DTYPES),
    }
    if config.activation_scheme == "static":
        specs["input_scale"] = TensorSpec((1,), _FLOAT_DTYPES)
    return specs


def load_fp8_layer(
    prefix: str,
    tensors: Mapping[str, np.ndarray],
    in_features: int,
    out_features: int,
    config: Fp8Config,
) -> dict[str, np.ndarray]:
    """One layer's FP8 tensors: as stored (FP8 checkpoint) or quantized from ``weight``.

    Raises:
        ValueError: a missing tensor or a wrong shape or dtype, naming ``prefix.suffix``.
    """
    if not config.is_checkpoint_fp8_serialized:
        spec = {"weight": TensorSpec((out_features, in_features), _FLOAT_DTYPES)}
        return quantize_weight_fp8(check_stored_tensors(prefix, tensors, spec)["weight"])
    tensors = {
        k: (v.reshape(1) if k.endswith("_scale") and v.ndim == 0 else v) for k, v in tensors.items()
    }
    out = check_stored_tensors(prefix, tensors, fp8_tensor_specs(in_features, out_features, config))
    return {k: (v if k == "weight" else v.astype(np.float32)) for k, v in out.items()}


def fp8_linear(x: jax.Array, params: Mapping[str, jax.Array]) -> jax.Array:
    """``x @ W.T`` for ``x: [..., in]`` -> ``[..., out]`` in ``x.dtype`` (FP8 x FP8 matmul).

    ``params``: ``weight: f8e4m3fn[out, in]``, ``weight_scale: f32[1]``, optional
    ``input_scale: f32[1]`` (static activation scale; absent: dynamic per token).
    """
    return w8a8_linear(
        x, params["weight"], params["weight_scale"], params.get("input_scale"), per_token=True
    )
