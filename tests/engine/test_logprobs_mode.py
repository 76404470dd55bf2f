"""logprobs_mode (vLLM's --logprobs-mode): rollout logprobs against a training forward pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.model_api import make_forward
from tests.conftest import SMALL_ENGINE

PROMPTS = ["Once upon a time", "The little dog", "Lily wanted to"]
TEMPERATURE, TOP_K = 0.8, 20


def _rollouts(llm, mode=None, n=24):
    params = SamplingParams(
        temperature=TEMPERATURE, top_k=TOP_K, max_tokens=n, seed=7, logprobs=0, ignore_eos=True
    )
    if mode is not None:
        params.logprobs_mode = mode
    return llm.generate(PROMPTS, params, use_tqdm=False)


def _forward_logits(llm, output) -> tuple[np.ndarray, list[int]]:
    """f32[new, vocab]: the training forward's logits before each sampled token."""
    new = list(output.outputs[0].token_ids)
    ids = jnp.asarray([output.prompt_token_ids + new])
    logits = make_forward(llm)(llm.get_weights(), ids)[0]
    start = len(output.prompt_token_ids) - 1
    return np.asarray(logits[start : start + len(new)]), new


def _reported(output) -> np.ndarray:
    steps, new = output.outputs[0].logprobs, output.outputs[0].token_ids
    return np.array([step[t].logprob for step, t in zip(steps, new, strict=True)])


def test_raw_logprobs_equal_a_training_forward_pass(stories_llm):
    """The default mode: what a trainer's importance ratio needs, float32 log-softmax of the
    model's logits before temperature and top-k (1e-5: float32 rounding of two attention
    orders, incremental paged decode vs one dense prefill)."""
    for output in _rollouts(stories_llm):
        logits, new = _forward_logits(stories_llm, output)
        want = np.asarray(jax.nn.log_softmax(logits, -1))[np.arange(len(new)), new]
        np.testing.assert_allclose(_reported(output), want, atol=1e-5, rtol=0)
        assert output.outputs[0].cumulative_logprob == pytest.approx(want.sum(), abs=1e-4)


def test_processed_and_logit_modes(stories_llm):
    for mode in ("raw_logits", "processed_logprobs", "processed_logits"):
        for output in _rollouts(stories_llm, mode):
            logits, new = _forward_logits(stories_llm, output)
            values = logits
            if mode.startswith("processed"):
                scaled = logits / TEMPERATURE
                kth = np.sort(scaled, -1)[:, -TOP_K][:, None]
                values = np.where(scaled >= kth, scaled, -np.inf)
            if mode.endswith("logprobs"):
                values = np.asarray(jax.nn.log_softmax(values, -1))
            want = values[np.arange(len(new)), new]
            np.testing.assert_allclose(_reported(output), want, atol=1e-4, rtol=0, err_msg=mode)


def test_the_engine_mode_is_the_default_of_requests_that_do_not_choose():
    llm = LLM(dtype="float32", logprobs_mode="raw_logits", **SMALL_ENGINE)
    default = _rollouts(llm, n=4)[0]
    logits, new = _forward_logits(llm, default)
    np.testing.assert_allclose(_reported(default), logits[np.arange(len(new)), new], atol=1e-4)
    chosen = _rollouts(llm, "raw_logprobs", n=4)[0]
    assert np.all(_reported(chosen) <= 0)  # log-probabilities, not logits
    with pytest.raises(ValueError, match="logprobs_mode"):
        LLM(logprobs_mode="logits")
