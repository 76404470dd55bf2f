"""AWQ: unpacking equals AutoAWQ's own dequantization bit for bit; the linear matches float32."""

from __future__ import annotations

import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from models.quantization.awq import (
    AWQ_PACK_ORDER,
    awq_dequantize,
    awq_linear,
    awq_unpack,
    load_awq_layer,
)
from models.quantization.config import AWQConfig

FIXTURE = pathlib.Path(__file__).resolve().parents[2] / "data" / "quantization" / "awq_gemm.npz"


def _pack_awq(values: np.ndarray) -> np.ndarray:
    """``[rows, cols]`` 4-bit ints -> ``i32[rows, cols / 8]``, AutoAWQ's layout.

    Independent of the code under test; the bit layout is read from AutoAWQ
    ``awq/modules/linear/gemm.py``, ``WQLinear_GEMM.from_linear``: slot ``i`` (bits ``4i``) of
    word ``w`` holds column ``8w + order_map[i]``, ``order_map = [0, 2, 4, 6, 1, 3, 5, 7]``.
    """
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    packed = np.zeros((values.shape[0], values.shape[1] // 8), np.uint32)
    for word in range(packed.shape[1]):
        for slot in range(8):
            column = values[:, 8 * word + order_map[slot]].astype(np.uint32)
            packed[:, word] |= column << np.uint32(4 * slot)
    return packed.view(np.int32)


@pytest.mark.parametrize("group_size", [32, 128])
def test_dequantize_equals_autoawq_bit_for_bit(group_size):
    d = np.load(FIXTURE)
    qweight, qzeros, scales = (d[f"g{group_size}_{k}"] for k in ("qweight", "qzeros", "scales"))
    ours = np.asarray(
        awq_dequantize(jnp.asarray(qweight), jnp.asarray(qzeros), jnp.asarray(scales))
    )
    assert ours.dtype == np.float16
    np.testing.assert_array_equal(ours.view(np.uint16), d[f"g{group_size}_dequant"].view(np.uint16))
    # AutoAWQ's fake-quantized weight (what it calibrated against) is the same numbers up to
    # its own fp16 op order: one rounding of (q - z) * s either way, so within one fp16 ulp.
    np.testing.assert_allclose(ours, d[f"g{group_size}_fake_quant"].T, rtol=2**-10, atol=0)


def test_awq_pack_order_is_autoawqs():
    assert AWQ_PACK_ORDER == (0, 2, 4, 6, 1, 3, 5, 7)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_unpack_recovers_every_value_and_zero(group_size):
    rng = np.random.default_rng(group_size)
    in_features, out_features = 128, 48
    values = rng.integers(0, 16, (in_features, out_features))
    zeros = rng.integers(0, 16, (in_features // group_size, out_features))
    q, z = awq_unpack(jnp.asarray(_pack_awq(values)), jnp.asarray(_pack_awq(zeros)))
    np.testing.assert_array_equal(np.asarray(q), values)
    np.testing.assert_array_equal(np.asarray(z), zeros)


@pytest.mark.parametrize("group_size", [32, 128])
def test_linear_matches_float32_reference(group_size):
    rng = np.random.default_rng(1)
    in_features, out_features = 128, 32
    values = rng.integers(0, 16, (in_features, out_features))
    zeros = rng.integers(0, 16, (in_features // group_size, out_features))
    scales = rng.uniform(0.01, 0.1, zeros.shape).astype(np.float32)
    weight = (values - np.repeat(zeros, group_size, 0)) * np.repeat(scales, group_size, 0)
    x = rng.standard_normal((5, in_features)).astype(np.float32)
    y = awq_linear(
        jnp.asarray(x),
        jnp.asarray(_pack_awq(values)),
        jnp.asarray(_pack_awq(zeros)),
        jnp.asarray(scales),
    )
    expected = x.astype(np.float64) @ weight.astype(np.float64)
    assert y.shape == (5, out_features) and y.dtype == jnp.float32
    np.testing.assert_allclose(
        np.asarray(y), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max()
    )


def _stored(in_features=128, out_features=32, groups=4):
    return {
        "qweight": np.zeros((in_features, out_features // 8), np.int32),
        "qzeros": np.zeros((groups, out_features // 8), np.int32),
        "scales": np.ones((groups, out_features), np.float16),
    }


def test_load_checks_shapes_and_names_the_tensor():
    config = AWQConfig(4, 32, True)
    assert set(load_awq_layer("m.q_proj", _stored(), 128, 32, config)) == {
        "qweight",
        "qzeros",
        "scales",
    }
    bad = _stored()
    bad["qweight"] = np.zeros((128, 8), np.int32)
    with pytest.raises(ValueError, match=r"m\.q_proj\.qweight has shape \(128, 8\)"):
        load_awq_layer("m.q_proj", bad, 128, 32, config)
    missing = _stored()
    del missing["scales"]
    with pytest.raises(ValueError, match=r"m\.q_proj\.scales is missing"):
        load_awq_layer("m.q_proj", missing, 128, 32, config)
    wrong_dtype = _stored()
    wrong_dtype["qzeros"] = wrong_dtype["qzeros"].astype(np.int64)
    with pytest.raises(ValueError, match=r"m\.q_proj\.qzeros has dtype int64"):
        load_awq_layer("m.q_proj", wrong_dtype, 128, 32, config)
    with pytest.raises(ValueError, match="group_size"):
        load_awq_layer("m.q_proj", _stored(), 100, 32, config)


def test_bfloat16_weight_is_the_exact_product_rounded_once():
    """float16 scales into a bfloat16 compute dtype: no intermediate rounding of the scale."""
    d = np.load(FIXTURE)
    args = [jnp.asarray(d[f"g32_{k}"]) for k in ("qweight", "qzeros", "scales")]
    bf16 = np.asarray(awq_dequantize(*args, dtype=jnp.bfloat16))
    exact = np.asarray(awq_dequantize(*args, dtype=jnp.float32))  # exact in float32
    np.testing.assert_array_equal(bf16, exact.astype(jnp.bfloat16))
