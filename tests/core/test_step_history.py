"""StepHistory: prefill vs decode tokens, preemptions, bounded length."""

from types import SimpleNamespace

import pytest

from jaxpaged.core.scheduler_output import ScheduledSequence, SchedulerOutput
from jaxpaged.core.step_history import StepHistory
from jaxpaged.sequence import Sequence

PARAMS = SimpleNamespace(max_tokens=16, ignore_eos=False, stop_token_ids=None)


def _scheduled(num_prompt, computed, new):
    seq = Sequence("s", list(range(1, num_prompt + 1)), PARAMS)
    return ScheduledSequence(seq, computed, new, [], do_sample=True)


def test_decodes_are_single_tokens_past_the_prompt_and_the_rest_is_prefill():
    history = StepHistory()
    step = [
        _scheduled(5, 5, 1),  # decode
        _scheduled(5, 7, 1),  # decode
        _scheduled(10, 0, 6),  # prompt chunk
        _scheduled(10, 9, 1),  # the prompt's last token: prefill
        _scheduled(4, 0, 6),  # recomputing prompt + outputs after a preemption
    ]
    history.record(SchedulerOutput(step, 15, preempted_seq_ids=["x", "y"]), 0.5)
    (record,) = history.records()
    assert (record.num_decode_tokens, record.num_prefill_tokens) == (2, 13)
    assert (record.num_seqs, record.num_preempted, record.kv_cache_usage) == (5, 2, 0.5)


def test_empty_steps_are_skipped_and_old_steps_dropped():
    history = StepHistory(max_steps=2)
    history.record(SchedulerOutput([], 0), 0.0)
    assert history.records() == []
    for _ in range(3):
        history.record(SchedulerOutput([_scheduled(3, 3, 1)], 1), 0.1)
    assert [r.step for r in history.records()] == [1, 2]
    with pytest.raises(ValueError, match="max_steps must be at least 1, got 0"):
        StepHistory(max_steps=0)
