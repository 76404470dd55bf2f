"""The rejection sampler: exact greedy verification, and the target's distribution kept under
sampling (chi-square over many seeded rows), against float64 numpy references."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxpaged.sample.logits_state import LogitsState, allocate_logits_state
from jaxpaged.sample.metadata import SamplerVariant
from jaxpaged.sampling_params import MAX_LOGPROB_TOKEN_IDS
from jaxpaged.spec_decode.rejection_sampler import rejection_sample
from tests.sample.conftest import make_metadata
from tests.sample.test_penalties import numpy_penalties
from tests.sample.test_sampler import reference_probs

ALL_STAGES = SamplerVariant(uses_state=True, filters=True, logprobs=True)
NUM_DRAWS = 20000


@functools.partial(jax.jit, static_argnames=("variant",))
def _verify(logits, draft_ids, num_draft, metadata, state, draft_probs=None, *, variant):
    return rejection_sample(
        logits, draft_ids, num_draft, metadata, state, draft_probs,
        variant=variant, num_logprobs=2,
    )  # fmt: skip


def _run(logits, draft_ids, num_draft, metadata, state=None, draft_probs=None,
         variant=ALL_STAGES):  # fmt: skip
    if state is None:
        state = allocate_logits_state(0, logits.shape[-1])
    out, state = _verify(
        jnp.asarray(logits), jnp.asarray(draft_ids, jnp.int32), jnp.asarray(num_draft, jnp.int32),
        metadata, state, None if draft_probs is None else jnp.asarray(draft_probs),
        variant=variant,
    )  # fmt: skip
    return out, state


# ------------------------------------------------------------------------------------ greedy
def _greedy_case():
    rng = np.random.default_rng(0)
    b, k, v = 6, 3, 16
    logits = rng.normal(0, 2, (b, k + 1, v)).astype(np.float32)
    top = logits.argmax(-1)  # [B, K + 1]
    drafts = top[:, :k].copy()
    num_draft = np.full(b, k)
    drafts[1, 1] = (top[1, 1] + 1) % v  # row 1: mismatch at position 1
    num_draft[2] = 0  # row 2: no drafts, an ordinary greedy step
    drafts[3, 0] = -1  # row 3: a placeholder first
    num_draft[4] = 2  # row 4: two drafts, both right: the bonus comes from position 2
    drafts[5, 0] = (top[5, 0] + 3) % v  # row 5: wrong at once
    expected = [
        [*top[0]],
        [top[1, 0], top[1, 1], -1, -1],
        [top[2, 0], -1, -1, -1],
        [top[3, 0], -1, -1, -1],
        [top[4, 0], top[4, 1], top[4, 2], -1],
        [top[5, 0], -1, -1, -1],
    ]
    return logits, drafts, num_draft, np.array(expected)


@pytest.mark.parametrize("variant", [SamplerVariant(), ALL_STAGES], ids=["plain", "all_stages"])
def test_greedy_rows_accept_while_the_draft_is_the_argmax(variant):
    logits, drafts, num_draft, expected = _greedy_case()
    metadata = make_metadata(len(drafts), temperature=0.0)
    out, _ = _run(logits, drafts, num_draft, metadata, variant=variant)
    np.testing.assert_array_equal(np.asarray(out.token_ids), expected)
    np.testing.assert_array_equal(np.asarray(out.num_tokens), (expected >= 0).sum(1))


def test_no_drafts_at_all_is_an_ordinary_greedy_step():
    logits = np.random.default_rng(1).normal(size=(3, 1, 9)).astype(np.float32)
    out, _ = _run(logits, np.zeros((3, 0)), np.zeros(3), make_metadata(3, temperature=0.0))
    np.testing.assert_array_equal(np.asarray(out.token_ids)[:, 0], logits[:, 0].argmax(-1))
    np.testing.assert_array_equal(np.asarray(out.num_tokens), 1)


def _state_with_row(v, counts=None, prompt=None, stop=None, bias=None) -> LogitsState:
    """A LogitsState with one request row (slot 0) and the neutral row (slot 1)."""

    def rows(x, dtype):
        out = np.zeros((2, v), dtype)
        if x is not None:
            out[0] = x
        return jnp.asarray(out)

    return LogitsState(
        rows(counts, np.int32), rows(prompt, bool), rows(stop, bool), rows(bias, np.float32),
        jnp.full((2, MAX_LOGPROB_TOKEN_IDS), -1, jnp.int32),
    )


def test_greedy_verification_counts_the_earlier_drafts_in_the_penalties():
    """Token 3 leads at every position; once drafted, a repetition penalty pushes it below
    token 5, so the argmax after it is 5: the draft [3, 3] is accepted once, then corrected."""
    v = 8
    logits = np.zeros((1, 3, v), np.float32)
    logits[0, :, 3], logits[0, :, 5] = 4.0, 3.0
    state = _state_with_row(v)
    metadata = make_metadata(1, temperature=0.0, repetition_penalty=2.0, state_slot=0,
                             neutral_slot=1, count_sampled=1)  # fmt: skip
    out, state = _run(logits, [[3, 3]], [2], metadata, state)
    assert np.asarray(out.token_ids).tolist() == [[3, 5, -1]]
    # Only the emitted tokens enter the counts (not the rejected second 3).
    counts = np.asarray(state.output_counts)[0]
    assert counts[3] == 1 and counts[5] == 1 and counts.sum() == 2


def test_min_tokens_suppresses_stop_tokens_for_its_count_of_positions():
    """EOS (token 2) leads everywhere; suppress_stop = 2 hides it at positions 0 and 1 only."""
    v = 6
    logits = np.zeros((1, 4, v), np.float32)
    logits[0, :, 2], logits[0, :, 4] = 5.0, 1.0
    stop = np.zeros(v, bool)
    stop[2] = True
    state = _state_with_row(v, stop=stop)
    metadata = make_metadata(1, temperature=0.0, suppress_stop=2, state_slot=0, neutral_slot=1)
    out, _ = _run(logits, [[4, 4, 4]], [3], metadata, state)
    assert np.asarray(out.token_ids).tolist() == [[4, 4, 2, -1]]


def test_logprobs_are_the_targets_at_each_emitted_position():
    logits, drafts, num_draft, expected = _greedy_case()
    metadata = make_metadata(len(drafts), temperature=0.0, num_logprobs=2, logprobs_mode=0)
    out, _ = _run(logits, drafts, num_draft, metadata)
    logprobs = jax.nn.log_softmax(jnp.asarray(logits), -1)
    flat = np.asarray(out.logprobs.logprobs).reshape(expected.shape)
    got = np.asarray(out.token_logprobs)
    for b, p in zip(*np.nonzero(expected >= 0), strict=True):
        want = float(logprobs[b, p, expected[b, p]])
        assert flat[b, p] == pytest.approx(want, abs=1e-5)
        assert got[b, p] == pytest.approx(want, abs=1e-5)
    assert (np.asarray(out.logprobs.ranks).reshape(expected.shape)[expected >= 0] == 1).all()


# ------------------------------------------------------------------------------- sampled
def _chi_square(tokens, probs, label):
    """Deterministic (fixed seeds): tokens outside the support never appear, the counts pass a
    chi-square test against ``probs`` at p > 1e-3 (bins with expected < 5 pooled), and the
    total variation distance stays below ``sqrt(V / n)``."""
    assert probs[tokens].min() > 0, f"{label}: a token outside the target's support"
    observed = np.bincount(tokens, minlength=probs.size)
    expected = len(tokens) * probs
    big = expected >= 5
    assert big.sum() >= 2, f"{label}: a one-token distribution tests nothing"
    f_obs = np.append(observed[big], observed[~big].sum())
    f_exp = np.append(expected[big], expected[~big].sum())
    if f_exp[-1] < 5:
        f_obs, f_exp = f_obs[:-1], f_exp[:-1]
        f_obs[np.argmax(f_exp)] += observed[~big].sum()
        f_exp[np.argmax(f_exp)] += expected[~big].sum()
    result = stats.chisquare(f_obs, f_exp)
    assert result.pvalue > 1e-3, (label, result, observed, np.round(expected))
    # Total variation: its expected value under exact sampling is about half this bound.
    tv = 0.5 * np.abs(observed / len(tokens) - probs).sum()
    assert tv < np.sqrt(probs.size / len(tokens)), (label, tv)


def _target_probs(logits_row, counts, prompt, params):
    """float64 numpy: penalties (if any), then temperature / top-k / top-p."""
    z = numpy_penalties(
        logits_row[None], counts[None], prompt[None], [params.get("presence_penalty", 0.0)],
        [params.get("frequency_penalty", 0.0)], [params.get("repetition_penalty", 1.0)],
    )[0]  # fmt: skip
    return reference_probs(
        z, params["temperature"], top_k=params.get("top_k", 0), top_p=params.get("top_p", 1.0)
    )


V = 10
LOGITS = np.array(
    [[2.0, 1.5, 1.0, 0.8, 0.5, 0.2, 0.0, -0.5, -1.0, -2.0],
     [0.3, 1.8, -0.4, 1.2, 0.9, 0.0, 1.1, -1.0, 0.6, -0.2],
     [1.0, 0.0, 0.5, -0.3, 1.4, 0.7, -1.2, 0.9, 0.2, 1.6]], np.float32,
)  # fmt: skip
CASES = {
    "temperature 1": dict(temperature=1.0),
    "top-k 6, top-p 0.9": dict(temperature=1.0, top_k=6, top_p=0.9),
    "penalties, top-k 7, T 0.8": dict(
        temperature=0.8,
        top_k=7,
        repetition_penalty=1.5,
        frequency_penalty=0.3,
        presence_penalty=0.2,
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(
    "drafts", [(1, 4), (3, 3), (9, 0)], ids=["likely", "repeated", "outside_top_k"]
)
def test_one_hot_drafts_keep_the_target_distribution(case, drafts):
    """n-gram-style drafts (no probabilities): the first token follows p_0 whatever is drafted,
    and after an accepted first draft the second follows p_1 with that draft counted in the
    penalties. Token 9 is outside every top-k: it is never accepted."""
    params = dict(CASES[case])
    n, k = NUM_DRAWS, 2
    counts, prompt = np.zeros(V, np.int32), np.zeros(V, bool)
    counts[[0, 4]], prompt[[1, 5]] = [2, 1], True
    state = _state_with_row(V, counts=counts, prompt=prompt)
    metadata = make_metadata(
        n, seed_lo=np.arange(n), seed_hi=7, step=3, state_slot=0, neutral_slot=1,
        **{key: value for key, value in params.items()},
    )  # fmt: skip
    logits = np.broadcast_to(LOGITS, (n, k + 1, V))
    out, _ = _run(logits, np.broadcast_to(drafts, (n, k)), np.full(n, k), metadata, state)
    tokens, num = np.asarray(out.token_ids), np.asarray(out.num_tokens)
    p0 = _target_probs(LOGITS[0], counts, prompt, params)
    _chi_square(tokens[:, 0], p0, f"{case}: first token")
    accepted = tokens[:, 0] == drafts[0]
    assert (num[accepted] >= 2).all() and (num[~accepted] == 1).all()
    if p0[drafts[0]] == 0:
        assert not accepted.any()
        return
    counts1 = counts.copy()
    counts1[drafts[0]] += 1
    p1 = _target_probs(LOGITS[1], counts1, prompt, params)
    _chi_square(tokens[accepted, 1], p1, f"{case}: second token after the draft")


def test_drafts_with_probabilities_keep_the_target_distribution():
    """Draft-model style: x_j ~ q_j, accepted with min(1, p/q), else drawn from
    normalize(max(0, p - q)); q is far from p (and puts mass where p has none)."""
    params = dict(temperature=1.0, top_k=6, top_p=0.9)
    n, k = NUM_DRAWS, 2
    rng = np.random.default_rng(3)
    q = np.stack([rng.dirichlet(np.full(V, 0.7)) for _ in range(k)]).astype(np.float32)
    drafts = np.stack([rng.choice(V, n, p=q[j] / q[j].sum()) for j in range(k)], axis=1)
    metadata = make_metadata(n, seed_lo=np.arange(n), **params)
    logits = np.broadcast_to(LOGITS, (n, k + 1, V))
    out, _ = _run(logits, drafts, np.full(n, k), metadata,
                  draft_probs=np.broadcast_to(q, (n, k, V)))  # fmt: skip
    tokens, num = np.asarray(out.token_ids), np.asarray(out.num_tokens)
    none = np.zeros(V, np.int32), np.zeros(V, bool)
    _chi_square(tokens[:, 0], _target_probs(LOGITS[0], *none, params), "first token")
    second = num >= 2  # the first draft was accepted: position 1 was emitted
    assert (tokens[second, 0] == drafts[second, 0]).all()
    _chi_square(tokens[second, 1], _target_probs(LOGITS[1], *none, params), "second token")
    # Every draft accepted: the bonus follows p_2.
    bonus = num == 3
    assert bonus.sum() > 1000
    _chi_square(tokens[bonus, 2], _target_probs(LOGITS[2], *none, params), "bonus token")


def test_bonus_after_fewer_drafts_comes_from_the_position_after_them():
    """Rows with 1 of K = 3 drafts, always accepted (p(6) = 1 at position 0): the bonus
    follows position 1, not position 3."""
    n, k = NUM_DRAWS, 3
    rows = np.concatenate([LOGITS, LOGITS[:1]])  # K + 1 = 4 positions
    logits = np.broadcast_to(rows, (n, k + 1, V)).copy()
    logits[:, 0, 6] = 50.0  # position 0: token 6 certain
    metadata = make_metadata(n, seed_lo=np.arange(n), temperature=1.0)
    out, _ = _run(logits, np.full((n, k), 6), np.ones(n), metadata)
    tokens, num = np.asarray(out.token_ids), np.asarray(out.num_tokens)
    assert (num == 2).all() and (tokens[:, 0] == 6).all() and (tokens[:, 2:] == -1).all()
    _chi_square(tokens[:, 1], reference_probs(LOGITS[1], 1.0), "bonus at position 1")


def test_a_seeded_row_verifies_the_same_way_whatever_shares_its_batch():
    n, k = 32, 2
    rng = np.random.default_rng(5)
    drafts = rng.integers(0, V, (n, k))
    logits = np.broadcast_to(LOGITS, (n, k + 1, V))

    def run(order):
        metadata = make_metadata(n, temperature=1.0, seed_lo=np.arange(n)[order], step=4)
        out, _ = _run(logits, drafts[order], np.full(n, k), metadata)
        return np.asarray(out.token_ids)

    base = run(np.arange(n))
    perm = rng.permutation(n)
    np.testing.assert_array_equal(run(perm), base[perm])
    assert len({tuple(row) for row in base}) > 5


def test_stories260k_logits_keep_their_distribution_under_verification(hf_story_logits):
    """Three consecutive positions of a real model's logits (vocabulary 512), temperature 1,
    top-k 50, top-p 0.95, repetition penalty 1.2: the first token follows p_0 whatever the
    (one-hot) draft, and after the first draft is accepted the second follows p_1."""
    logits3 = hf_story_logits[19:22]  # the two most uncertain consecutive positions
    v = logits3.shape[-1]
    params = dict(temperature=1.0, top_k=50, top_p=0.95, repetition_penalty=1.2)
    n, k = NUM_DRAWS, 2
    drafts = (int(np.argsort(-logits3[0])[1]), int(logits3[1].argmax()))
    state = _state_with_row(v)
    metadata = make_metadata(n, seed_lo=np.arange(n), state_slot=0, neutral_slot=1, **params)
    out, _ = _run(np.broadcast_to(logits3, (n, k + 1, v)), np.broadcast_to(drafts, (n, k)),
                  np.full(n, k), metadata, state)  # fmt: skip
    tokens = np.asarray(out.token_ids)
    none = np.zeros(v, np.int32), np.zeros(v, bool)
    _chi_square(tokens[:, 0], _target_probs(logits3[0], *none, params), "first token")
    accepted = tokens[:, 0] == drafts[0]
    counts = np.zeros(v, np.int32)
    counts[drafts[0]] = 1
    p1 = _target_probs(logits3[1], counts, none[1], params)
    _chi_square(tokens[accepted, 1], p1, "second token after the draft")
