"""Penalties, logit bias, allowed ids and min_tokens suppression against numpy references."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.sample.logits_state import LogitsState
from jaxpaged.sample.metadata import SamplerVariant
from jaxpaged.sample.penalties import apply_logits_state, apply_penalties
from jaxpaged.sample.sampler import sample
from tests.sample.conftest import make_metadata

# The whole sampler: every optional stage compiled in (rows that do not use one are neutral).
ALL_STAGES = SamplerVariant(uses_state=True, filters=True, logprobs=True)

B, V = 6, 512
NEUTRAL = B  # the state has B request slots plus the neutral row


def numpy_penalties(logits, counts, prompt_mask, presence, frequency, repetition):
    """OpenAI presence/frequency on generated tokens; HF repetition on prompt + generated."""
    out = logits.astype(np.float64).copy()
    for b in range(out.shape[0]):
        for v in range(out.shape[1]):
            if prompt_mask[b, v] or counts[b, v] > 0:
                if out[b, v] > 0:
                    out[b, v] /= repetition[b]
                else:
                    out[b, v] *= repetition[b]
            out[b, v] -= frequency[b] * counts[b, v] + presence[b] * (counts[b, v] > 0)
    return out


def _random_rows(seed):
    rng = np.random.default_rng(seed)
    rows = dict(
        logits=rng.normal(0, 3, (B, V)).astype(np.float32),
        counts=(rng.integers(1, 4, (B, V)) * (rng.random((B, V)) < 0.05)).astype(np.int32),
        prompt_mask=rng.random((B, V)) < 0.05,
        presence=rng.uniform(-2, 2, B).astype(np.float32),
        frequency=rng.uniform(-2, 2, B).astype(np.float32),
        repetition=rng.uniform(0.5, 2, B).astype(np.float32),
    )
    return rng, rows


def test_penalties_match_numpy_reference():
    _, r = _random_rows(0)
    r["presence"][0], r["frequency"][0], r["repetition"][0] = 0.0, 0.0, 1.0  # a neutral row
    args = (r["counts"], r["prompt_mask"], r["presence"], r["frequency"], r["repetition"])
    got = np.asarray(apply_penalties(jnp.asarray(r["logits"]), *args))
    np.testing.assert_allclose(got, numpy_penalties(r["logits"], *args), rtol=1e-5, atol=1e-5)
    # Neutral parameters leave the logits bit-identical.
    np.testing.assert_array_equal(got[0], r["logits"][0])


def _state_case(seed=1):
    """Rows with logit_bias, allowed ids, min_tokens suppression and penalties, placed in a
    LogitsState at shuffled slots (the last row uses the neutral slot), and the numpy result of
    vLLM's order: allowed mask and bias, min_tokens, then penalties."""
    rng, r = _random_rows(seed)
    bias = np.zeros((B, V), np.float32)
    stop = np.zeros((B, V), bool)
    bias[1, rng.integers(0, V, 20)] = rng.uniform(-100, 100, 20)  # logit_bias
    bias[2] = -np.inf
    bias[2, [5, 17, 300]] = [0.0, 2.5, 0.0]  # allowed_token_ids, one of them biased
    stop[3, [2, 40]] = True  # EOS and a stop token id, suppressed (min_tokens not reached)
    stop[4, [2]] = True  # not suppressed any more
    suppress = np.array([0, 0, 0, 1, 0, 0], np.int32)
    slots = np.array([4, 1, 2, 3, 0, NEUTRAL], np.int32)
    last = B - 1  # uses the neutral slot: no counts or prompt of its own, logits unchanged
    r["counts"][last], r["prompt_mask"][last] = 0, False

    def by_slot(rows):
        out = np.zeros((B + 1, V), rows.dtype)
        out[slots[:last]] = rows[:last]
        return jnp.asarray(out)

    state = LogitsState(
        by_slot(r["counts"]),
        by_slot(r["prompt_mask"]),
        by_slot(stop),
        by_slot(bias),
        jnp.full((B + 1, 1), -1, jnp.int32),  # no logprob_token_ids
    )
    processed = r["logits"] + bias
    processed[(suppress[:, None] != 0) & stop] = -np.inf
    want = numpy_penalties(
        processed, r["counts"], r["prompt_mask"], r["presence"], r["frequency"], r["repetition"]
    )
    metadata = dict(
        presence_penalty=r["presence"],
        frequency_penalty=r["frequency"],
        repetition_penalty=r["repetition"],
        state_slot=slots,
        suppress_stop=suppress,
    )
    return r["logits"], state, metadata, want


def test_logits_state_rows_match_numpy_reference():
    logits, state, metadata, want = _state_case()
    got = np.asarray(apply_logits_state(jnp.asarray(logits), state, make_metadata(B, **metadata)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    allowed = np.isfinite(got[2])
    assert set(np.flatnonzero(allowed)) == {5, 17, 300}
    assert np.isneginf(got[3, [2, 40]]).all() and np.isfinite(got[4, 2])


def test_sampler_applies_rows_before_greedy_and_counts_sampled_tokens():
    logits, state, metadata, want = _state_case(seed=2)
    count = np.array([1, 1, 1, 1, 0, 1], np.int32)  # row 4: a chunk that does not sample
    md = make_metadata(B, **metadata, count_sampled=count, num_logprobs=3, logprobs_mode=1)
    run = jax.jit(functools.partial(sample, num_logprobs=3, variant=ALL_STAGES))
    tokens, logprobs, new_state = run(logits, md, state)
    tokens = np.asarray(tokens)
    np.testing.assert_array_equal(tokens, want.argmax(-1))
    # Processed logprobs of greedy rows: log_softmax of the processed logits (no temperature).
    shifted = want - want.max(-1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    np.testing.assert_allclose(
        np.asarray(logprobs.logprobs), log_softmax[np.arange(B), tokens], rtol=1e-4, atol=1e-4
    )
    counts = np.asarray(new_state.output_counts)
    old = np.asarray(state.output_counts)
    slots = metadata["state_slot"]
    for b in range(B):
        delta = counts[slots[b]] - old[slots[b]]
        if slots[b] == NEUTRAL:
            assert not delta.any()  # the neutral row is never written
        else:
            assert delta.sum() == count[b] and (count[b] == 0 or delta[tokens[b]] == 1)
