"""TokenHistory: rows rebuilt from host tokens, appended on the device, read by the proposer."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from jaxpaged.spec_decode.ngram_proposer import ngram_propose_reference
from jaxpaged.spec_decode.token_history import (
    WRITE_ROWS,
    allocate_token_history,
    append_tokens,
    host_rows,
    propose_from_history,
    write_rows,
)

L = 12
_append = jax.jit(append_tokens, donate_argnames=("history",))


def _rows(history, slot):
    n = int(history.lengths[slot])
    return np.asarray(history.token_ids[slot, :n]).tolist()


def _written(lists_by_slot: dict[int, list[int]], num_slots=6):
    history = allocate_token_history(num_slots, L)
    slots = np.full(WRITE_ROWS, num_slots + 1, np.int32)  # past the last row: dropped
    slots[: len(lists_by_slot)] = list(lists_by_slot)
    rows, lengths = host_rows(list(lists_by_slot.values()), L)
    return write_rows(history, slots, rows, lengths)


def test_rows_are_rebuilt_from_host_tokens_and_padding_is_dropped():
    history = _written({2: [5, 6, 7], 0: [1], 5: []})
    assert _rows(history, 2) == [5, 6, 7] and _rows(history, 0) == [1] and _rows(history, 5) == []
    assert int(history.lengths[history.neutral_slot]) == 0
    with pytest.raises(ValueError, match="exceeds max_model_len=12"):
        host_rows([list(range(13))], L)


def test_append_adds_each_rows_emitted_tokens_and_skips_the_neutral_slot():
    history = _written({0: [1, 2], 2: [3]})
    neutral = history.neutral_slot
    slots = np.array([0, 2, neutral], np.int32)
    tokens = np.array([[7, 8, 9], [4, 5, 6], [9, 9, 9]], np.int32)
    history = _append(history, slots, tokens, np.array([2, 3, 3], np.int32))
    assert _rows(history, 0) == [1, 2, 7, 8] and _rows(history, 2) == [3, 4, 5, 6]
    assert int(history.lengths[neutral]) == 0 and not np.asarray(history.token_ids[neutral]).any()


def test_append_stops_at_max_model_len():
    history = _written({1: list(range(10))})
    history = _append(history, np.array([1], np.int32), np.array([[50, 51, 52, 53]], np.int32),
                      np.array([4], np.int32))  # fmt: skip
    assert _rows(history, 1) == [*range(10), 50, 51] and int(history.lengths[1]) == L


def test_proposals_from_the_history_equal_the_reference_on_the_host_tokens():
    host = {0: [4, 5, 6, 4, 5], 3: [1, 2, 3, 1], 1: [9, 8]}
    history = _written(host)
    slots = np.array([3, 0, 1, history.neutral_slot], np.int32)
    history = _append(history, slots, np.array([[2, 0], [6, 0], [9, 0], [1, 1]], np.int32),
                      np.array([1, 1, 1, 2], np.int32))  # fmt: skip
    kwargs = dict(num_speculative_tokens=3, min_n=1, max_n=3, max_model_len=L)
    propose = jax.jit(functools.partial(propose_from_history, **kwargs))
    drafts, num = (np.asarray(x) for x in propose(history, slots))
    for i, slot in enumerate(slots[:3]):
        want = ngram_propose_reference(host[int(slot)] + [[2, 6, 9][i]], **kwargs)
        assert drafts[i, : num[i]].tolist() == want and num[i] == len(want)
    assert num[3] == 0
