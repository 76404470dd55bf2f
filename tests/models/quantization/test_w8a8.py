"""W8A8: activation quantization error bounds, the exact 8-bit matmul, and the FP8/INT8 form
handed to XLA; online FP8 weights (``fp8``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from models.quantization.config import Fp8Config
from models.quantization.fp8 import fp8_linear, load_fp8_layer, quantize_weight_fp8
from models.quantization.w8a8 import (
    FP8_E4M3_MAX,
    quantize_fp8,
    quantize_int8,
    scaled_matmul,
    w8a8_linear,
)

IN, OUT = 96, 40
# e4m3: 3 mantissa bits, so round-to-nearest is within 2 ** -4 relative for normals; below the
# smallest normal (2 ** -6) the spacing is 2 ** -9, so within 2 ** -10 absolute (in scale units).
FP8_REL, FP8_ABS = 2.0**-4, 2.0**-10


def _x(seed=0, rows=7):
    x = np.random.default_rng(seed).standard_normal((rows, IN)).astype(np.float32)
    x[2] *= 50.0  # rows of very different ranges: per-token scales matter
    x[4] = 0.0  # an all-zero token
    return x


def test_int8_per_token_quantization_is_within_half_a_step():
    x = _x()
    q, scale = quantize_int8(jnp.asarray(x))
    q, scale = np.asarray(q), np.asarray(scale)
    assert q.dtype == np.int8 and scale.shape == (7, 1)
    np.testing.assert_allclose(scale[:, 0], np.abs(x).max(1) / 127, rtol=3e-7)  # float32 ulps
    nonzero = np.abs(x).max(1) > 0
    assert np.all(np.abs(q[nonzero]).max(1) == 127) and not q[4].any()
    assert np.all(np.abs(q * scale - x) <= scale / 2 * (1 + 1e-6))


def test_int8_static_scale_saturates():
    q, _ = quantize_int8(jnp.asarray(_x()), jnp.asarray([0.01], jnp.float32))
    assert np.asarray(q).min() == -128 and np.asarray(q).max() == 127


def test_fp8_per_token_quantization_error_bound_and_saturation():
    x = _x()
    q, scale = quantize_fp8(jnp.asarray(x))
    q64, s64 = np.asarray(q).astype(np.float64), np.asarray(scale, np.float64)
    assert q.dtype == jnp.float8_e4m3fn
    assert np.all(np.abs(q64 * s64 - x) <= FP8_REL * np.abs(x) + FP8_ABS * s64 + 1e-12)
    assert np.all(np.isfinite(q64))
    # A static scale far too small: everything saturates to +-448, nothing becomes NaN.
    q, _ = quantize_fp8(jnp.asarray(x), jnp.asarray([1e-6], jnp.float32))
    assert np.nanmax(np.abs(np.asarray(q, np.float32))) == FP8_E4M3_MAX
    assert not np.isnan(np.asarray(q, np.float32)).any()


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("per_token", [True, False])
def test_scaled_matmul_is_exact_on_the_quantized_operands(kind, per_token):
    rng = np.random.default_rng(1)
    x = _x(1)
    if kind == "int8":
        weight = rng.integers(-127, 128, (OUT, IN)).astype(np.int8)
        quantize = quantize_int8
    else:
        weight = rng.standard_normal((OUT, IN)).astype(ml_dtypes.float8_e4m3fn)
        quantize = quantize_fp8
    w_scale = rng.uniform(0.001, 0.01, OUT).astype(np.float32)
    y = w8a8_linear(jnp.asarray(x), jnp.asarray(weight), jnp.asarray(w_scale), per_token=per_token)
    q, s = quantize(jnp.asarray(x), per_token=per_token)
    reference = (np.asarray(q, np.float64) * np.asarray(s, np.float64)) @ (
        weight.astype(np.float64) * w_scale[:, None]
    ).T
    assert y.shape == (7, OUT) and y.dtype == jnp.float32
    # Exact 8-bit products; only float32 rounding of the sums and of the scale product remain.
    np.testing.assert_allclose(
        np.asarray(y), reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max()
    )
    assert not np.asarray(y)[4].any()  # the zero token


def test_int8_linear_error_against_float32_is_bounded_by_the_activation_step():
    """Against the unquantized float32 input the only error is the activations' rounding:
    ``|dy_o| <= sum_i |dx_i| |W_oi| <= scale_t / 2 * sum_i |W_oi|``."""
    rng = np.random.default_rng(2)
    x = _x(2)
    weight = rng.integers(-127, 128, (OUT, IN)).astype(np.int8)
    w_scale = np.full(OUT, 0.01, np.float32)
    y = np.asarray(w8a8_linear(jnp.asarray(x), jnp.asarray(weight), jnp.asarray(w_scale)))
    w = weight.astype(np.float64) * w_scale[:, None]
    exact = x.astype(np.float64) @ w.T
    bound = (np.abs(x).max(1, keepdims=True) / 127 / 2) * np.abs(w).sum(1)[None, :]
    assert np.all(np.abs(y - exact) <= bound * (1 + 1e-4) + 1e-5)


def test_fp8_matmul_is_lowered_with_fp8_operands_and_float32_result():
    """The form XLA's GPU backend maps to FP8 tensor cores (a dot of two f8E4M3FN operands
    with an f32 result, scales applied after): fixed in the lowered module."""
    x = jnp.zeros((4, IN), jnp.bfloat16)
    w = jnp.zeros((OUT, IN), jnp.float8_e4m3fn)
    text = jax.jit(w8a8_linear).lower(x, w, jnp.ones((1,), jnp.float32)).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert len(dots) == 1 and "f8E4M3FN" in dots[0] and "-> tensor<4x40xf32>" in dots[0]
    text = jax.jit(w8a8_linear).lower(x, w.astype(jnp.int8), jnp.ones((1,))).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert len(dots) == 1 and "xi8>" in dots[0] and "-> tensor<4x40xi32>" in dots[0]


def test_fp8_per_tensor_weight_scale_multiplies_the_dot_result_first():
    """The pattern XLA's GEMM rewriter folds into cuBLASLt's FP8 GEMM (its B scale): the dot's
    f32 result times the broadcast scalar weight scale, before the per-token activation scale.
    A per-channel scale cannot fold and stays after it."""
    x = jnp.zeros((4, IN), jnp.bfloat16)
    w = jnp.zeros((OUT, IN), jnp.float8_e4m3fn)
    lines = jax.jit(w8a8_linear).lower(x, w, jnp.ones((1,), jnp.float32)).as_text().splitlines()
    dot = next(line.split(" = ")[0].strip() for line in lines if "dot_general" in line)
    scalar = next(
        line.split(" = ")[0].strip()
        for line in lines
        if "broadcast_in_dim" in line and "(tensor<f32>) -> tensor<4x40xf32>" in line
    )
    assert any(f"stablehlo.multiply {dot}, {scalar}" in line for line in lines)
    text = jax.jit(w8a8_linear).lower(x, w, jnp.ones((OUT,), jnp.float32)).as_text()
    assert "(tensor<f32>) -> tensor<4x40xf32>" not in text  # per channel: no scalar to fold


def test_scaled_matmul_refuses_mixed_or_float_operands():
    with pytest.raises(ValueError, match="must share a dtype"):
        scaled_matmul(
            jnp.zeros((1, 4), jnp.int8),
            jnp.ones((1, 1)),
            jnp.zeros((2, 4), jnp.float8_e4m3fn),
            jnp.ones((1,)),
            jnp.float32,
        )
    with pytest.raises(ValueError, match="must be int8 or float8_e4m3fn, got float32"):
        w8a8_linear(jnp.zeros((1, 4)), jnp.zeros((2, 4)), jnp.ones((1,)))


def test_online_fp8_weights_error_bound_and_linear():
    rng = np.random.default_rng(3)
    weight = rng.standard_normal((OUT, IN)).astype(np.float32)
    params = load_fp8_layer("m.q_proj", {"weight": weight}, IN, OUT, Fp8Config(False, "dynamic"))
    assert params["weight"].dtype == ml_dtypes.float8_e4m3fn
    scale = float(params["weight_scale"][0])
    assert scale == pytest.approx(np.abs(weight).max() / FP8_E4M3_MAX, rel=1e-7)
    w_deq = params["weight"].astype(np.float64) * scale
    assert np.all(np.abs(w_deq - weight) <= FP8_REL * np.abs(weight) + FP8_ABS * scale + 1e-12)
    x = _x(3)
    y = np.asarray(fp8_linear(jnp.asarray(x), {k: jnp.asarray(v) for k, v in params.items()}))
    q, s = quantize_fp8(jnp.asarray(x))
    reference = (np.asarray(q, np.float64) * np.asarray(s, np.float64)) @ w_deq.T
    np.testing.assert_allclose(y, reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max())


def test_online_fp8_scale_is_amax_over_448_correctly_rounded():
    """vLLM's scale (a float32 division), not amax times a rounded 1/448 (XLA's rewrite of a
    division by a constant, one ulp off for about half of these weights)."""
    rng = np.random.default_rng(5)
    for _ in range(16):
        weight = rng.standard_normal((8, 16)).astype(np.float32) * rng.uniform(1e-3, 10)
        expected = np.abs(weight).max() / np.float32(FP8_E4M3_MAX)
        assert quantize_weight_fp8(weight)["weight_scale"].tobytes() == expected.tobytes()
    empty = quantize_weight_fp8(np.zeros((0, IN), np.float32))
    assert empty["weight"].shape == (0, IN) and empty["weight_scale"] == np.finfo(np.float32).tiny


def test_serialized_fp8_checkpoint_loads_and_names_missing_scales():
    weight = quantize_weight_fp8(np.ones((OUT, IN), np.float32))
    config = Fp8Config(True, "static")
    stored = {
        "weight": weight["weight"],
        "weight_scale": np.float32(0.5).reshape(()),
        "input_scale": np.array(0.25, np.float32),
    }
    params = load_fp8_layer("m.up_proj", stored, IN, OUT, config)
    assert params["weight_scale"].shape == (1,) and params["input_scale"].shape == (1,)
    del stored["input_scale"]
    with pytest.raises(ValueError, match=r"m\.up_proj\.input_scale is missing"):
        load_fp8_layer("m.up_proj", stored, IN, OUT, config)
    stored = {"weight": np.ones((OUT, IN), np.float16), "weight_scale": np.ones(1, np.float32)}
    with pytest.raises(ValueError, match=r"m\.up_proj\.weight has dtype float16"):
        load_fp8_layer("m.up_proj", stored, IN, OUT, Fp8Config(True, "dynamic"))
