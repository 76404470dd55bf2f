"""bitsandbytes 8-bit: quantization at load and dequantization equal bitsandbytes' own output
(``tests/data/quantization/bnb_int8.npz``, made by ``make_bnb_fixture.py`` with
``int8_vectorwise_quant`` / ``int8_vectorwise_dequant``); the linear is the dequantized
weight's matmul."""

from __future__ import annotations

import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from models.quantization.bitsandbytes import (
    bitsandbytes_dequantize,
    bitsandbytes_linear,
    load_bitsandbytes_layer,
    quantize_weight_int8_rowwise,
)
from models.quantization.config import BitsAndBytesConfig

FIXTURE = pathlib.Path(__file__).resolve().parents[2] / "data" / "quantization" / "bnb_int8.npz"


@pytest.fixture(scope="module")
def bnb():
    return np.load(FIXTURE)


def test_quantize_at_load_equals_bitsandbytes(bnb):
    out = load_bitsandbytes_layer(
        "m.o_proj", {"weight": bnb["weight"]}, 64, 32, BitsAndBytesConfig(is_prequantized=False)
    )
    np.testing.assert_array_equal(out["weight"], bnb["CB"])
    np.testing.assert_array_equal(out["SCB"], bnb["SCB"])
    assert out["weight"].dtype == np.int8 and out["SCB"].dtype == np.float32


def test_dequantize_equals_bitsandbytes_bit_for_bit(bnb):
    ours = np.asarray(bitsandbytes_dequantize(jnp.asarray(bnb["CB"]), jnp.asarray(bnb["SCB"])))
    np.testing.assert_array_equal(ours.view(np.uint32), bnb["dequant"].view(np.uint32))
    # Each weight within half a step (SCB / 254) of the original, plus float32 rounding of the
    # two multiplies (a relative 2 ** -23 each, i.e. about 1e-5 of the step at most).
    err = np.abs(ours - bnb["weight"].astype(np.float32))
    assert np.all(err <= bnb["SCB"][:, None] / 254 * (1 + 1e-5))


def test_prequantized_checkpoint_loads_as_stored_and_checks(bnb):
    config = BitsAndBytesConfig(is_prequantized=True)
    out = load_bitsandbytes_layer(
        "m.o_proj", {"weight": bnb["CB"], "SCB": bnb["SCB"]}, 64, 32, config
    )
    np.testing.assert_array_equal(out["weight"], bnb["CB"])
    with pytest.raises(ValueError, match=r"m\.o_proj\.SCB is missing"):
        load_bitsandbytes_layer("m.o_proj", {"weight": bnb["CB"]}, 64, 32, config)
    with pytest.raises(
        ValueError, match=r"m\.o_proj\.weight has dtype float16; expected one of int8"
    ):
        load_bitsandbytes_layer(
            "m.o_proj", {"weight": bnb["weight"], "SCB": bnb["SCB"]}, 64, 32, config
        )


def test_linear_matches_dequantized_float32_weight(bnb):
    x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    y = bitsandbytes_linear(jnp.asarray(x), jnp.asarray(bnb["CB"]), jnp.asarray(bnb["SCB"]))
    reference = x.astype(np.float64) @ bnb["dequant"].astype(np.float64).T
    np.testing.assert_allclose(
        np.asarray(y), reference, rtol=1e-4, atol=1e-4 * np.abs(reference).max()
    )
    assert np.all(np.asarray(y)[:, 3] == 0)  # the all-zero row stays zero


def test_rowwise_quantization_of_a_zero_matrix_is_finite():
    out = quantize_weight_int8_rowwise(np.zeros((4, 8), np.float32))
    assert not out["weight"].any() and not out["SCB"].any()
