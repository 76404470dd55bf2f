"""W4A16 Pallas kernel (interpret mode) vs its plain-JAX reference.

The repacked AWQ/GPTQ layers through the kernel: ``tests/models/quantization/test_w4a16.py``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.w4a16_matmul import w4a16_matmul, w4a16_matmul_reference
from tests.pallas_kernels.test_paged_attention import has_gpu


def random_words(rng, shape):
    """Random int32 words: every bit pattern is eight valid 4-bit values."""
    return rng.integers(0, 2**32, size=shape, dtype=np.uint64).astype(np.uint32).view(np.int32)


def _kernel_weights(rng, in_features, out_features, group_size):
    groups = in_features // group_size
    return {
        "qweight": random_words(rng, (in_features // 8, out_features)),
        "scales": (rng.uniform(0.5, 1.5, (groups, out_features)) * 1e-2).astype(np.float32),
        "zeros": rng.integers(0, 16, (groups, out_features)).astype(np.int8),
    }


def assert_close(actual, expected, rtol):
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    err = np.max(np.abs(actual - expected)) / np.max(np.abs(expected))
    assert err <= rtol, f"relative error {err:.2e} > {rtol:.0e}"


@pytest.mark.parametrize(
    "tokens,in_features,out_features,group_size",
    [(1, 256, 32, 32), (5, 256, 64, 64), (20, 512, 32, 128), (3, 256, 48, 256)],
)
def test_kernel_matches_reference_float32(tokens, in_features, out_features, group_size):
    rng = np.random.default_rng(tokens)
    w = _kernel_weights(rng, in_features, out_features, group_size)
    x = jnp.asarray(rng.standard_normal((tokens, in_features)), jnp.float32)
    got = w4a16_matmul(x, **w, group_size=group_size, interpret=True)
    want = w4a16_matmul_reference(x, **w, group_size=group_size)
    assert got.shape == (tokens, out_features) and got.dtype == jnp.float32
    assert_close(got, want, 1e-4)


def test_kernel_bfloat16_with_several_tiles():
    """T over two T tiles (not a multiple), two N tiles, two K steps; bf16 in and out."""
    rng = np.random.default_rng(7)
    w = _kernel_weights(rng, 1024, 64, 128)
    w["scales"] = w["scales"].astype(jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((19, 1024)), jnp.bfloat16)
    got = w4a16_matmul(x, **w, group_size=128, block_t=16, block_n=32, block_k=16, interpret=True)
    want = w4a16_matmul_reference(x, **w, group_size=128)
    assert got.dtype == jnp.bfloat16
    # bf16 weight tiles and a bf16 result: two roundings of 2^-9 each, well inside 1e-2.
    assert_close(got, want, 1e-2)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(group_size=48), "group_size"),
        (dict(block_n=24), "block_n"),
        (dict(block_n=128), "block_n=128 must divide out"),
        (dict(block_k=8), "block_k"),
        (dict(block_k=64), "block_k=64 must divide group_size"),
        (dict(block_t=32 + 16), "block_t"),
        (dict(qweight=np.zeros((16, 64), np.int32)), "qweight"),
        (dict(scales=np.ones((2, 64), np.float32)), "scales"),
        (dict(zeros=np.ones((8, 64), np.float32)), "zeros"),
    ],
)
def test_bad_arguments_name_the_argument(change, match):
    rng = np.random.default_rng(0)
    args = dict(_kernel_weights(rng, 1024, 64, 32), group_size=32, interpret=True)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        w4a16_matmul(jnp.zeros((1, 1024), jnp.float32), **args)


@pytest.mark.skipif(not has_gpu(), reason="compiled Pallas (Triton) kernels need a GPU")
@pytest.mark.parametrize("tokens", [1, 40])
def test_compiled_kernel_matches_reference(tokens):
    """The Triton-compiled kernel at a Llama-like shape (bf16; f32 checks TF32 is off)."""
    rng = np.random.default_rng(tokens)
    w = _kernel_weights(rng, 4096, 1024, 128)
    for dtype, rtol in ((jnp.float32, 1e-4), (jnp.bfloat16, 1e-2)):
        x = jnp.asarray(rng.standard_normal((tokens, 4096)), dtype)
        got = w4a16_matmul(x, **w, group_size=128)
        assert_close(got, w4a16_matmul_reference(x, **w, group_size=128), rtol)
