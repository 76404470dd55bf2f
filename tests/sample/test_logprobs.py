"""Top-k logprobs and ranks against numpy, chunked prompt logprobs, and Logprob dicts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from transformers import AutoTokenizer

from jaxpaged.outputs import Logprob
from jaxpaged.sample import logprobs as lp


def _numpy_log_softmax(x):
    x = x.astype(np.float64)
    shifted = x - x.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def test_rank_counts_strictly_better_tokens_and_top_k_is_sorted():
    rng = np.random.default_rng(0)
    logprobs = rng.normal(size=(5, 100)).astype(np.float32)
    logprobs[0, [3, 4, 5]] = 10.0  # a three-way tie at the top
    chosen = np.array([4, 0, 50, 99, 7])
    got = jax.jit(lp.top_logprobs, static_argnums=2)(logprobs, chosen, 6)
    want_ranks = 1 + (logprobs > logprobs[np.arange(5), chosen][:, None]).sum(-1)
    np.testing.assert_array_equal(np.asarray(got.ranks), want_ranks)
    assert got.ranks[0] == 1  # tied with the best is still rank 1
    np.testing.assert_array_equal(got.logprobs, logprobs[np.arange(5), chosen])
    np.testing.assert_array_equal(got.top_logprobs, -np.sort(-logprobs, axis=-1)[:, :6])
    np.testing.assert_array_equal(
        np.take_along_axis(logprobs, np.asarray(got.top_ids), -1), got.top_logprobs
    )


def test_prompt_logprobs_are_the_same_in_chunks_as_in_one_piece():
    rng = np.random.default_rng(1)
    t, hidden_size, vocab = lp.PROMPT_LOGPROBS_CHUNK + 37, 16, 64
    hidden = rng.normal(size=(t, hidden_size)).astype(np.float32)
    weight = rng.normal(size=(vocab, hidden_size)).astype(np.float32)
    targets = rng.integers(-1, vocab, t).astype(np.int32)

    def head(h):
        return jnp.einsum("nh,vh->nv", h, weight, precision="highest")

    got = jax.jit(lambda h, tg: lp.prompt_top_logprobs(h, head, tg, 3))(hidden, targets)
    want = _numpy_log_softmax(hidden.astype(np.float64) @ weight.T.astype(np.float64))
    rows = np.flatnonzero(targets >= 0)
    np.testing.assert_allclose(
        np.asarray(got.logprobs)[rows], want[rows, targets[rows]], rtol=1e-5, atol=1e-5
    )
    np.testing.assert_array_equal(np.asarray(got.top_ids), np.argsort(-want, -1)[:, :3])


def test_logprob_dicts_hold_the_chosen_token_then_the_top_k(stories_dir):
    builder = lp.LogprobsBuilder(AutoTokenizer.from_pretrained(stories_dir))
    entry = lp.TokenLogprobs(
        token_id=300, logprob=-3.0, rank=7, top_ids=[10, 300, 11], top_logprobs=[-0.1, -3.0, -4.0]
    )
    assert builder.build(entry, 1) == {
        300: Logprob(-3.0, 7, " ha"),  # SentencePiece's "▁ha": its leading space is kept
        10: Logprob(-0.1, 1, builder.decoded(10)),
    }
    full = builder.build(entry, 3)
    assert list(full) == [300, 10, 11] and full[11].rank == 3  # chosen not repeated: k entries
    assert builder.build(entry, 0) == {300: Logprob(-3.0, 7, " ha")}
