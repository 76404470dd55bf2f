"""W4A16 Pallas kernel (interpret mode; compiled on a GPU) vs its plain-JAX reference.

The repacked AWQ/GPTQ/compressed-tensors layers through the kernel:
``tests/models/quantization/test_w4a16.py``. The GPU run: ``pytest tests/pallas_kernels -k
"w4a16 or w8_gemv"`` (the compiled cases skip without a GPU).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.w4a16_matmul import (
    W4A16Tiling,
    w4a16_matmul,
    w4a16_matmul_reference,
)
from tests.pallas_kernels.test_paged_attention import INTERPRET_MODES, has_gpu


def random_words(rng, shape):
    """Random int32 words: every bit pattern is eight valid 4-bit values."""
    return rng.integers(0, 2**32, size=shape, dtype=np.uint64).astype(np.uint32).view(np.int32)


def _kernel_weights(rng, in_features, out_features, group_size):
    groups = in_features // group_size
    return {
        "qweight": random_words(rng, (in_features // 8, out_features)),
        "scales": (rng.uniform(0.5, 1.5, (groups, out_features)) * 1e-2).astype(np.float32),
        "zeros": rng.integers(0, 17, (groups, out_features)).astype(np.int8),  # 16: GPTQ v1
    }


def assert_close(actual, expected, rtol):
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    err = np.max(np.abs(actual - expected)) / np.max(np.abs(expected))
    assert err <= rtol, f"relative error {err:.2e} > {rtol:.0e}"


T = W4A16Tiling
# (tokens, in, out, group size, tiling): every variant, with T, N and split tails.
CASES = [
    # decode, elementwise: T = 1, 80 outputs in tiles of 32 (N tail), 8 steps in 3 splits
    (1, 1024, 80, 128, T(block_t=1, block_n=32, block_k=16, split_k=3, dot=False)),
    # elementwise, 3 tokens in a tile of 4, integer convert instead of the float bit trick
    (3, 512, 48, 64, T(block_t=4, block_n=32, block_k=16, dot=False, magic=False)),
    # the fold (zeros and scales per group after the products), elementwise and with dots
    (1, 1024, 80, 128, T(block_t=1, block_n=32, block_k=16, split_k=3, dot=False, fold=True)),
    (3, 512, 48, 64, T(block_t=4, block_n=32, block_k=32, dot=False, fold=True)),
    (
        3,
        1024,
        80,
        128,
        T(block_t=2, block_n=32, block_k=16, split_k=3, dot=False, fold=True, defer=True),
    ),  # fmt: skip
    (16, 512, 40, 32, T(block_t=16, block_n=32, block_k=16, split_k=2, fold=True)),
    # slots3d (the eight slots as one tile): N tail and 3 splits; a T tail over token tiles
    # of 2 with the result written directly (split_k = 1); groups of 32 (four per plane)
    (1, 1024, 80, 128, T(block_t=1, block_n=32, block_k=16, split_k=3, slots3d=True)),
    (5, 512, 48, 64, T(block_t=2, block_n=32, block_k=32, split_k=1, slots3d=True)),
    (3, 2048, 64, 32, T(block_t=4, block_n=16, block_k=16, slots3d=True, num_warps=1)),
    # dots, T = 3 padded to 16 rows, K split by default
    (3, 512, 64, 32, T(block_t=16, block_n=32, block_k=16)),
    # T = 16, swapped operands (weight tile first), groups of 256, N tail
    (16, 512, 40, 256, T(block_t=16, block_n=32, block_k=32, split_k=2, swap=True)),
    # T = 32 in two tiles of 16, int convert
    (32, 256, 64, 128, T(block_t=16, block_n=64, block_k=16, split_k=2, magic=False)),
    # prefill-like: 40 tokens in a 32-tile (T tail), no split (result written directly)
    (40, 512, 96, 128, T(block_t=32, block_n=64, block_k=32, split_k=1)),
    # the defaults per T (DEFAULT_TILINGS)
    (1, 512, 64, 128, None),
    (17, 512, 64, 128, None),
    (33, 256, 64, 64, None),
]


@pytest.mark.parametrize("interpret", INTERPRET_MODES)
@pytest.mark.parametrize("tokens,in_features,out_features,group_size,tiling", CASES)
def test_kernel_matches_reference_float32(
    tokens, in_features, out_features, group_size, tiling, interpret
):
    rng = np.random.default_rng(tokens * 7 + out_features)
    w = _kernel_weights(rng, in_features, out_features, group_size)
    x = jnp.asarray(rng.standard_normal((tokens, in_features)), jnp.float32)
    got = w4a16_matmul(x, **w, group_size=group_size, tiling=tiling, interpret=interpret)
    want = w4a16_matmul_reference(x, **w, group_size=group_size)
    assert got.shape == (tokens, out_features) and got.dtype == jnp.float32
    assert_close(got, want, 1e-4)


@pytest.mark.parametrize("interpret", INTERPRET_MODES)
@pytest.mark.parametrize(
    "dot,fold,slots3d",
    [(True, False, False), (False, False, False), (True, True, False), (False, True, False),
     (False, False, True)],
)  # fmt: skip
def test_kernel_bfloat16(dot, fold, slots3d, interpret):
    """bf16 in and out, bf16 scales: T over two tiles with a tail, two N tiles, K split."""
    rng = np.random.default_rng(7)
    w = _kernel_weights(rng, 1024, 64, 128)
    w["scales"] = w["scales"].astype(jnp.bfloat16)
    tokens = 19 if dot else 3
    x = jnp.asarray(rng.standard_normal((tokens, 1024)), jnp.bfloat16)
    tiling = T(block_t=16 if dot else 2, block_n=32, block_k=16, split_k=2, dot=dot, fold=fold,
               slots3d=slots3d)  # fmt: skip
    got = w4a16_matmul(x, **w, group_size=128, tiling=tiling, interpret=interpret)
    want = w4a16_matmul_reference(x, **w, group_size=128)
    assert got.dtype == jnp.bfloat16
    # bf16 weight tiles (dot) and a bf16 result: two roundings of 2^-9 each, inside 1e-2.
    assert_close(got, want, 1e-2)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(group_size=48), "group_size"),
        (dict(tiling=T(block_n=24, block_k=16)), "block_n"),
        (dict(tiling=T(block_k=8)), "block_k must be a power of two >= 16"),
        (dict(tiling=T(block_k=64)), "block_k=64 must divide group_size"),
        (dict(tiling=T(block_t=48, block_k=16)), "block_t"),
        (dict(tiling=T(block_t=8, block_k=16)), "block_t must be a power of two >= 16"),
        (dict(tiling=T(block_k=16, split_k=0)), "split_k"),
        (
            dict(
                tiling=T(block_k=16, slots3d=True),
                group_size=256,
                scales=np.ones((4, 64), np.float32),
                zeros=np.ones((4, 64), np.int8),
            ),
            "slots3d needs group_size",
        ),  # in / 8 = 128 rows per slot: a group of 256 straddles two slots
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


# Lowered for the H100 and the H200 at every default and sweep tiling: tests/gpu_lowering.


@pytest.mark.skipif(not has_gpu(), reason="compiled Pallas (Triton) kernels need a GPU")
@pytest.mark.parametrize("tokens", [1, 3, 16, 32, 40, 256])
def test_compiled_kernel_at_llama_shapes_with_default_tiles(tokens):
    """The Triton-compiled kernel at Llama-3-8B's down_proj (14336 -> 4096) and an N-tailed
    shape (bf16; f32 checks that TF32 is off)."""
    rng = np.random.default_rng(tokens)
    for in_features, out_features in ((14336, 4096), (4096, 1000)):
        w = _kernel_weights(rng, in_features, out_features, 128)
        for dtype, rtol in ((jnp.float32, 1e-4), (jnp.bfloat16, 1e-2)):
            x = jnp.asarray(rng.standard_normal((tokens, in_features)), dtype)
            got = w4a16_matmul(x, **w, group_size=128)
            assert_close(got, w4a16_matmul_reference(x, **w, group_size=128), rtol)
