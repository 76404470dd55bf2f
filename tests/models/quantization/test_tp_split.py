"""Tensor-parallel split rules: every shard dequantizes to exactly its block of the whole weight.

Random int32 words are valid packed data for every layout (each field is just some value), so
the layers here are random words and random scales.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.quantization.awq import awq_dequantize
from models.quantization.bitsandbytes import bitsandbytes_dequantize
from models.quantization.compressed_tensors import dequantize_wna16
from models.quantization.gptq import gptq_dequantize
from models.quantization.tp_split import TP_SPLIT_AXES, shard_layer, tp_split_axis

IN, OUT, TP = 128, 64, 2
RNG = np.random.default_rng(0)


def _words(*shape):
    return RNG.integers(-(2**31), 2**31, shape, dtype=np.int64).astype(np.int32)


def _scales(*shape):
    return RNG.uniform(0.01, 0.1, shape).astype(np.float32)


def _awq(group_size=64):
    groups = IN // group_size
    return {
        "qweight": _words(IN, OUT // 8),
        "qzeros": _words(groups, OUT // 8),
        "scales": _scales(groups, OUT),
    }


def _gptq(bits=4, groups=4, act_order=False):
    pack = 32 // bits
    g_idx = np.arange(IN) // (IN // groups)
    return {
        "qweight": _words(IN // pack, OUT),
        "qzeros": _words(groups, OUT // pack),
        "scales": _scales(groups, OUT),
        **({"g_idx": RNG.permutation(g_idx).astype(np.int32)} if act_order else {}),
    }


def _ct(groups=4, act_order=False):
    g_idx = np.arange(IN) // (IN // groups)
    return {
        "weight_packed": _words(OUT, IN // 8),
        "weight_scale": _scales(OUT, groups),
        "weight_zero_point": _words(OUT // 8, groups),
        **({"weight_g_idx": RNG.permutation(g_idx).astype(np.int32)} if act_order else {}),
    }


@functools.partial(jax.jit, static_argnames="method")
def _deq_jit(method, t):
    # Jitted: one compile per shape instead of one per eager op and shape.
    if method == "awq":
        return awq_dequantize(t["qweight"], t["qzeros"], t["scales"])
    if method in ("gptq4", "gptq8"):
        return gptq_dequantize(
            t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"), bits=int(method[-1])
        )
    if method == "compressed-tensors":
        return dequantize_wna16(
            t["weight_packed"],
            t["weight_scale"],
            t["weight_zero_point"],
            t.get("weight_g_idx"),
            bits=4,
        )
    return bitsandbytes_dequantize(t["weight"], t["SCB"])


def _deq(method, t):
    return np.asarray(_deq_jit(method, {k: jnp.asarray(v) for k, v in t.items()}))


# (rules key, dequantization key, layer, out axis of the dequantized weight)
LAYERS = {
    "awq-g64": ("awq", "awq", lambda: _awq(64), 1),
    "awq-one-group": ("awq", "awq", lambda: _awq(IN), 1),
    "gptq4": ("gptq", "gptq4", lambda: _gptq(4), 1),
    "gptq8-act-order": ("gptq", "gptq8", lambda: _gptq(8, act_order=True), 1),
    "gptq4-group-minus-one": ("gptq", "gptq4", lambda: _gptq(4, groups=1), 1),
    "ct-asym-g64": ("compressed-tensors", "compressed-tensors", lambda: _ct(4), 0),
    "ct-act-order": ("compressed-tensors", "compressed-tensors", lambda: _ct(4, True), 0),
    "ct-channel": ("compressed-tensors", "compressed-tensors", lambda: _ct(1), 0),
    "bnb": (
        "bitsandbytes",
        "bnb",
        lambda: {"weight": RNG.integers(-127, 128, (OUT, IN)).astype(np.int8), "SCB": _scales(OUT)},
        0,
    ),
}


@pytest.mark.parametrize("name", sorted(LAYERS))
@pytest.mark.parametrize("parallel", ["column", "row"])
def test_shards_dequantize_to_their_block(name, parallel):
    method, deq, make, out_axis = LAYERS[name]
    layer = make()
    full = _deq(deq, layer)
    split_axis = out_axis if parallel == "column" else 1 - out_axis
    step = full.shape[split_axis] // TP
    for rank in range(TP):
        shard = shard_layer(method, layer, parallel, TP, rank)
        expected = np.take(full, np.arange(rank * step, (rank + 1) * step), axis=split_axis)
        np.testing.assert_array_equal(_deq(deq, shard), expected)


def test_act_order_row_split_replicates_group_tensors_and_splits_g_idx():
    layer = _gptq(4, act_order=True)
    shard = shard_layer("gptq", layer, "row", TP, 1)
    assert shard["scales"] is layer["scales"] and shard["qzeros"] is layer["qzeros"]
    np.testing.assert_array_equal(shard["g_idx"], layer["g_idx"][IN // TP : 2 * IN // TP])
    assert shard["qweight"].shape == (IN // 8 // TP, OUT)
    shard = shard_layer("gptq", layer, "column", TP, 1)
    assert shard["g_idx"] is layer["g_idx"] and shard["scales"].shape == (4, OUT // TP)


def test_w8a8_scales_split_with_output_rows_only():
    assert tp_split_axis("compressed-tensors", "weight_scale", "column", (OUT,)) == 0
    assert tp_split_axis("compressed-tensors", "weight_scale", "row", (OUT,)) is None
    assert tp_split_axis("compressed-tensors", "weight_scale", "column", (1,)) is None
    assert tp_split_axis("fp8", "weight", "row", (OUT, IN)) == 1
    assert tp_split_axis("fp8", "weight_scale", "column", (1,)) is None
    assert tp_split_axis("fp8", "weight_scale", "column", (OUT,)) == 0  # fused q/k/v scales
    # A weight is never taken for a broadcast scale, even with a one-word axis.
    assert tp_split_axis("awq", "qweight", "column", (IN, 1)) == 1
    assert tp_split_axis("compressed-tensors", "input_scale", "row", (1,)) is None


def test_every_rule_names_known_axes():
    for method, rules in TP_SPLIT_AXES.items():
        for name, axes in rules.items():
            assert all(a in (None, 0, 1) for a in axes), (method, name, axes)


def test_split_that_would_cut_packed_words_names_the_tensor():
    layer = {"qweight": _words(IN, 3), "qzeros": _words(4, 3), "scales": _scales(4, 24)}
    with pytest.raises(
        ValueError,
        match=r"down_proj\.qweight of shape \(128, 3\) cannot be "
        r"split column-parallel over tensor_parallel_size=2",
    ):
        shard_layer("awq", layer, "column", 2, 0, prefix="down_proj")
    with pytest.raises(ValueError, match="parallel must be 'column' or 'row'"):
        tp_split_axis("awq", "qweight", "vocab", (1, 1))
    with pytest.raises(ValueError, match="row-parallel layer cannot hold a sorted act-order"):
        tp_split_axis("gptq", "perm", "row", (IN,))
    assert tp_split_axis("gptq", "perm", "column", (IN,)) is None
    with pytest.raises(ValueError, match="no tensor-parallel rule for awq tensor 'g_idx'"):
        tp_split_axis("awq", "g_idx", "row", (8,))
