"""models.merged_linear: one matmul for several projections, columns laid out per shard."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.merged_linear import MergedColumnParallelLinear, merged_column_order


def _layer(output_sizes, num_shards, *, use_bias=True):
    return MergedColumnParallelLinear(
        5, output_sizes, num_shards=num_shards, use_bias=use_bias, dtype=jnp.float32,
        param_dtype=jnp.float32, precision="highest", rngs=nnx.Rngs(0),
    )  # fmt: skip


@pytest.mark.parametrize("num_shards", [1, 2, 4])
def test_call_returns_each_part_as_its_own_projection(num_shards):
    """Kernel columns built by hand shard by shard, [a_s | b_s | c_s] for each shard s; each
    returned part equals ``x @ W_p + b_p`` of its own (unfused) projection."""
    rng = np.random.default_rng(0)
    sizes = (8, 4, 4)  # q, k, v-like
    weights = [rng.normal(size=(5, n)).astype(np.float32) for n in sizes]
    biases = [rng.normal(size=(n,)).astype(np.float32) for n in sizes]
    kernel_cols, bias_cols = [], []
    for s in range(num_shards):
        for w, b, n in zip(weights, biases, sizes, strict=True):
            block = slice(s * n // num_shards, (s + 1) * n // num_shards)
            kernel_cols.append(w[:, block])
            bias_cols.append(b[block])
    layer = _layer(sizes, num_shards)
    layer.kernel.set_value(jnp.asarray(np.concatenate(kernel_cols, axis=1)))
    layer.bias.set_value(jnp.asarray(np.concatenate(bias_cols)))
    x = rng.normal(size=(3, 5)).astype(np.float32)
    parts = layer(jnp.asarray(x))
    assert [p.shape for p in parts] == [(3, n) for n in sizes]
    for part, w, b in zip(parts, weights, biases, strict=True):
        np.testing.assert_allclose(np.asarray(part), x @ w + b, rtol=1e-6, atol=1e-6)


def test_column_order_is_shard_major():
    # parts of 4 and 2 columns over 2 shards: [a0 a1 | b0 | a2 a3 | b1] -> indices in [a | b]
    np.testing.assert_array_equal(merged_column_order((4, 2), 2), [0, 1, 4, 2, 3, 5])
    np.testing.assert_array_equal(merged_column_order((3, 2), 1), [0, 1, 2, 3, 4])


def test_column_order_agrees_with_the_forward_split():
    """The loaders place columns by ``merged_column_order``; the forward splits by reshape and
    slice. With an identity input each part returns its own columns of the kernel."""
    sizes, num_shards = (6, 2, 2), 2
    layer = _layer(sizes, num_shards, use_bias=False)
    order = merged_column_order(sizes, num_shards)
    # Physical column j holds the (unique) value order[j] in every row.
    layer.kernel.set_value(jnp.asarray(np.tile(order.astype(np.float32), (5, 1))))
    parts = layer(jnp.eye(5, dtype=jnp.float32)[:1])
    got = np.concatenate([np.asarray(p)[0] for p in parts])
    np.testing.assert_array_equal(got, np.arange(sum(sizes)))


def test_sizes_that_do_not_divide_raise():
    with pytest.raises(ValueError, match=r"output size 6 of \(8, 6\) .* num_shards \(4\)"):
        _layer((8, 6), 4)
