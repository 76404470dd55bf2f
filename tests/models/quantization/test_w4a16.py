"""Stored AWQ/GPTQ layers repacked for the W4A16 kernel equal ``awq_linear`` / ``gptq_linear``.

The existing linears are the independent reference (they match AutoAWQ / gptqmodel bit for bit,
``test_awq.py`` / ``test_gptq.py``); the kernel runs in interpret mode.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from models.quantization.awq import awq_linear
from models.quantization.gptq import gptq_linear
from models.quantization.w4a16 import repack_awq, repack_gptq, to_w4a16_layout
from pallas_kernels.w4a16_matmul import w4a16_matmul
from tests.pallas_kernels.test_w4a16_matmul import assert_close, random_words


def _awq_stored(rng, in_features, out_features, group_size):
    groups = in_features // group_size
    return {
        "qweight": random_words(rng, (in_features, out_features // 8)),
        "qzeros": random_words(rng, (groups, out_features // 8)),
        "scales": (rng.uniform(0.5, 1.5, (groups, out_features)) * 1e-2).astype(np.float16),
    }


@pytest.mark.parametrize("tokens,group_size", [(1, 32), (17, 64)])
def test_repacked_awq_equals_awq_linear(tokens, group_size):
    rng = np.random.default_rng(group_size)
    stored = _awq_stored(rng, 256, 32, group_size)
    x = jnp.asarray(rng.standard_normal((tokens, 256)), jnp.float32)
    got = w4a16_matmul(x, **repack_awq(**stored), group_size=group_size, interpret=True)
    assert_close(got, awq_linear(x, *map(jnp.asarray, stored.values())), 1e-4)


@pytest.mark.parametrize("checkpoint_format,symmetric", [("gptq", True), ("gptq", False),
                                                         ("gptq_v2", False)])  # fmt: skip
def test_repacked_gptq_equals_gptq_linear(checkpoint_format, symmetric):
    rng = np.random.default_rng(3)
    in_features, out_features, group_size = 256, 32, 128
    groups = in_features // group_size
    if symmetric:  # every zero point 8: v1 stores 7 in each nibble
        qzeros = np.full((groups, out_features // 8), 0x77777777, np.int64).astype(np.int32)
    else:
        qzeros = random_words(rng, (groups, out_features // 8))
    stored = {
        "qweight": random_words(rng, (in_features // 8, out_features)),
        "qzeros": qzeros,
        "scales": (rng.uniform(0.5, 1.5, (groups, out_features)) * 1e-2).astype(np.float16),
    }
    x = jnp.asarray(rng.standard_normal((2, in_features)), jnp.float32)
    kernel = repack_gptq(**stored, checkpoint_format=checkpoint_format)
    if symmetric:
        assert np.all(kernel["zeros"] == 8)
    got = w4a16_matmul(x, **kernel, group_size=group_size, interpret=True)
    want = gptq_linear(x, *map(jnp.asarray, stored.values()), bits=4,
                       checkpoint_format=checkpoint_format)  # fmt: skip
    assert_close(got, want, 1e-4)


def test_repack_gptq_refuses_act_order_and_8_bit():
    stored = {"qweight": np.zeros((32, 32), np.int32), "qzeros": np.zeros((2, 4), np.int32),
              "scales": np.ones((2, 32), np.float16)}  # fmt: skip
    with pytest.raises(ValueError, match="g_idx"):
        repack_gptq(**stored, g_idx=np.zeros(256, np.int32))
    with pytest.raises(ValueError, match="bits=8"):
        repack_gptq(**stored, bits=8)


def test_layout_is_the_documented_planes():
    """Slot j of word [r, o] holds q[j * in / 8 + r, o], read back bit by bit."""
    rng = np.random.default_rng(5)
    q = rng.integers(0, 16, (64, 16))
    packed = to_w4a16_layout(q, np.zeros((1, 16)), np.ones((1, 16)))["qweight"]
    words = packed.view(np.uint32)
    for j in range(8):
        np.testing.assert_array_equal((words >> (4 * j)) & 0xF, q[j * 8 : (j + 1) * 8])
    with pytest.raises(ValueError, match="in_features"):
        to_w4a16_layout(q[:60], np.zeros((1, 16)), np.ones((1, 16)))
