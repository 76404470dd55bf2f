"""bitsandbytes 8-bit (LLM.int8 layout): int8 weights with one absmax per output row.

Stored per linear layer (transformers ``integrations/bitsandbytes.py``; bitsandbytes
``functional.py``, ``int8_vectorwise_quant``): ``weight: i8[out, in]`` (``CB``) and
``SCB: f32[out]``, the absmax of each row, with ``W[o, i] ~= weight[o, i] * SCB[o] / 127``.
With ``load_format="bitsandbytes"`` on an unquantized checkpoint the rows are quantized while
loading (:func:`quantize_weight_int8_rowwise`, ``weight = round(W * 127 / SCB)``).

The matmul keeps activations in the compute dtype (weight-only int8, W8A16): LLM.int8's
outlier decomposition (Dettmers et al. 2022, arXiv:2208.07339; ``llm_int8_threshold``) exists
to keep outlier activation columns out of int8, and here no activation column is quantized at
all, so the result is the dequantized weight's exactly (at least as accurate as LLM.int8).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from models.quantization.config import BitsAndBytesConfig
from models.quantization.packing import matmul
from models.quantization.stored import TensorSpec, check_stored_tensors
from models.quantization.w8a8 import use_w8_gemv, weight_only_linear

_FLOAT_DTYPES = ("float16", "bfloat16", "float32")
_INV_127 = np.float32(7.874015718698502e-3)  # bitsandbytes' 1 / 127


@jax.jit
def _quantize_int8_rowwise(weight: jax.Array) -> tuple[jax.Array, jax.Array]:
    w = weight.astype(jnp.float32)
    scb = jnp.max(jnp.abs(w), axis=1)
    factor = jnp.float32(127.0) / jnp.where(scb > 0, scb, jnp.float32(1.0))
    q = jnp.clip(jnp.round(w * factor[:, None]), -127, 127).astype(jnp.int8)
    return q, scb


def quantize_weight_int8_rowwise(weight: np.ndarray | jax.Array) -> dict[str, np.ndarray]:
    """``{"weight": i8[out, in], "SCB": f32[out]}`` from ``weight: [out, in]`` (any float,
    numpy or a jax array), computed on the default device in one jitted pass and returned to
    the host.

    ``SCB`` is each row's absmax; an all-zero row gets ``SCB = 0`` and zero weights. Each
    element is ``round(W * (127 / SCB))`` (half to even) in float32, so its error is at most
    ``SCB[o] / 254`` (half a step of ``SCB / 127``).
    """
    q, scb = _quantize_int8_rowwise(weight)
    return {"weight": np.asarray(q), "SCB": np.asarray(scb)}


def load_bitsandbytes_layer(
    prefix: str,
    tensors: Mapping[str, np.ndarray],
    in_features: int,
    out_features: int,
    config: BitsAndBytesConfig,
) -> dict[str, np.ndarray]:
    """One layer's int8 tensors: as stored (pre-quantized) or quantized from ``weight``.

    Raises:
        ValueError: a missing tensor or a wrong shape or dtype, naming ``prefix.suffix``.
    """
    if not config.is_prequantized:
        spec = {"weight": TensorSpec((out_features, in_features), _FLOAT_DTYPES)}
        return quantize_weight_int8_rowwise(check_stored_tensors(prefix, tensors, spec)["weight"])
    specs = {
        "weight": TensorSpec((out_features, in_features), ("int8",)),
        "SCB": TensorSpec((out_features,), _FLOAT_DTYPES),
    }
    out = check_stored_tensors(prefix, tensors, specs)
    return {"weight": out["weight"], "SCB": out["SCB"].astype(np.float32)}


def bitsandbytes_dequantize(weight: jax.Array, scb: jax.Array, dtype=None) -> jax.Array:
    """``W: [out, in] = weight * SCB * (1 / 127)`` in ``dtype`` (default float32).

    In float32 and in this order, as bitsandbytes' ``int8_vectorwise_dequant`` (``_ops.py``,
    default kernel), so the result equals the tool's bit for bit.
    """
    dtype = jax.numpy.float32 if dtype is None else dtype
    w = weight.astype(jax.numpy.float32) * scb.astype(jax.numpy.float32)[:, None]
    return (w * _INV_127).astype(dtype)


def bitsandbytes_linear(x: jax.Array, weight: jax.Array, scb: jax.Array) -> jax.Array:
    """``x @ W.T`` for ``x: [..., in]`` -> ``[..., out]`` in ``x.dtype``.

    The int8 -> compute-dtype convert feeds the dot's operand and the row scale ``SCB / 127``
    is applied to the ``[..., out]`` result (one multiply per output instead of per weight).
    A step that ``models.quantization.w8a8.use_w8_gemv`` accepts runs the weight-only Pallas
    GEMV with the row scale ``SCB * (1 / 127)`` (the same sum; the scale rounded once more).
    """
    if use_w8_gemv(math.prod(x.shape[:-1])):
        return weight_only_linear(x, weight, scb.astype(jax.numpy.float32) * _INV_127)
    y = matmul(x, weight, transposed=True, out_dtype=jax.numpy.float32)
    return (y * scb.astype(jax.numpy.float32) * _INV_127).astype(x.dtype)
