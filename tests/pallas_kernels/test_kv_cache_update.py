"""kv_cache_update: scatter by slot, padding slot -1 dropped, in place under donation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kv_cache_shape, kv_cache_update

NUM_BLOCKS, BLOCK_SIZE, HKV, D = 6, 8, 2, 16


def _caches(rng, dtype=np.float32):
    shape = kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, HKV, D)
    return (rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype))


def _new_tokens(rng, num_tokens, dtype=np.float32):
    return (
        rng.standard_normal((num_tokens, HKV, D)).astype(dtype),
        rng.standard_normal((num_tokens, HKV, D)).astype(dtype),
    )


def test_kv_cache_shape_is_blocks_slots_heads_dim():
    assert kv_cache_shape(10, 16, 4, 64) == (10, 16, 4, 64)


def test_kv_cache_shape_rejects_empty_dimension():
    with pytest.raises(ValueError, match="block_size"):
        kv_cache_shape(10, 0, 4, 64)


def test_each_token_lands_in_its_slot_and_nothing_else_changes():
    rng = np.random.default_rng(0)
    k_cache, v_cache = _caches(rng)
    k_new, v_new = _new_tokens(rng, 5)
    slots = rng.permutation(NUM_BLOCKS * BLOCK_SIZE)[:5].astype(np.int32)

    k_out, v_out = kv_cache_update(
        jnp.asarray(k_cache), jnp.asarray(v_cache), k_new, v_new, jnp.asarray(slots)
    )

    k_expected, v_expected = k_cache.copy(), v_cache.copy()
    for t, slot in enumerate(slots):
        k_expected[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = k_new[t]
        v_expected[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = v_new[t]
    np.testing.assert_array_equal(np.asarray(k_out), k_expected)
    np.testing.assert_array_equal(np.asarray(v_out), v_expected)


def test_padding_slot_minus_one_is_dropped_not_written_to_last_slot():
    rng = np.random.default_rng(1)
    k_cache, v_cache = _caches(rng)
    k_new, v_new = _new_tokens(rng, 4)
    slots = np.array([3, -1, 9, -1], np.int32)

    k_out, v_out = kv_cache_update(
        jnp.asarray(k_cache), jnp.asarray(v_cache), k_new, v_new, jnp.asarray(slots)
    )

    # JAX would wrap -1 to the last slot; it must stay untouched.
    np.testing.assert_array_equal(np.asarray(k_out)[-1, -1], k_cache[-1, -1])
    np.testing.assert_array_equal(np.asarray(v_out)[-1, -1], v_cache[-1, -1])
    np.testing.assert_array_equal(np.asarray(k_out)[0, 3], k_new[0])
    np.testing.assert_array_equal(np.asarray(v_out)[1, 1], v_new[2])
    changed = np.any(np.asarray(k_out) != k_cache, axis=(2, 3))
    assert changed.sum() == 2


def test_new_values_are_cast_to_the_cache_dtype():
    rng = np.random.default_rng(2)
    k_cache, v_cache = (jnp.asarray(c, jnp.bfloat16) for c in _caches(rng))
    k_new, v_new = _new_tokens(rng, 2)
    k_out, v_out = kv_cache_update(k_cache, v_cache, k_new, v_new, jnp.array([0, 1], jnp.int32))
    assert k_out.dtype == v_out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(k_out[0, 1], np.float32),
        np.asarray(jnp.asarray(k_new[1], jnp.bfloat16), np.float32),
    )


def test_update_is_in_place_when_caller_donates_the_caches():
    rng = np.random.default_rng(3)
    k_cache, v_cache = (jnp.asarray(c) for c in _caches(rng))
    k_new, v_new = _new_tokens(rng, 3)
    k_pointer, v_pointer = k_cache.unsafe_buffer_pointer(), v_cache.unsafe_buffer_pointer()
    step = jax.jit(kv_cache_update, donate_argnums=(0, 1))

    k_out, v_out = step(k_cache, v_cache, k_new, v_new, jnp.array([0, 7, -1], jnp.int32))

    assert k_out.unsafe_buffer_pointer() == k_pointer
    assert v_out.unsafe_buffer_pointer() == v_pointer


@pytest.mark.parametrize(
    "case, match",
    [
        ("kv_shapes", "k_cache and v_cache"),
        ("new_shape", "k_new and v_new"),
        ("slot_dtype", "slot_mapping"),
        ("slot_length", "slot_mapping"),
    ],
)
def test_bad_arguments_raise_value_error(case, match):
    rng = np.random.default_rng(4)
    k_cache, v_cache = _caches(rng)
    k_new, v_new = _new_tokens(rng, 3)
    slots = np.array([0, 1, 2], np.int32)
    if case == "kv_shapes":
        v_cache = v_cache[:-1]
    elif case == "new_shape":
        k_new = k_new[:, :1]
    elif case == "slot_dtype":
        slots = slots.astype(np.int64)
    else:
        slots = slots[:2]
    with pytest.raises(ValueError, match=match):
        kv_cache_update(jnp.asarray(k_cache), jnp.asarray(v_cache), k_new, v_new, slots)
