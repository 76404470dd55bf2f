"""The weight-only GEMV policy (``models.quantization.w8a8.W8_GEMV_MAX_TOKENS``) forced on the
CPU, where the Pallas kernel runs interpreted: which layers take it, and stories260k end to end.

The kernel path is weight-only (activations unquantized), so its numbers are not W8A8's: the
end-to-end check compares it with the same model run through a plain-JAX weight-only path
(``w8_gemv_reference`` in the kernel's place), which it must equal, and with the default W8A8
path only by agreement with golden.json's float32 greedy continuations (weight-only drops the
activation rounding, so it must agree at least as well).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models.quantization.w8a8 as w8a8
from models.quantization.bitsandbytes import bitsandbytes_linear
from models.quantization.config import resolve_quantization
from models.weights import load_model
from pallas_kernels.w8_gemv import w8_gemv_reference
from tests.models.conftest import STORIES_DIR
from tests.models.quantization.quality import GOLDEN, greedy, make_runner

NUM_NEW = 16


@pytest.fixture
def forced(monkeypatch):
    """The policy on for steps of up to 64 tokens on the CPU; compilation caches cleared before
    and after (the policy is read while tracing)."""
    assert not w8a8.use_w8_gemv(1)  # off by default
    jax.clear_caches()
    monkeypatch.setattr(w8a8, "W8_GEMV_MAX_TOKENS", 64)
    monkeypatch.setattr(w8a8, "W8_GEMV_PLATFORMS", (jax.default_backend(),))
    yield monkeypatch
    jax.clear_caches()


def _plain_jax_weight_only(monkeypatch):
    monkeypatch.setattr(w8a8, "w8_gemv", lambda x, w, s, interpret: w8_gemv_reference(x, w, s))


def test_int8_layers_take_the_kernel_up_to_the_threshold(forced):
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.integers(-127, 128, (40, 96)), jnp.int8)
    scale = jnp.asarray(rng.uniform(1e-3, 2e-3, 40), jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 3, 96)), jnp.float32)  # [..., in]: 6 tokens
    expected = w8_gemv_reference(x.reshape(6, 96), w, scale).reshape(2, 3, 40)
    np.testing.assert_allclose(w8a8.w8a8_linear(x, w, scale), expected, rtol=1e-5, atol=1e-6)
    scb = scale * 127.0  # bitsandbytes' row absmax: the same weights
    np.testing.assert_allclose(bitsandbytes_linear(x, w, scb), expected, rtol=1e-5, atol=1e-6)
    forced.setattr(w8a8, "W8_GEMV_MAX_TOKENS", 5)  # 6 tokens: W8A8 again (x quantized)
    assert np.abs(np.asarray(w8a8.w8a8_linear(x, w, scale) - expected)).max() > 1e-4


def _stories_fp8(prompts):
    jax.clear_caches()
    model, config = load_model(
        STORIES_DIR, dtype="float32", quant_config=resolve_quantization("fp8", None)
    )
    seqs = greedy(make_runner(model, config, 64, len(prompts)), prompts, NUM_NEW)
    tokens = [s.tokens[len(p) :] + [s.next_token] for s, p in zip(seqs, prompts, strict=True)]
    return tokens, [np.stack(s.logits) for s in seqs]


def test_stories260k_fp8_through_the_kernel(forced):
    with open(GOLDEN) as f:
        cases = json.load(f)["cases"]
    prompts = [case["prompt_ids"] for case in cases]
    golden = [case["greedy_new_ids"][:NUM_NEW] for case in cases]
    kernel_tokens, kernel_logits = _stories_fp8(prompts)
    with pytest.MonkeyPatch.context() as mp:
        _plain_jax_weight_only(mp)
        ref_tokens, ref_logits = _stories_fp8(prompts)
    forced.setattr(w8a8, "W8_GEMV_MAX_TOKENS", 0)
    w8a8_tokens, _ = _stories_fp8(prompts)
    assert kernel_tokens == ref_tokens
    for got, ref in zip(kernel_logits, ref_logits, strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())

    def agreement(tokens):
        return np.mean([np.equal(t, g).mean() for t, g in zip(tokens, golden, strict=True)])

    assert agreement(kernel_tokens) >= agreement(w8a8_tokens), (kernel_tokens, w8a8_tokens)
