"""The device n-gram proposer against the plain definition (vLLM's prompt lookup)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxpaged.spec_decode.ngram_proposer import (
    ngram_propose,
    ngram_propose_batch_reference,
    ngram_propose_reference,
)


def _propose(rows, width=None, **kwargs):
    """Pad ``rows`` into a [B, width] buffer whose unused columns hold junk tokens."""
    width = width or max(len(r) for r in rows) + 3
    rng = np.random.default_rng(0)
    buffer = rng.integers(0, 5, (len(rows), width)).astype(np.int32)
    for i, row in enumerate(rows):
        buffer[i, : len(row)] = row
    lengths = np.array([len(r) for r in rows], np.int32)
    drafts, num = ngram_propose(buffer, lengths, **kwargs)
    return np.asarray(drafts), np.asarray(num), buffer, lengths


def test_worked_example_proposes_what_follows_the_longest_earlier_suffix():
    # 8 6 7 never occurred before; 6 7 did at index 1, so propose 8 6 7 (the context ends).
    kwargs = dict(num_speculative_tokens=4, min_n=2, max_n=3, max_model_len=100)
    assert ngram_propose_reference([5, 6, 7, 8, 6, 7], **kwargs) == [8, 6, 7]
    drafts, num, _, _ = _propose([[5, 6, 7, 8, 6, 7]], **kwargs)
    assert num.tolist() == [3] and drafts.tolist() == [[8, 6, 7, -1]]


def test_longest_suffix_wins_then_the_earliest_occurrence():
    kwargs = dict(num_speculative_tokens=2, min_n=1, max_n=3, max_model_len=100)
    # "1 2" occurs first at 0 (then 3 1), but the longer suffix "3 1 2" occurs at 2 (then 9 3).
    row = [1, 2, 3, 1, 2, 9, 3, 1, 2]
    assert ngram_propose_reference(row, **kwargs) == [9, 3]
    # Only "1 2" (n = 2) matches: at 0 (then 7) and 3 (then 8): the earliest wins.
    row2 = [1, 2, 7, 1, 2, 8, 5, 1, 2]
    assert ngram_propose_reference(row2, **kwargs) == [7, 1]
    drafts, num, _, _ = _propose([row, row2], **kwargs)
    assert drafts.tolist() == [[9, 3], [7, 1]] and num.tolist() == [2, 2]


def test_a_periodic_context_gets_all_k_tokens():
    kwargs = dict(num_speculative_tokens=5, min_n=2, max_n=4, max_model_len=100)
    row = [4, 5, 6] * 4  # period 3 < K: the continuation runs into the suffix itself
    drafts, num, _, _ = _propose([row], **kwargs)
    assert drafts.tolist() == [[4, 5, 6, 4, 5]] and num.tolist() == [5]


@pytest.mark.parametrize(
    ("row", "kwargs", "expected"),
    [
        ([1, 2, 3, 4], dict(min_n=1, max_n=2), []),  # nothing repeats
        ([7, 7], dict(min_n=2, max_n=2), []),  # n = 2 needs 3 tokens
        ([7, 7], dict(min_n=1, max_n=3), [7]),
        ([], dict(min_n=1, max_n=2), []),
        ([3, 1, 3], dict(min_n=1, max_n=1, max_model_len=4), [1]),  # one slot left in context
        ([3, 1, 3], dict(min_n=1, max_n=1, max_model_len=3), []),  # context full
    ],
)
def test_edge_cases_match_the_definition(row, kwargs, expected):
    kwargs = dict(num_speculative_tokens=3, max_model_len=100) | kwargs
    assert ngram_propose_reference(row, **kwargs) == expected
    drafts, num, _, _ = _propose([row, [0]], width=8, **kwargs)
    assert num[0] == len(expected) and drafts[0, : len(expected)].tolist() == expected
    assert (drafts[0, len(expected) :] == -1).all()


@pytest.mark.parametrize(("min_n", "max_n", "k"), [(1, 1, 4), (2, 5, 3), (3, 3, 7), (1, 6, 1)])
def test_random_batches_match_the_reference(min_n, max_n, k):
    rng = np.random.default_rng(min_n * 100 + max_n * 10 + k)
    width = 96
    lengths = rng.integers(0, width + 1, 64).astype(np.int32)
    vocab = rng.integers(2, 6, 64)  # small vocabularies so matches of every length occur
    buffer = np.stack([rng.integers(0, v, width) for v in vocab]).astype(np.int32)
    kwargs = dict(num_speculative_tokens=k, min_n=min_n, max_n=max_n, max_model_len=width)
    drafts, num = ngram_propose(buffer, lengths, **kwargs)
    want_drafts, want_num = ngram_propose_batch_reference(buffer, lengths, **kwargs)
    np.testing.assert_array_equal(np.asarray(num), want_num)
    np.testing.assert_array_equal(np.asarray(drafts), want_drafts)
    assert want_num.min() == 0 and 0 < want_num.max()
