"""Sequence: token bookkeeping, prefill/decode classification and finish reasons."""

import enum
from types import SimpleNamespace

import numpy as np
import pytest

from jaxpaged.sequence import Sequence, SequenceStatus, is_token_id_list


def _params(**kwargs):
    defaults = dict(max_tokens=16, ignore_eos=False, stop_token_ids=None, min_tokens=0)
    return SimpleNamespace(**(defaults | kwargs))


def test_new_sequence_is_waiting_with_nothing_computed():
    seq = Sequence("a", [1, 2, 3], _params(), eos_token_id=0, arrival_time=5.0)
    assert seq.status is SequenceStatus.WAITING
    assert seq.num_computed_tokens == 0
    assert (seq.num_tokens, seq.num_prompt_tokens, seq.num_output_tokens) == (3, 3, 0)
    assert seq.arrival_time == 5.0
    assert seq.finish_reason is None and not seq.is_finished


def test_append_token_extends_outputs_and_all_tokens():
    seq = Sequence("a", [1, 2], _params())
    seq.append_token(7)
    seq.append_token(8)
    assert seq.output_token_ids == [7, 8]
    assert seq.all_token_ids == [1, 2, 7, 8]
    assert seq.prompt_token_ids == [1, 2]
    assert (seq.num_tokens, seq.num_output_tokens, seq.last_token_id) == (4, 2, 8)


def test_all_token_ids_is_not_rebuilt_on_each_access():
    seq = Sequence("a", [1, 2], _params())
    assert seq.all_token_ids is seq.all_token_ids


def test_prompt_list_is_copied_not_aliased():
    prompt = [1, 2]
    seq = Sequence("a", prompt, _params())
    seq.append_token(3)
    assert prompt == [1, 2]


def test_empty_prompt_is_rejected():
    with pytest.raises(ValueError, match="at least 1 token"):
        Sequence("a", [], _params())


def test_one_token_prompt_starts_as_prefill():
    seq = Sequence("a", [5], _params())
    assert seq.is_prefill


def test_sequence_decodes_when_only_the_sampled_token_is_uncomputed():
    seq = Sequence("a", [1, 2, 3], _params())
    seq.num_computed_tokens = 2
    assert seq.is_prefill  # last prompt token still pending: a prefill chunk
    seq.num_computed_tokens = 3
    seq.append_token(9)
    assert not seq.is_prefill
    assert seq.num_uncomputed_tokens == 1


def test_recomputed_sequence_is_prefill_again():
    seq = Sequence("a", [1, 2, 3], _params())
    seq.num_computed_tokens = 3
    seq.append_token(9)
    seq.num_computed_tokens = 0  # recompute preemption
    assert seq.is_prefill
    assert seq.num_uncomputed_tokens == 4


@pytest.mark.parametrize(
    ("status", "reason"),
    [
        (SequenceStatus.FINISHED_STOPPED, "stop"),
        (SequenceStatus.FINISHED_LENGTH, "length"),
        (SequenceStatus.FINISHED_ABORTED, "abort"),
        (SequenceStatus.WAITING, None),
        (SequenceStatus.RUNNING, None),
    ],
)
def test_finish_reason_follows_status(status, reason):
    seq = Sequence("a", [1], _params())
    seq.status = status
    assert seq.finish_reason == reason
    assert seq.is_finished == (reason is not None)
    assert status.is_finished == (reason is not None)


class _TokenId(enum.IntEnum):
    FIVE = 5


@pytest.mark.parametrize(
    "ids, expected",
    [
        ([1, 2, 3], True),
        ((1, 2, 3), True),
        ([], True),
        ([1, _TokenId.FIVE], True),  # an int subclass other than bool is an int
        ([1, True], False),
        ([1, 2.0], False),
        ([1, "2"], False),
        ([[1, 2]], False),
        ("12", False),
        (np.array([1, 2]), False),  # not a Sequence (and its items are numpy ints)
        ([np.int64(1)], False),
        (None, False),
    ],
)
def test_is_token_id_list_accepts_python_ints_only(ids, expected):
    assert is_token_id_list(ids) is expected
