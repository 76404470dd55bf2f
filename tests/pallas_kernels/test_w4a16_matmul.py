"""W4A16 Pallas kernel (interpret mode) vs its plain-JAX reference and vs the AWQ/GPTQ linears."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.quantization.awq import awq_linear
from models.quantization.gptq import gptq_linear
from pallas_kernels.w4a16_matmul import (
    repack_awq,
    repack_gptq,
    w4a16_matmul,
    w4a16_matmul_reference,
)


def _words(rng, shape):
    """Random int32 words: every bit pattern is eight valid 4-bit values."""
    return rng.integers(0, 2**32, size=shape, dtype=np.uint64).astype(np.uint32).view(np.int32)


def _kernel_weights(rng, in_features, out_features, group_size):
    groups = in_features // group_size
    return {
        "qweight": _words(rng, (in_features // 8, out_features)),
        "scales": (rng.uniform(0.5, 1.5, (groups, out_features)) * 1e-2).astype(np.float32),
        "zeros": rng.integers(0, 16, (groups, out_features)).astype(np.int8),
    }


def _close(actual, expected, rtol):
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
    _close(got, want, 1e-4)


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
    _close(got, want, 1e-2)


def _awq_stored(rng, in_features, out_features, group_size):
    groups = in_features // group_size
    return {
        "qweight": _words(rng, (in_features, out_features // 8)),
        "qzeros": _words(rng, (groups, out_features // 8)),
        "scales": (rng.uniform(0.5, 1.5, (groups, out_features)) * 1e-2).astype(np.float16),
    }


@pytest.mark.parametrize("tokens,group_size", [(1, 32), (17, 64)])
def test_repacked_awq_equals_awq_linear(tokens, group_size):
    rng = np.random.default_rng(group_size)
    stored = _awq_stored(rng, 256, 32, group_size)
    x = jnp.asarray(rng.standard_normal((tokens, 256)), jnp.float32)
    got = w4a16_matmul(x, **repack_awq(**stored), group_size=group_size, interpret=True)
    _close(got, awq_linear(x, *map(jnp.asarray, stored.values())), 1e-4)


@pytest.mark.parametrize("checkpoint_format,symmetric", [("gptq", True), ("gptq", False),
                                                         ("gptq_v2", False)])  # fmt: skip
def test_repacked_gptq_equals_gptq_linear(checkpoint_format, symmetric):
    rng = np.random.default_rng(3)
    in_features, out_features, group_size = 256, 32, 128
    groups = in_features // group_size
    if symmetric:  # every zero point 8: v1 stores 7 in each nibble
        qzeros = np.full((groups, out_features // 8), 0x77777777, np.int64).astype(np.int32)
    else:
        qzeros = _words(rng, (groups, out_features // 8))
    stored = {
        "qweight": _words(rng, (in_features // 8, out_features)),
        "qzeros": qzeros,
        "scales": (rng.uniform(0.5, 1.5, (groups, out_features)) * 1e-2).astype(np.float16),
    }
    x = jnp.asarray(rng.standard_normal((2, in_features)), jnp.float32)
    kernel = repack_gptq(**stored, checkpoint_format=checkpoint_format)
    if symmetric:
        assert np.all(kernel["zeros"] == 8)
    got = w4a16_matmul(x, **kernel, group_size=group_size, interpret=True)
    want = gptq_linear(x, *map(jnp.asarray, stored.values()), bits=4,
                       checkpoint_format=checkpoint_format)  # fmt: skip
    _close(got, want, 1e-4)


def test_repack_gptq_refuses_act_order_and_8_bit():
    stored = {"qweight": np.zeros((32, 32), np.int32), "qzeros": np.zeros((2, 4), np.int32),
              "scales": np.ones((2, 32), np.float16)}  # fmt: skip
    with pytest.raises(ValueError, match="g_idx"):
        repack_gptq(**stored, g_idx=np.zeros(256, np.int32))
    with pytest.raises(ValueError, match="bits=8"):
        repack_gptq(**stored, bits=8)


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
