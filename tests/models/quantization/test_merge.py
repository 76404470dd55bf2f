"""Fused q/k/v (gate/up) quantized layers: the fused tensors dequantize to the parts' columns in
``models.merged_linear``'s shard-major order, and the fused matmul equals the parts'."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.merged_linear import merged_column_order
from models.quantization.awq import awq_dequantize
from models.quantization.fp8 import fp8_linear, quantize_weight_fp8
from models.quantization.gptq import gptq_dequantize
from models.quantization.merge import merge_column_parts
from models.quantization.w8a8 import w8a8_linear

IN = 64
SIZES = (64, 16, 16)  # q, k, v output sizes (Hq * D, Hkv * D, Hkv * D)
RNG = np.random.default_rng(0)


def _words(*shape):
    return RNG.integers(-(2**31), 2**31, shape, dtype=np.int64).astype(np.int32)


@functools.partial(jax.jit, static_argnames="method")
def _deq(method, t):
    if method == "awq":
        return awq_dequantize(t["qweight"], t["qzeros"], t["scales"])
    return gptq_dequantize(t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"), bits=4)


def _np_deq(method, t):
    return np.asarray(_deq(method, {k: jnp.asarray(v) for k, v in t.items()}))


@pytest.mark.parametrize("num_shards", [1, 2])
@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_fused_packed_layer_dequantizes_to_the_merged_column_order(method, num_shards):
    g_idx = RNG.permutation(np.arange(IN) // 32).astype(np.int32)
    parts = []
    for size in SIZES:
        if method == "awq":
            parts.append(
                {
                    "qweight": _words(IN, size // 8),
                    "qzeros": _words(2, size // 8),
                    "scales": RNG.uniform(0.01, 0.1, (2, size)).astype(np.float32),
                }
            )
        else:
            parts.append(
                {
                    "qweight": _words(IN // 8, size),
                    "qzeros": _words(2, size // 8),
                    "scales": RNG.uniform(0.01, 0.1, (2, size)).astype(np.float32),
                    "g_idx": g_idx,
                }
            )
    merged = merge_column_parts(method, parts, SIZES, num_shards)
    whole = np.concatenate([_np_deq(method, p) for p in parts], axis=1)
    np.testing.assert_array_equal(
        _np_deq(method, merged), whole[:, merged_column_order(SIZES, num_shards)]
    )


def test_per_tensor_fp8_scales_become_per_channel_and_input_scale_the_max():
    weights = [
        RNG.standard_normal((size, IN)).astype(np.float32) * (i + 1) for i, size in enumerate(SIZES)
    ]
    parts = [
        dict(quantize_weight_fp8(w), input_scale=np.array([0.1 * (i + 1)], np.float32))
        for i, w in enumerate(weights)
    ]
    merged = merge_column_parts("fp8", parts, SIZES, 2)
    order = merged_column_order(SIZES, 2)
    assert merged["weight_scale"].shape == (sum(SIZES),)
    assert merged["input_scale"].tolist() == [np.float32(0.3)]
    scales = np.concatenate(
        [np.repeat(p["weight_scale"], s) for p, s in zip(parts, SIZES, strict=True)]
    )
    np.testing.assert_array_equal(merged["weight_scale"], scales[order])
    # Dynamic activations: the fused matmul is the parts' matmuls, column for column.
    del merged["input_scale"]
    x = jnp.asarray(RNG.standard_normal((3, IN)), jnp.float32)
    fused = np.asarray(fp8_linear(x, {k: jnp.asarray(v) for k, v in merged.items()}))
    each = np.concatenate(
        [
            np.asarray(w8a8_linear(x, jnp.asarray(p["weight"]), jnp.asarray(p["weight_scale"])))
            for p in parts
        ],
        axis=1,
    )
    np.testing.assert_allclose(fused, each[:, order], rtol=1e-6, atol=1e-6)


def test_parts_that_cannot_be_fused_are_named():
    parts = [
        {"qweight": _words(IN, 1), "qzeros": _words(2, 1), "scales": np.ones((2, 8), np.float32)}
    ] * 2
    with pytest.raises(
        ValueError,
        match=r"qkv_proj\.qweight of shape \(64, 1\) cannot be fused "
        r"for 2 shards",
    ):
        merge_column_parts("awq", parts, (8, 8), 2, prefix="qkv_proj")
    g = np.arange(IN, dtype=np.int32) // 32
    gptq = [
        {
            "qweight": _words(IN // 8, 8),
            "qzeros": _words(2, 1),
            "scales": np.ones((2, 8), np.float32),
            "g_idx": g,
        },
        {
            "qweight": _words(IN // 8, 8),
            "qzeros": _words(2, 1),
            "scales": np.ones((2, 8), np.float32),
            "g_idx": g[::-1].copy(),
        },
    ]
    with pytest.raises(ValueError, match=r"gate_up_proj\.g_idx differs between the fused parts"):
        merge_column_parts("gptq", gptq, (8, 8), 1, prefix="gate_up_proj")
    with pytest.raises(ValueError, match="hold different tensors"):
        merge_column_parts("gptq", [gptq[0], {"qweight": gptq[0]["qweight"]}], (8, 8), 1)
