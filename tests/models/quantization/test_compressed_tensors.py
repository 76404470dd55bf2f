"""compressed-tensors: our unpacking equals the library's own compress/decompress bit for bit.

The checkpoints are made with compressed-tensors itself (``calculate_qparams`` for scales and
zero points, ``PackedQuantizationCompressor`` / ``Int``/``FloatQuantizationCompressor.compress``
for the stored tensors, ``QuantizationConfig.model_dump`` for config.json's
``quantization_config``) and the expected weights are its ``decompress``.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from compressed_tensors.compressors.naive_quantized.base import (
    FloatQuantizationCompressor,
    IntQuantizationCompressor,
)
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs as CTArgs
from compressed_tensors.quantization import QuantizationConfig as CTConfig
from compressed_tensors.quantization import QuantizationScheme as CTScheme

from models.quantization.compressed_tensors import (
    compressed_tensors_linear,
    dequantize_wna16,
    load_compressed_tensors_layer,
    sort_wna16_act_order,
)
from models.quantization.config import CompressedTensorsConfig
from tests.models.quantization.checkpoints import compressed_tensors_qparams

IN, OUT = 128, 48


def _np(t: torch.Tensor) -> np.ndarray:
    """A torch tensor as numpy, bfloat16 and float8 through ml_dtypes (bit-preserving)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return t.numpy()


def _make(
    weights: dict,
    inputs: dict | None = None,
    fmt: str = "pack-quantized",
    dtype=torch.float16,
    seed: int = 0,
):
    """(our scheme parsed from the tool's config dict, stored tensors, tool's decompressed W)."""
    torch.manual_seed(seed)
    weight = torch.randn(OUT, IN, dtype=torch.float32).to(dtype)
    args = CTArgs(**weights)
    scheme = CTScheme(
        targets=["Linear"],
        weights=args,
        input_activations=None if inputs is None else CTArgs(**inputs),
    )
    scale, zero_point = compressed_tensors_qparams(weight, args)
    state = {"weight": weight, "weight_scale": scale.to(dtype), "weight_zero_point": zero_point}
    compressor = {
        "pack-quantized": PackedQuantizationCompressor,
        "int-quantized": IntQuantizationCompressor,
        "float-quantized": FloatQuantizationCompressor,
    }[fmt]
    stored = compressor.compress(state, scheme)
    expected = compressor.decompress(stored, scheme)["weight"]
    config = CTConfig(
        config_groups={"group_0": scheme},
        format=fmt,
        ignore=["lm_head"],
        quantization_status="compressed",
    ).model_dump()
    ours = CompressedTensorsConfig.from_config(config).scheme_for("model.layers.0.mlp.up_proj")
    return ours, {k: _np(v) for k, v in stored.items()}, _np(expected)


WNA16_CASES = [
    dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
    dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=64),
    dict(num_bits=4, type="int", symmetric=True, strategy="channel"),
    dict(num_bits=8, type="int", symmetric=True, strategy="group", group_size=32),
    dict(num_bits=8, type="int", symmetric=False, strategy="channel"),
]


@pytest.mark.parametrize(
    "weights",
    WNA16_CASES,
    ids=lambda w: f"{w['num_bits']}b-{'sym' if w['symmetric'] else 'asym'}-{w['strategy']}",
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_wna16_dequantize_equals_library_bit_for_bit(weights, dtype):
    scheme, stored, expected = _make(weights, dtype=dtype)
    assert scheme.kind == "wna16"
    params = load_compressed_tensors_layer("model.layers.0.mlp.up_proj", stored, IN, OUT, scheme)
    w = dequantize_wna16(
        jnp.asarray(params["weight_packed"]),
        jnp.asarray(params["weight_scale"]),
        None if "weight_zero_point" not in params else jnp.asarray(params["weight_zero_point"]),
        bits=weights["num_bits"],
    )
    w = np.asarray(w)
    assert w.dtype == expected.dtype and w.shape == (OUT, IN)
    np.testing.assert_array_equal(w.view(np.uint16), expected.view(np.uint16))


def test_wna16_act_order_gathers_groups_by_g_idx():
    scheme, stored, _ = _make(
        dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32)
    )
    rng = np.random.default_rng(0)
    g_idx = rng.permutation(np.arange(IN) // 32).astype(np.int32)
    params = load_compressed_tensors_layer("l", stored, IN, OUT, scheme)
    w = np.asarray(
        dequantize_wna16(
            *(
                jnp.asarray(params[k])
                for k in ("weight_packed", "weight_scale", "weight_zero_point")
            ),
            jnp.asarray(g_idx),
            bits=4,
        ),
        np.float64,
    )
    blocked = np.asarray(
        dequantize_wna16(
            *(
                jnp.asarray(params[k])
                for k in ("weight_packed", "weight_scale", "weight_zero_point")
            ),
            bits=4,
        ),
        np.float64,
    )
    # Column i of the act-order weight uses group g_idx[i]'s scale and zero point; recover the
    # integers from the blocked weight and re-scale them with the permuted groups.
    scales = params["weight_scale"].astype(np.float64)
    from models.quantization.compressed_tensors import unpack_wna16

    q, zp = (
        np.asarray(a)
        for a in unpack_wna16(
            jnp.asarray(params["weight_packed"]),
            jnp.asarray(params["weight_zero_point"]),
            bits=4,
            out_features=OUT,
        )
    )
    np.testing.assert_allclose(
        blocked, (q - np.repeat(zp, 32, 1)) * np.repeat(scales, 32, 1), rtol=2**-10
    )
    np.testing.assert_allclose(w, (q - zp[:, g_idx]) * scales[:, g_idx], rtol=2**-10)


@pytest.mark.parametrize("weights", WNA16_CASES[:2], ids=["4b-sym-g32", "4b-asym-g64"])
def test_wna16_linear_matches_float32_reference(weights):
    scheme, stored, expected = _make(weights, dtype=torch.float32)
    params = {
        k: jnp.asarray(v)
        for k, v in load_compressed_tensors_layer("l", stored, IN, OUT, scheme).items()
    }
    x = np.random.default_rng(2).standard_normal((4, IN)).astype(np.float32)
    y = compressed_tensors_linear(jnp.asarray(x), params, scheme)
    reference = x.astype(np.float64) @ expected.astype(np.float64).T
    np.testing.assert_allclose(
        np.asarray(y), reference, rtol=1e-4, atol=1e-4 * np.abs(reference).max()
    )


W8A8_CASES = {
    "int8-channel-dynamic-token": (
        dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
        dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True),
        "int-quantized",
    ),
    "int8-tensor-static": (
        dict(num_bits=8, type="int", symmetric=True, strategy="tensor"),
        dict(num_bits=8, type="int", symmetric=True, strategy="tensor", dynamic=False),
        "int-quantized",
    ),
    "fp8-channel-dynamic-token": (
        dict(num_bits=8, type="float", symmetric=True, strategy="channel"),
        dict(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True),
        "float-quantized",
    ),
    "fp8-tensor-static": (
        dict(num_bits=8, type="float", symmetric=True, strategy="tensor"),
        dict(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False),
        "float-quantized",
    ),
}


@pytest.mark.parametrize("case", sorted(W8A8_CASES))
def test_w8a8_linear_is_exact_on_quantized_inputs(case):
    """The W8A8 matmul equals float64 ``dequant(x_q) @ dequant(W).T``; the weight is the
    library's decompressed one and the activations the quantization ours produced (to within
    float32 rounding of the scale product: rtol 1e-5)."""
    weights, inputs, fmt = W8A8_CASES[case]
    scheme, stored, expected = _make(weights, inputs, fmt=fmt, dtype=torch.float32)
    assert scheme.kind == ("w8a8_int8" if weights["type"] == "int" else "w8a8_fp8")
    x = np.random.default_rng(3).standard_normal((6, IN)).astype(np.float32)
    if not scheme.input_activations.dynamic:
        stored["input_scale"] = np.array([np.abs(x).max() / 100.0], np.float32)
    params = {
        k: jnp.asarray(v)
        for k, v in load_compressed_tensors_layer("l", stored, IN, OUT, scheme).items()
    }
    # The stored weight times its scale is the library's decompressed weight, bit for bit.
    np.testing.assert_array_equal(
        np.asarray(params["weight"], np.float32)
        * np.asarray(params["weight_scale"]).reshape(-1, 1),
        expected,
    )
    y = np.asarray(compressed_tensors_linear(jnp.asarray(x), params, scheme), np.float64)

    from models.quantization.w8a8 import quantize_fp8, quantize_int8

    quantize = quantize_int8 if weights["type"] == "int" else quantize_fp8
    x_q, x_scale = quantize(
        jnp.asarray(x), params.get("input_scale"), per_token=inputs["strategy"] == "token"
    )
    x_deq = np.asarray(x_q, np.float64) * np.asarray(x_scale, np.float64)
    reference = x_deq @ expected.astype(np.float64).T
    np.testing.assert_allclose(y, reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max())


def test_load_rejects_wrong_weight_shape_and_missing_scale():
    scheme, stored, _ = _make(WNA16_CASES[1])
    bad = dict(stored, weight_shape=np.array([OUT, IN + 8]))
    with pytest.raises(ValueError, match=r"l\.weight_shape holds \(48, 136\)"):
        load_compressed_tensors_layer("l", bad, IN, OUT, scheme)
    missing = dict(stored)
    del missing["weight_zero_point"]
    with pytest.raises(ValueError, match=r"l\.weight_zero_point is missing"):
        load_compressed_tensors_layer("l", missing, IN, OUT, scheme)
    bad = dict(stored, weight_packed=stored["weight_packed"][:, :-1])
    with pytest.raises(ValueError, match=r"l\.weight_packed has shape \(48, 15\)"):
        load_compressed_tensors_layer("l", bad, IN, OUT, scheme)


def test_sorted_act_order_equals_the_g_idx_form():
    scheme, stored, _ = _make(
        dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32),
        dtype=torch.float32,
    )
    g_idx = np.random.default_rng(1).permutation(np.arange(IN) // 32).astype(np.int32)
    params = dict(load_compressed_tensors_layer("l", stored, IN, OUT, scheme), weight_g_idx=g_idx)
    sorted_ = sort_wna16_act_order(params, 4)
    assert "weight_g_idx" not in sorted_
    j, s = ({k: jnp.asarray(v) for k, v in t.items()} for t in (params, sorted_))
    keys = ("weight_packed", "weight_scale", "weight_zero_point")
    gathered = np.asarray(dequantize_wna16(*(j[k] for k in keys), j["weight_g_idx"], bits=4))
    blocked = np.asarray(dequantize_wna16(*(s[k] for k in keys), bits=4))
    np.testing.assert_array_equal(blocked, gathered[:, sorted_["perm"]])
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, IN)), jnp.float32)
    np.testing.assert_allclose(
        np.asarray(compressed_tensors_linear(x, s, scheme)),
        np.asarray(compressed_tensors_linear(x, j, scheme)),
        rtol=1e-5,
        atol=1e-5,
    )
    with pytest.raises(ValueError, match=r"l\.weight_g_idx does not give every one"):
        sort_wna16_act_order(dict(params, weight_g_idx=np.zeros(IN, np.int32)), 4, prefix="l")
