"""``pallas_kernels.w8_gemv`` (interpreted; compiled on a GPU) against its plain-JAX reference,
which is itself checked against a float64 numpy product."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.w8_gemv import W8GemvTiling, _float_from_int8, w8_gemv, w8_gemv_reference
from tests.pallas_kernels.test_paged_attention import INTERPRET_MODES

K, N = 300, 70  # neither a multiple of the tiles: masked K and N tails
SMALL_TILES = W8GemvTiling(block_n=32, block_k=64, split_k=3)  # 3 N tiles, uneven K splits
# The variants the micro-benchmark sweeps: elementwise products (no dot) for a few tokens, INT8
# converted through bit patterns, with the same tails.
VARIANTS = [
    W8GemvTiling(max_block_t=1, block_n=32, block_k=64, split_k=3, dot=False),
    W8GemvTiling(max_block_t=4, block_n=32, block_k=64, split_k=2, dot=False, bits=True),
    W8GemvTiling(block_n=32, block_k=64, split_k=3, bits=True, num_warps=8),
    # each step's products summed at once (one program per 16 outputs over all of K, and split)
    W8GemvTiling(
        max_block_t=2, block_n=16, block_k=128, split_k=1, dot=False, bits=True, reduce_steps=True
    ),
    W8GemvTiling(max_block_t=1, block_n=32, block_k=64, split_k=3, dot=False, reduce_steps=True),
]


def _weights(dtype, scale_kind, rng, n=N, k=K):
    if dtype == "int8":
        w = jnp.asarray(rng.integers(-128, 128, (n, k)), jnp.int8)
    else:  # spread over e4m3's range, subnormals included
        w = jnp.asarray(rng.normal(size=(n, k)) * 30.0, jnp.float32).astype(jnp.float8_e4m3fn)
    size = 1 if scale_kind == "tensor" else n
    return w, jnp.asarray(rng.uniform(0.5, 2.0, size) / 100.0, jnp.float32)


def _float64(x, w, scale):
    x64, w64 = np.asarray(x, np.float64), np.asarray(w.astype(jnp.float32), np.float64)
    return x64 @ w64.T * np.asarray(scale, np.float64).reshape(-1)


@pytest.mark.parametrize("num_tokens", [1, 3, 16])
@pytest.mark.parametrize("scale_kind", ["tensor", "channel"])
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "int8"])
@pytest.mark.parametrize("interpret", INTERPRET_MODES)
def test_float32_matches_the_reference(dtype, scale_kind, num_tokens, interpret):
    rng = np.random.default_rng(num_tokens)
    w, scale = _weights(dtype, scale_kind, rng)
    x = jnp.asarray(rng.normal(size=(num_tokens, K)), jnp.float32)
    tiling = SMALL_TILES if num_tokens != 3 else None  # None: default tiles, one N tile
    got = w8_gemv(x, w, scale, tiling=tiling, interpret=interpret)
    ref = w8_gemv_reference(x, w, scale)
    assert got.shape == (num_tokens, N) and got.dtype == jnp.float32
    exact = _float64(x, w, scale)
    for out in (ref, got):  # relative to the largest output (cancellation in single entries)
        np.testing.assert_allclose(out, exact, rtol=1e-4, atol=1e-4 * np.abs(exact).max())


@pytest.mark.parametrize(
    "dtype, scale_kind, num_tokens", [("float8_e4m3fn", "tensor", 1), ("int8", "channel", 16)]
)
@pytest.mark.parametrize("interpret", INTERPRET_MODES)
def test_bfloat16_is_the_float32_result_rounded_once(dtype, scale_kind, num_tokens, interpret):
    """Tolerance: the converted weights and their products with bfloat16 ``x`` are exact in
    float32, so the kernel differs from the float32 reference only by summation order
    (``K * 2**-24`` of the sum of |terms| at most; ``2**-14`` of it allowed) and the final
    rounding to bfloat16 (half an ulp, ``2**-9`` relative; ``2**-8`` allowed)."""
    rng = np.random.default_rng(7)
    w, scale = _weights(dtype, scale_kind, rng)
    x = jnp.asarray(rng.normal(size=(num_tokens, K)), jnp.bfloat16)
    got = w8_gemv(x, w, scale, tiling=SMALL_TILES, interpret=interpret)
    assert got.dtype == jnp.bfloat16
    x32 = x.astype(jnp.float32)
    ref = np.asarray(w8_gemv_reference(x32, w, scale))
    magnitude = _float64(np.abs(x32), jnp.abs(w.astype(jnp.float32)), scale)  # sum of |terms|
    err = np.abs(np.asarray(got, np.float32) - ref)
    assert (err <= 2.0**-8 * np.abs(ref) + 2.0**-14 * magnitude).all(), err.max()


VARIANT_IDS = ["elementwise", "elementwise-bits", "dot-bits", "reduce-whole-k", "reduce-split"]


@pytest.mark.parametrize("num_tokens", [3, 16])
@pytest.mark.parametrize("tiling", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "int8"])
@pytest.mark.parametrize("interpret", INTERPRET_MODES)
def test_variants_match_the_reference(dtype, tiling, num_tokens, interpret):
    rng = np.random.default_rng(num_tokens + 11)
    w, scale = _weights(dtype, "channel", rng)
    x = jnp.asarray(rng.normal(size=(num_tokens, K)), jnp.float32)
    got = w8_gemv(x, w, scale, tiling=tiling, interpret=interpret)
    exact = _float64(x, w, scale)
    np.testing.assert_allclose(got, exact, rtol=1e-4, atol=1e-4 * np.abs(exact).max())


@pytest.mark.parametrize("tiling", [SMALL_TILES, *VARIANTS])
@pytest.mark.parametrize("interpret", INTERPRET_MODES)
def test_without_tails_the_unmasked_loads_match(tiling, interpret):
    """T, N and K multiples of the tiles: every load and store unmasked."""
    rng = np.random.default_rng(5)
    w, scale = _weights("int8", "channel", rng, n=64, k=256)
    x = jnp.asarray(rng.normal(size=(16, 256)), jnp.float32)
    got = w8_gemv(x, w, scale, tiling=tiling, interpret=interpret)
    exact = _float64(x, w, scale)
    np.testing.assert_allclose(got, exact, rtol=1e-4, atol=1e-4 * np.abs(exact).max())


def test_int8_bit_pattern_convert_is_exact():
    """Every int8 value through the bit-pattern convert gives itself."""
    values = jnp.arange(-128, 128, dtype=jnp.int32).astype(jnp.int8)
    np.testing.assert_array_equal(_float_from_int8(values), np.arange(-128, 128))


# Lowered for the H100 and the H200 with every tiling and weight dtype: tests/gpu_lowering.


def test_bad_arguments_are_refused_by_name():
    x = jnp.zeros((2, 32), jnp.float32)
    w = jnp.zeros((48, 32), jnp.int8)
    ok = jnp.ones((1,), jnp.float32)
    cases = [
        ("x must be", (jnp.zeros((32,), jnp.float32), w, ok)),
        ("x must be", (jnp.zeros((2, 32), jnp.int8), w, ok)),
        ("w must be", (x, jnp.zeros((48, 31), jnp.int8), ok)),
        ("w must be", (x, jnp.zeros((48, 32), jnp.bfloat16), ok)),
        ("scale must be", (x, w, jnp.ones((47,), jnp.float32))),
        ("scale must be", (x, w, jnp.ones((48,), jnp.bfloat16))),
    ]
    for fn in (w8_gemv, w8_gemv_reference):
        for message, args in cases:
            with pytest.raises(ValueError, match=message):
                fn(*args)
