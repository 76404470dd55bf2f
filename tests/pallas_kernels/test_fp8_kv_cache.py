"""FP8 KV cache helpers: round-trip error bounds per format, saturation, vLLM's scale rules."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.fp8_kv_cache import (
    K_SCALE_CONSTANT,
    V_SCALE_CONSTANT,
    dequantize_kv,
    kv_cache_fp8_dtype,
    kv_scale_from_amax,
    quantize_kv,
)

# Round to nearest: half an ulp relative for normals (3 mantissa bits for e4m3, 2 for e5m2);
# below the smallest normal, half the subnormal spacing absolute (e4m3fn: 2 ** -9, e5m2:
# 2 ** -16), both in units of the scale.
BOUNDS = {"fp8": (2.0**-4, 2.0**-10), "fp8_e5m2": (2.0**-3, 2.0**-17)}


def _kv(seed=0):
    """[T, Hkv, D] keys with a wide dynamic range (including exact zeros and tiny values)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((16, 2, 32)).astype(np.float32)
    x *= np.exp(rng.uniform(-8, 3, x.shape)).astype(np.float32)
    x[0, 0, :4] = 0.0
    return x


@pytest.mark.parametrize("name", sorted(BOUNDS))
@pytest.mark.parametrize("constant", [K_SCALE_CONSTANT, V_SCALE_CONSTANT])
def test_round_trip_error_is_within_the_format_bound(name, constant):
    dtype = kv_cache_fp8_dtype(name)
    x = _kv()
    scale = kv_scale_from_amax(jnp.asarray(x), constant)
    assert float(scale) == pytest.approx(np.abs(x).max() / constant, rel=1e-6)
    stored = quantize_kv(jnp.asarray(x), scale, dtype)
    assert stored.dtype == dtype and stored.shape == x.shape
    back = np.asarray(dequantize_kv(stored, scale), np.float64)
    rel, absolute = BOUNDS[name]
    err = np.abs(back - x)
    assert np.all(err <= rel * np.abs(x) + absolute * float(scale) + 1e-30)
    assert np.all(back[0, 0, :4] == 0.0)


def test_default_scale_of_one_is_a_plain_cast():
    x = _kv(1).clip(-400, 400)
    stored = quantize_kv(jnp.asarray(x), 1.0)
    np.testing.assert_array_equal(
        np.asarray(stored).view(np.uint8),
        np.asarray(jnp.asarray(x).astype(jnp.float8_e4m3fn)).view(np.uint8),
    )


@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_values_past_the_range_saturate_instead_of_becoming_nan(name):
    dtype = kv_cache_fp8_dtype(name)
    fmax = float(jnp.finfo(dtype).max)
    x = jnp.asarray([[1e9, -1e9, 3 * fmax, 1.0]], jnp.float32)
    back = np.asarray(dequantize_kv(quantize_kv(x, 1.0, dtype), 1.0))
    np.testing.assert_array_equal(back, [[fmax, -fmax, fmax, 1.0]])


def test_per_layer_scale_is_a_traced_value_and_dequantize_returns_the_compute_dtype():
    @jax.jit
    def round_trip(x, k_scale):
        return dequantize_kv(quantize_kv(x, k_scale), k_scale, jnp.bfloat16)

    x = jnp.asarray(_kv(2))
    a = round_trip(x, jnp.float32(0.5))
    b = round_trip(x, jnp.float32(0.25))  # same compiled function, another layer's scale
    assert a.dtype == jnp.bfloat16 and round_trip._cache_size() == 1
    assert not np.array_equal(np.asarray(a), np.asarray(b))


def test_all_zero_input_gets_the_default_scale():
    assert float(kv_scale_from_amax(jnp.zeros((4, 2, 8)), K_SCALE_CONSTANT)) == 1.0


def test_kv_cache_dtype_names_are_vllms():
    assert kv_cache_fp8_dtype("fp8") == jnp.float8_e4m3fn
    assert kv_cache_fp8_dtype("fp8_e4m3") == jnp.float8_e4m3fn
    assert kv_cache_fp8_dtype("fp8_e5m2") == jnp.float8_e5m2
    with pytest.raises(
        ValueError, match="kv_cache_dtype must be one of fp8, fp8_e4m3, fp8_e5m2 .* got 'int8'"
    ):
        kv_cache_fp8_dtype("int8")


def _decode_case(seed=3):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, 4, 32)).astype(np.float32)  # [B, Hq, D]
    k = rng.standard_normal((2, 24, 2, 32)).astype(np.float32)  # [B, S, Hkv, D]
    v = rng.standard_normal((2, 24, 2, 32)).astype(np.float32) * 3
    return q, k, v, jnp.asarray([24, 17], jnp.int32)


def test_folding_the_scales_out_of_the_kernel_is_the_same_attention():
    """docs/quantization.md's plan: kernels may read raw fp8 and fold the scales into the logit
    scale (``sm_scale * k_scale``) and the output (``* v_scale``) instead of dequantizing each
    element: the same attention up to float32 rounding."""
    from pallas_kernels import paged_attention_reference

    q, k, v, seq_lens = _decode_case()
    k_scale = kv_scale_from_amax(jnp.asarray(k), K_SCALE_CONSTANT)
    v_scale = kv_scale_from_amax(jnp.asarray(v), V_SCALE_CONSTANT)
    k8, v8 = quantize_kv(jnp.asarray(k), k_scale), quantize_kv(jnp.asarray(v), v_scale)
    sm = 32**-0.5
    dequantized = paged_attention_reference(
        jnp.asarray(q), dequantize_kv(k8, k_scale), dequantize_kv(v8, v_scale), seq_lens, scale=sm
    )
    folded = v_scale * paged_attention_reference(
        jnp.asarray(q),
        k8.astype(jnp.float32),
        v8.astype(jnp.float32),
        seq_lens,
        scale=sm * float(k_scale),  # the reference takes a static scale
    )
    np.testing.assert_allclose(np.asarray(folded), np.asarray(dequantized), rtol=1e-5, atol=1e-5)


def test_fp8_kv_attention_error_is_within_its_derived_bound():
    """Attention over an e4m3 cache against float32 K/V. Each logit moves by at most
    ``delta = sm * sum_d |q_d| |dk_d|``, so each softmax weight by a factor within
    ``exp(+-2 delta)``, and ``|d out| <= (exp(2 delta) - 1) * max|v| + max|dv|``."""
    from pallas_kernels import paged_attention_reference

    q, k, v, seq_lens = _decode_case(4)
    sm = 32**-0.5
    k_scale = kv_scale_from_amax(jnp.asarray(k), K_SCALE_CONSTANT)
    v_scale = kv_scale_from_amax(jnp.asarray(v), V_SCALE_CONSTANT)
    k_deq = np.asarray(dequantize_kv(quantize_kv(jnp.asarray(k), k_scale), k_scale))
    v_deq = np.asarray(dequantize_kv(quantize_kv(jnp.asarray(v), v_scale), v_scale))
    exact = np.asarray(paged_attention_reference(*map(jnp.asarray, (q, k, v)), seq_lens, scale=sm))
    fp8 = np.asarray(
        paged_attention_reference(
            jnp.asarray(q), jnp.asarray(k_deq), jnp.asarray(v_deq), seq_lens, scale=sm
        )
    )
    group = 2  # Hq / Hkv
    for b, length in enumerate([24, 17]):
        for h in range(4):
            dk = np.abs(k_deq[b, :length, h // group] - k[b, :length, h // group])
            delta = sm * (np.abs(q[b, h]) * dk).sum(-1).max()
            dv = np.abs(v_deq[b, :length, h // group] - v[b, :length, h // group]).max()
            vmax = np.abs(v[b, :length, h // group]).max()
            bound = (np.exp(2 * delta) - 1) * vmax + dv
            assert np.abs(fp8[b, h] - exact[b, h]).max() <= bound * (1 + 1e-4) + 1e-6
    assert np.abs(fp8 - exact).max() > 0  # the cache really was quantized
