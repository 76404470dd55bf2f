"""GPTQ: unpacking and dequantization against the gptqmodel/AutoGPTQ layout; the linear."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from models.quantization.config import GPTQConfig
from models.quantization.gptq import (
    gptq_dequantize,
    gptq_linear,
    gptq_sort_act_order,
    gptq_unpack,
    load_gptq_layer,
)
from models.quantization.packing import pack_int32, unpack_int32

IN, OUT = 128, 64


def _pack_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """``[in, out]`` -> ``i32[in / pack, out]``: gptqmodel ``nn_modules/qlinear/__init__.py``,
    ``BaseQuantLinear.pack_original`` (bits 2/4/8 branch): ``qweight[row] |= w[row * pack + j]
    << (bits * j)``."""
    pack = 32 // bits
    packed = np.zeros((values.shape[0] // pack, values.shape[1]), np.uint32)
    for row in range(packed.shape[0]):
        for j in range(pack):
            packed[row] |= values[row * pack + j].astype(np.uint32) << np.uint32(bits * j)
    return packed.view(np.int32)


def _pack_cols(values: np.ndarray, bits: int) -> np.ndarray:
    """``[G, out]`` -> ``i32[G, out / pack]``, the same function's ``qzeros`` loop."""
    pack = 32 // bits
    packed = np.zeros((values.shape[0], values.shape[1] // pack), np.uint32)
    for col in range(packed.shape[1]):
        for j in range(pack):
            packed[:, col] |= values[:, col * pack + j].astype(np.uint32) << np.uint32(bits * j)
    return packed.view(np.int32)


def _checkpoint(bits, group_size, desc_act, sym, checkpoint_format, seed=0):
    """A GPTQ layer's stored tensors and its reference dequantized weight (float16).

    The reference is gptqmodel's ``_dequantize_from_codes``: ``scales[g_idx] * (weight -
    zeros[g_idx])``, one float16 rounding. v1 (``gptq``) stores ``zero - 1``
    (``convert_gptq_v2_to_v1_format``); zero points are drawn from ``[1, 2 ** bits)`` there so
    the word-wise subtraction the tool does never borrows.
    """
    rng = np.random.default_rng(seed)
    maxq = 2**bits - 1
    groups = 1 if group_size == -1 else IN // group_size
    values = rng.integers(0, maxq + 1, (IN, OUT))
    if sym:
        zeros = np.full((groups, OUT), 2 ** (bits - 1))
    else:
        zeros = rng.integers(1 if checkpoint_format == "gptq" else 0, maxq + 1, (groups, OUT))
    scales = rng.uniform(0.001, 0.05, (groups, OUT)).astype(np.float16)
    g_idx = np.arange(IN) // (IN // groups)
    if desc_act:
        g_idx = rng.permutation(g_idx)  # act-order: rows of a group are scattered
    stored_zeros = zeros - 1 if checkpoint_format == "gptq" else zeros
    tensors = {
        "qweight": _pack_rows(values, bits),
        "qzeros": _pack_cols(stored_zeros, bits),
        "scales": scales,
        "g_idx": g_idx.astype(np.int32),
    }
    reference = scales[g_idx] * (values - zeros[g_idx]).astype(np.float16)
    return tensors, values, zeros, reference


CASES = [
    # bits, group_size, desc_act, sym, checkpoint_format
    (4, 32, False, True, "gptq"),
    (4, 32, False, False, "gptq"),
    (4, -1, False, True, "gptq"),
    (4, 32, True, False, "gptq"),
    (8, 64, False, True, "gptq"),
    (8, 32, True, False, "gptq"),
    (4, 64, False, False, "gptq_v2"),
]


@pytest.mark.parametrize("bits,group_size,desc_act,sym,checkpoint_format", CASES)
def test_dequantize_bit_for_bit(bits, group_size, desc_act, sym, checkpoint_format):
    config = GPTQConfig(bits, group_size, desc_act, sym, checkpoint_format=checkpoint_format)
    tensors, values, zeros, reference = _checkpoint(
        bits, group_size, desc_act, sym, checkpoint_format
    )
    loaded = load_gptq_layer("m.down_proj", tensors, IN, OUT, config)
    assert ("g_idx" in loaded) == desc_act
    q, z = gptq_unpack(
        jnp.asarray(loaded["qweight"]), jnp.asarray(loaded["qzeros"]), bits, checkpoint_format
    )
    np.testing.assert_array_equal(np.asarray(q), values)
    np.testing.assert_array_equal(np.asarray(z), zeros)
    w = gptq_dequantize(
        *(jnp.asarray(loaded[k]) for k in ("qweight", "qzeros", "scales")),
        None if not desc_act else jnp.asarray(loaded["g_idx"]),
        bits=bits,
        checkpoint_format=checkpoint_format,
    )
    assert w.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(w).view(np.uint16), reference.view(np.uint16))


@pytest.mark.parametrize("bits,group_size,desc_act", [(4, 32, True), (8, -1, False)])
def test_linear_matches_float32_reference(bits, group_size, desc_act):
    tensors, _, _, reference = _checkpoint(bits, group_size, desc_act, False, "gptq", seed=3)
    scales = tensors["scales"].astype(np.float32)
    x = np.random.default_rng(4).standard_normal((3, IN)).astype(np.float32)
    y = gptq_linear(
        jnp.asarray(x),
        jnp.asarray(tensors["qweight"]),
        jnp.asarray(tensors["qzeros"]),
        jnp.asarray(scales),
        jnp.asarray(tensors["g_idx"]) if desc_act else None,
        bits=bits,
    )
    # The float32 weight: same integers, scales exactly the float16 ones widened.
    g_idx = tensors["g_idx"]
    q = np.asarray(
        gptq_unpack(jnp.asarray(tensors["qweight"]), jnp.asarray(tensors["qzeros"]), bits)[0]
    )
    z = np.asarray(
        gptq_unpack(jnp.asarray(tensors["qweight"]), jnp.asarray(tensors["qzeros"]), bits)[1]
    )
    weight = (q - z[g_idx]).astype(np.float64) * scales[g_idx]
    np.testing.assert_allclose(weight, reference.astype(np.float64), rtol=2**-10)
    expected = x.astype(np.float64) @ weight
    assert y.shape == (3, OUT) and y.dtype == jnp.float32
    np.testing.assert_allclose(
        np.asarray(y), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max()
    )


def test_load_errors_name_the_tensor():
    config = GPTQConfig(4, 32, True, True)
    tensors, *_ = _checkpoint(4, 32, True, True, "gptq")
    missing = dict(tensors)
    del missing["g_idx"]
    with pytest.raises(ValueError, match=r"m\.o_proj\.g_idx is missing"):
        load_gptq_layer("m.o_proj", missing, IN, OUT, config)
    bad = dict(tensors, g_idx=np.full(IN, 9, np.int32))
    with pytest.raises(ValueError, match=r"m\.o_proj\.g_idx must hold group ids in \[0, 4\)"):
        load_gptq_layer("m.o_proj", bad, IN, OUT, config)
    bad = dict(tensors, qweight=np.zeros((IN // 4, OUT), np.int32))  # packed as 8-bit
    with pytest.raises(
        ValueError, match=r"m\.o_proj\.qweight has shape \(32, 64\); expected \(16, 64\)"
    ):
        load_gptq_layer("m.o_proj", bad, IN, OUT, config)
    permuted = dict(tensors)  # an act-order g_idx while the config says desc_act: false
    with pytest.raises(ValueError, match=r"m\.o_proj\.g_idx is not the blocked"):
        load_gptq_layer("m.o_proj", permuted, IN, OUT, GPTQConfig(4, 32, False, True))
    missing = dict(tensors)
    del missing["scales"]
    with pytest.raises(ValueError, match=r"m\.o_proj\.scales is missing"):
        load_gptq_layer("m.o_proj", missing, IN, OUT, config)


@pytest.mark.parametrize("bits", [4, 8])
def test_sorted_act_order_equals_the_g_idx_form(bits):
    """vLLM/exllama's shuffle: rows sorted by group, ``x`` permuted instead of the scales
    gathered. The sorted weight is the gathered one's rows in ``perm`` order, bit for bit."""
    config = GPTQConfig(bits, 32, desc_act=True, sym=False)
    tensors, *_ = _checkpoint(bits, 32, True, False, "gptq", seed=5)
    loaded = load_gptq_layer("m.up_proj", tensors, IN, OUT, config)
    sorted_ = gptq_sort_act_order(loaded, bits)
    assert "g_idx" not in sorted_ and sorted_["perm"].dtype == np.int32
    j, s = ({k: jnp.asarray(v) for k, v in t.items()} for t in (loaded, sorted_))
    gathered = np.asarray(
        gptq_dequantize(j["qweight"], j["qzeros"], j["scales"], j["g_idx"], bits=bits)
    )
    blocked = np.asarray(gptq_dequantize(s["qweight"], s["qzeros"], s["scales"], bits=bits))
    np.testing.assert_array_equal(
        blocked.view(np.uint16), gathered[sorted_["perm"]].view(np.uint16)
    )
    x = jnp.asarray(np.random.default_rng(6).standard_normal((3, IN)), jnp.float32)
    y_sorted = gptq_linear(
        x, s["qweight"], s["qzeros"], s["scales"].astype(jnp.float32), bits=bits, perm=s["perm"]
    )
    y_gidx = gptq_linear(
        x, j["qweight"], j["qzeros"], j["scales"].astype(jnp.float32), j["g_idx"], bits=bits
    )
    np.testing.assert_allclose(np.asarray(y_sorted), np.asarray(y_gidx), rtol=1e-5, atol=1e-5)


def test_sorting_needs_equal_groups():
    tensors, *_ = _checkpoint(4, 32, True, False, "gptq")
    bad = dict(tensors, g_idx=np.sort(tensors["g_idx"])[::-1].copy())
    bad["g_idx"][0] = 0  # group 0 now one row too many
    with pytest.raises(ValueError, match=r"m\.g_idx does not give every one of its 4 groups"):
        gptq_sort_act_order(bad, 4, prefix="m")


@pytest.mark.parametrize("bits,axis", [(4, 0), (4, 1), (8, 0), (8, 1)])
def test_pack_int32_inverts_unpack_and_matches_the_gptq_layout(bits, axis):
    values = np.random.default_rng(bits + axis).integers(0, 2**bits, (64, 32))
    packed = pack_int32(values, bits, axis)
    np.testing.assert_array_equal(np.asarray(unpack_int32(jnp.asarray(packed), bits, axis)), values)
    reference = _pack_rows(values, bits) if axis == 0 else _pack_cols(values, bits)
    np.testing.assert_array_equal(packed, reference)
