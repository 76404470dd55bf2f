"""BlockMover: swap-out / swap-in / copy on real JAX caches, against numpy on the same data."""

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.worker.kv_cache import KVCacheSpec
from jaxpaged.worker.swap import BlockMover

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=jnp.float32)
NUM_BLOCKS = 7


def _caches(seed=0):
    rng = np.random.default_rng(seed)
    shape = (NUM_BLOCKS, SPEC.block_size, SPEC.num_kv_heads, SPEC.head_dim)
    host = [
        (rng.standard_normal(shape, np.float32), rng.standard_normal(shape, np.float32))
        for _ in range(SPEC.num_layers)
    ]
    return host, [(jnp.asarray(k), jnp.asarray(v)) for k, v in host]


def _ops(swap_in=(), swap_out=(), copy=()):
    return SimpleNamespace(
        blocks_to_swap_in=list(swap_in),
        blocks_to_swap_out=list(swap_out),
        blocks_to_copy=list(copy),
    )


def test_swap_out_then_in_moves_every_layer_of_k_and_v_into_new_blocks():
    expected, caches = _caches()
    mover = BlockMover(SPEC, num_cpu_blocks=5)
    caches = mover.execute(caches, _ops(swap_out=[(1, 4), (3, 0), (6, 2)]))  # 3 -> padded to 4
    for layer, (k, v) in enumerate(expected):
        np.testing.assert_array_equal(mover.host_cache[4, layer, 0], k[1])
        np.testing.assert_array_equal(mover.host_cache[0, layer, 1], v[3])
        np.testing.assert_array_equal(mover.host_cache[2, layer, 1], v[6])
    caches = mover.execute(caches, _ops(swap_in=[(4, 0), (0, 5), (2, 2)]))
    for layer, (k, v) in enumerate(expected):
        want_k, want_v = k.copy(), v.copy()
        want_k[0], want_k[5], want_k[2] = k[1], k[3], k[6]
        want_v[0], want_v[5], want_v[2] = v[1], v[3], v[6]
        np.testing.assert_array_equal(np.asarray(caches[layer][0]), want_k)
        np.testing.assert_array_equal(np.asarray(caches[layer][1]), want_v)


def test_copies_read_every_source_before_writing_any_destination():
    expected, caches = _caches(1)
    mover = BlockMover(SPEC, num_cpu_blocks=0)
    # 2 -> 5 and 5 -> 6 in one batch: block 6 gets block 5's old contents.
    caches = mover.execute(caches, _ops(copy=[(2, 5), (5, 6), (0, 1)]))
    for layer, (k, v) in enumerate(expected):
        for cache, want in ((caches[layer][0], k), (caches[layer][1], v)):
            want = want.copy()
            want[5], want[6], want[1] = want[2].copy(), want[5].copy(), want[0].copy()
            np.testing.assert_array_equal(np.asarray(cache), want)


def test_no_ops_leave_the_caches_untouched_and_swap_without_host_blocks_is_an_error():
    _, caches = _caches()
    mover = BlockMover(SPEC, num_cpu_blocks=0)
    assert mover.execute(caches, _ops()) is caches
    with pytest.raises(ValueError, match="swap_space is 0"):
        mover.execute(caches, _ops(swap_out=[(0, 0)]))


def test_host_cache_is_block_major_in_the_cache_dtype():
    mover = BlockMover(
        KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=16, dtype=jnp.bfloat16),
        num_cpu_blocks=2,
    )
    assert mover.host_cache.shape == (2, 3, 2, 16, 2, 8)
    assert mover.host_cache.dtype == jnp.bfloat16
