"""pallas_kernels.grouped_matmul against its plain-JAX reference (per-row gather, float32)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import grouped_matmul as gm
from pallas_kernels.grouped_matmul import grouped_matmul, grouped_matmul_reference

ON_GPU = jax.devices()[0].platform == "gpu"


def _case(m, k, n, sizes, dtype, seed=0):
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.normal(size=(m, k)), dtype)
    rhs = jnp.asarray(rng.normal(size=(len(sizes), k, n)) / np.sqrt(k), dtype)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32)


# Empty groups first, in the middle and last; one group owning every row; rows past the sum.
SIZES = [[0, 3, 0, 5, 2, 0], [10, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1], [4, 0, 2, 0, 0, 0]]


@pytest.mark.parametrize("sizes", SIZES)
def test_xla_backend_matches_reference(sizes):
    lhs, rhs, group_sizes = _case(10, 16, 24, sizes, jnp.float32)
    out = grouped_matmul(lhs, rhs, group_sizes, precision=jax.lax.Precision.HIGHEST)
    ref = grouped_matmul_reference(lhs, rhs, group_sizes)
    used = int(sum(sizes))
    # float32 both sides, summation order only.
    np.testing.assert_allclose(np.asarray(out)[:used], np.asarray(ref)[:used], rtol=1e-5,
                               atol=1e-5)  # fmt: skip


@pytest.mark.skipif(not ON_GPU, reason="Mosaic GPU kernel: Hopper GPUs only")
@pytest.mark.parametrize("m", [2, 130, 1024])
def test_mosaic_gpu_backend_matches_reference(m):
    rng = np.random.default_rng(m)
    sizes = np.bincount(rng.integers(0, 8, size=m), minlength=8)
    lhs, rhs, group_sizes = _case(m, 256, 384, sizes, jnp.bfloat16)
    out = grouped_matmul(lhs, rhs, group_sizes, backend="mosaic_gpu")
    ref = grouped_matmul_reference(lhs, rhs, group_sizes)
    # bf16 output of an f32 accumulation over K=256: within a few bf16 ulps of |out| ~ 1.
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=3e-2, rtol=2e-2)


def test_bad_arguments_raise_naming_them():
    lhs, rhs, group_sizes = _case(4, 16, 24, [2, 2], jnp.float32)
    with pytest.raises(ValueError, match="backend must be one of"):
        grouped_matmul(lhs, rhs, group_sizes, backend="cutlass")
    with pytest.raises(ValueError, match="bf16 or f16 operands.*float32"):
        grouped_matmul(lhs, rhs, group_sizes, backend="mosaic_gpu")
    lhs16, rhs16, _ = _case(4, 16, 24, [2, 2], jnp.bfloat16)
    with pytest.raises(ValueError, match="K=16, N=24"):
        grouped_matmul(lhs16, rhs16, group_sizes, backend="mosaic_gpu")
    with pytest.raises(ValueError, match=r"must be \[M, K\], \[G, K, N\] and \[G\]"):
        grouped_matmul(lhs, rhs[:, :8], group_sizes)


def test_tile_table_picks_the_first_matching_entry(monkeypatch):
    small = gm.MosaicTiles(block_m=64)
    wide = gm.MosaicTiles(block_n=256, block_m=64)
    monkeypatch.setattr(gm, "TILE_TABLE", ((512, 4096, None, small), (4096, None, 28672, wide)))
    assert gm.mosaic_tiles(512, 4096, 28672) == small
    assert gm.mosaic_tiles(513, 4096, 28672) == wide
    assert gm.mosaic_tiles(513, 14336, 4096) == gm.DEFAULT_TILES  # no entry matches
    assert gm.mosaic_tiles(8192, 4096, 28672) == gm.DEFAULT_TILES
    # The validation names the tiles in use.
    lhs16, rhs16, sizes = _case(4, 64, 192, [2, 2], jnp.bfloat16)
    with pytest.raises(ValueError, match="N % 256 == 0, got K=64, N=192"):
        grouped_matmul(lhs16, rhs16, sizes, backend="mosaic_gpu", tiles=wide)
