"""The on-device sampler against probabilities computed independently in numpy (float64) from
HF transformers logits of stories260k.

Many draws come from one call: every row holds the same logits with its own seed, so a row is
one independent draw.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from scipy import stats

from jaxpaged.sample.logits_state import allocate_logits_state
from jaxpaged.sample.metadata import SamplerVariant
from jaxpaged.sample.sampler import sample
from tests.sample.conftest import make_metadata

# The whole sampler: every optional stage compiled in (rows that do not use one are neutral).
ALL_STAGES = SamplerVariant(uses_state=True, filters=True, logprobs=True)

NUM_DRAWS = 16384
_sample = jax.jit(functools.partial(sample, num_logprobs=4, variant=ALL_STAGES))


def reference_probs(logits, temperature, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """vLLM v1's filters in float64: min-p against the top probability, top-k, then top-p over
    the renormalised survivors (the token that crosses top_p stays)."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    keep = p >= min_p * p.max()
    order = np.argsort(-z, kind="stable")
    if top_k:
        keep[order[top_k:]] = False
    if top_p < 1.0:
        q = np.where(keep, p, 0.0)[order]
        q /= q.sum()
        mass_before = np.cumsum(q) - q
        keep[order[1:][mass_before[1:] >= top_p]] = False
    out = np.where(keep, p, 0.0)
    return out / out.sum()


def _draw(logits_row, **params):
    n = NUM_DRAWS
    metadata = make_metadata(
        n,
        temperature=params.pop("temperature"),
        seed_lo=np.arange(n),
        seed_hi=params.pop("seed_hi", 0),
        step=params.pop("step", 0),
        num_logprobs=0,
        logprobs_mode=1,
        **params,
    )
    logits = np.broadcast_to(logits_row, (n, logits_row.shape[0]))
    tokens, logprobs, _ = _sample(logits, metadata, allocate_logits_state(0, logits.shape[1]))
    return np.asarray(tokens), np.asarray(logprobs.logprobs)


FILTERS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=1.5, top_k=40, top_p=0.9, min_p=0.02),
]


@pytest.mark.parametrize(
    "params", FILTERS, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items())
)
def test_token_frequencies_match_filtered_hf_probabilities(flat_logits, params):
    probs = reference_probs(flat_logits, **params)
    tokens, logprobs = _draw(flat_logits, **dict(params))
    assert probs[tokens].min() > 0, "a token outside the filtered support was drawn"
    observed = np.bincount(tokens, minlength=probs.size)
    expected = NUM_DRAWS * probs
    big = expected >= 5  # chi-square needs expected counts of at least ~5 per bin
    f_obs = np.append(observed[big], observed[~big].sum())
    f_exp = np.append(expected[big], expected[~big].sum())
    if f_exp[-1] < 5:  # fold a tiny tail bin into the largest one
        f_obs, f_exp = f_obs[:-1], f_exp[:-1]
        f_obs[np.argmax(f_exp)] += observed[~big].sum()
        f_exp[np.argmax(f_exp)] += expected[~big].sum()
    assert big.sum() >= 2
    result = stats.chisquare(f_obs, f_exp)
    # Draws are a fixed function of the seeds, so this is deterministic, not flaky.
    assert result.pvalue > 1e-3, (result, params)
    # The processed logprob of each draw is the log of its filtered, renormalised probability.
    np.testing.assert_allclose(logprobs, np.log(probs[tokens]), rtol=1e-4, atol=1e-4)


def test_greedy_rows_take_the_argmax_whatever_other_rows_filter(hf_story_logits):
    logits = hf_story_logits[:8]
    n = logits.shape[0]
    metadata = make_metadata(
        n,
        temperature=np.where(np.arange(n) % 2 == 0, 0.0, 1.0),
        top_k=np.where(np.arange(n) % 2 == 0, 0, 3),
        seed_lo=np.arange(n),
        num_logprobs=2,
    )
    tokens, logprobs, _ = _sample(logits, metadata, allocate_logits_state(0, logits.shape[1]))
    tokens = np.asarray(tokens)
    np.testing.assert_array_equal(tokens[::2], logits[::2].argmax(-1))
    np.testing.assert_array_equal(np.asarray(logprobs.ranks)[::2], 1)
    # The sampled rows stayed inside their top-3.
    top3 = np.argsort(-logits[1::2], axis=-1)[:, :3]
    assert all(t in row for t, row in zip(tokens[1::2], top3, strict=True))


def test_a_row_draws_the_same_token_whatever_shares_its_batch(flat_logits):
    """Batch invariance: a row's draw depends only on its logits, parameters, seed and step."""
    n = 64
    rng = np.random.default_rng(0)
    seeds, steps = rng.integers(0, 2**63, n, dtype=np.uint64), rng.integers(0, 100, n)
    logits = np.broadcast_to(flat_logits, (n, flat_logits.size))
    state = allocate_logits_state(0, flat_logits.size)

    def run(order, temperature):
        metadata = make_metadata(
            n,
            temperature=temperature,
            seed_lo=(seeds[order] & 0xFFFFFFFF).astype(np.uint32),
            seed_hi=(seeds[order] >> np.uint64(32)).astype(np.uint32),
            step=steps[order],
        )
        return np.asarray(_sample(logits, metadata, state)[0])

    base = run(np.arange(n), 1.0)
    perm = rng.permutation(n)
    np.testing.assert_array_equal(run(perm, 1.0), base[perm])
    # Other rows switching to greedy changes nothing for row 0.
    mixed = np.where(np.arange(n) == 0, 1.0, 0.0)
    assert run(np.arange(n), mixed)[0] == base[0]
    # Different seeds (and steps) give different draws.
    assert len(set(base.tolist())) > 5
