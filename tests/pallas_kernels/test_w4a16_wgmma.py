"""The Hopper tensor-core W4A16 kernel (Mosaic GPU) against the plain-JAX reference: in Mosaic
GPU's interpret mode here (shared memory, barriers, TMA and ``wgmma`` simulated, races
detected), compiled on a Hopper GPU (``pytest tests/pallas_kernels -k wgmma`` there)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.w4a16_matmul import w4a16_matmul_reference
from pallas_kernels.w4a16_wgmma import SMEM_BUDGET, WgmmaTiling, smem_bytes, w4a16_wgmma
from tests.pallas_kernels.test_w4a16_matmul import _kernel_weights, assert_close

ON_HOPPER = jax.default_backend() == "gpu" and any(
    name in jax.devices()[0].device_kind for name in ("H100", "H200", "H800", "H20")
)
MODES = [
    True,
    pytest.param(False, marks=pytest.mark.skipif(not ON_HOPPER, reason="Hopper GPUs only")),
]


def _rounded_reference(x, w, group_size):
    """The reference with the weight rounded to ``x.dtype`` before the float32 dot, as the
    kernel (and ``awq_linear``) does: the kernel may differ from it only by summation order
    and the output's rounding."""
    eye = jnp.eye(x.shape[1], dtype=jnp.float32)
    weight = w4a16_matmul_reference(eye, **w, group_size=group_size).astype(x.dtype)
    y = jnp.dot(x.astype(jnp.float32), weight.astype(jnp.float32), precision="highest")
    return y.astype(x.dtype)


# (tokens, in, out, group size, dtype, tiling): a token tail in one tile; three token tiles with
# a tail and three output tiles; groups spanning two steps in one stage of 128 outputs; 128-token
# tiles; float16.
CASES = [
    (40, 1024, 64, 64, jnp.bfloat16, WgmmaTiling()),
    (130, 1024, 192, 128, jnp.bfloat16, WgmmaTiling()),
    (64, 2048, 128, 128, jnp.bfloat16, WgmmaTiling(tile_n=128, stages=1)),
    (130, 1024, 64, 64, jnp.bfloat16, WgmmaTiling(tile_m=128, stages=1)),
    (17, 1024, 64, 128, jnp.float16, WgmmaTiling()),
]


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("tokens,in_features,out_features,group_size,dtype,tiling", CASES)
def test_kernel_matches_reference(
    tokens, in_features, out_features, group_size, dtype, tiling, interpret
):
    rng = np.random.default_rng(tokens + in_features + out_features)
    w = _kernel_weights(rng, in_features, out_features, group_size)
    w["scales"] = w["scales"].astype(dtype)
    x = jnp.asarray(rng.standard_normal((tokens, in_features)), dtype)
    got = w4a16_wgmma(x, **w, group_size=group_size, tiling=tiling, interpret=interpret)
    assert got.shape == (tokens, out_features) and got.dtype == dtype
    # One rounding of the output to 16 bits apart (2^-8 relative for bf16, 2^-11 for f16).
    ulp = 2.0**-8 if dtype == jnp.bfloat16 else 2.0**-11
    assert_close(got, _rounded_reference(x, w, group_size), ulp)
    # And within the weight's 16-bit rounding of the exact float32 product.
    assert_close(got, w4a16_matmul_reference(x, **w, group_size=group_size), 4 * ulp)


def test_shared_memory_and_tma_accesses_are_ordered():
    """The interpreter's happens-before race detector over the pipeline's TMA refills and the
    epilogue (it flags a missing ``commit_smem`` before the TMA store, or a missing
    ``wait_smem_to_gmem``). It runs ``wgmma`` synchronously and does not model the proxy fence
    between the dequantized tile's stores and ``wgmma``, so the two buffers' ``wgmma_wait(1)``
    and the inner ``commit_smem`` are checked only compiled, on a Hopper GPU."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    rng = np.random.default_rng(3)
    w = _kernel_weights(rng, 1024, 64, 64)
    w["scales"] = w["scales"].astype(jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((64, 1024)), jnp.bfloat16)
    params = plgpu.InterpretGPUParams(detect_races=True)
    jax.block_until_ready(w4a16_wgmma(x, **w, group_size=64, interpret=params))
    assert interpret_pallas_call.get_races().races_found is False


def test_bad_arguments_name_the_argument_and_the_limit():
    rng = np.random.default_rng(0)
    w = _kernel_weights(rng, 1024, 64, 64)
    x = jnp.zeros((4, 1024), jnp.bfloat16)
    with pytest.raises(ValueError, match="x must be"):
        w4a16_wgmma(x.astype(jnp.float32), **w, group_size=64)
    with pytest.raises(ValueError, match=r"group_size must divide in / 8 = 128"):
        w4a16_wgmma(x, **w, group_size=256)  # 1024 / 256 groups, but a plane is 128 rows
    with pytest.raises(ValueError, match="tile_n=128 must divide out=64"):
        w4a16_wgmma(x, **w, group_size=64, tiling=WgmmaTiling(tile_n=128))
    with pytest.raises(ValueError, match="block_k must be a multiple of 64"):
        w4a16_wgmma(x, **w, group_size=64, tiling=WgmmaTiling(block_k=32))
    big = WgmmaTiling(tile_m=128, tile_n=256, stages=3)
    assert smem_bytes(big) > SMEM_BUDGET
    w_wide = _kernel_weights(rng, 1024, 256, 64)
    with pytest.raises(ValueError, match=f"more than {SMEM_BUDGET}"):
        w4a16_wgmma(x, **w_wide, group_size=64, tiling=big)
    with pytest.raises(ValueError, match=r"scales must be float \[G=16, out=64\]"):
        w4a16_wgmma(x, w["qweight"], w["scales"][:8], w["zeros"], group_size=64)
