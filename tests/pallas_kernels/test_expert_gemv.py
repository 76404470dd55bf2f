"""``pallas_kernels.expert_gemv`` (interpreted; compiled on a GPU) against a per-row numpy loop."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.expert_gemv import ExpertGemvTiling, expert_gemv
from tests.pallas_kernels.test_paged_attention import INTERPRET_MODES

INTERPRET = INTERPRET_MODES
NUM_EXPERTS, K, N = 6, 80, 48  # K and N not multiples of the tiles: masked tails


def _reference(x, ids, w):
    out = np.zeros((x.shape[0], w.shape[2]), np.float64)
    for r, e in enumerate(ids):
        if 0 <= e < w.shape[0]:
            out[r] = x[r].astype(np.float64) @ w[e].astype(np.float64)
    return out


@pytest.mark.parametrize(
    "num_rows, tiling",
    [
        (1, None),
        (5, None),
        (20, ExpertGemvTiling(max_block_m=16, block_n=16, block_k=16)),  # two row tiles
        (5, ExpertGemvTiling(block_n=32, block_k=16, split_k=3)),  # uneven K splits
    ],
)
@pytest.mark.parametrize("interpret", INTERPRET)
def test_float32_matches_the_per_row_reference(num_rows, tiling, interpret):
    rng = np.random.default_rng(num_rows)
    x = rng.normal(size=(num_rows, K)).astype(np.float32)
    w = rng.normal(size=(NUM_EXPERTS, K, N)).astype(np.float32)
    ids = rng.integers(0, NUM_EXPERTS, num_rows).astype(np.int32)
    if num_rows > 1:
        ids[-1] = -1  # outside [0, E): a zero row
    got = np.asarray(expert_gemv(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w),
                                 interpret=interpret, tiling=tiling))  # fmt: skip
    expected = _reference(x, ids, w)
    assert got.shape == (num_rows, N) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    assert not got[ids == -1].any()


@pytest.mark.parametrize("interpret", INTERPRET)
def test_bfloat16_within_a_few_ulps_of_the_float32_reference(interpret):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(8, K)).astype(np.float32)
    w = (rng.normal(size=(NUM_EXPERTS, K, N)) / np.sqrt(K)).astype(np.float32)
    ids = np.array([0, 5, 5, 2, 0, 1, 3, 4], np.int32)
    got = expert_gemv(jnp.asarray(x, jnp.bfloat16), jnp.asarray(ids),
                      jnp.asarray(w, jnp.bfloat16), interpret=interpret)  # fmt: skip
    assert got.dtype == jnp.bfloat16
    x16 = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)
    w16 = np.asarray(jnp.asarray(w, jnp.bfloat16), np.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), _reference(x16, ids, w16),
                               rtol=2e-2, atol=2e-2)  # fmt: skip


def test_bad_arguments_raise_naming_them():
    x = jnp.zeros((4, K), jnp.float32)
    w = jnp.zeros((NUM_EXPERTS, K, N), jnp.float32)
    with pytest.raises(ValueError, match=r"x must be \[M, K\], got \(4, 80, 1\)"):
        expert_gemv(x[..., None], jnp.zeros(4, jnp.int32), w)
    with pytest.raises(ValueError, match=r"expert_ids must be i32\[M=4\], got int32\[3\]"):
        expert_gemv(x, jnp.zeros(3, jnp.int32), w)
    with pytest.raises(ValueError, match=r"w must be \[E, K=80, N\] of float32, got bfloat16"):
        expert_gemv(x, jnp.zeros(4, jnp.int32), w.astype(jnp.bfloat16))
