"""SpecDecodingStats: vLLM's counting rule, derived rates, intervals and the log line."""

from __future__ import annotations

import math

import pytest

from jaxpaged.spec_decode.metrics import SpecDecodingStats


def test_counts_follow_vllms_rule():
    stats = SpecDecodingStats(num_spec_tokens=4)
    stats.observe_draft(4, 2)  # positions 0 and 1 accepted
    stats.observe_draft(3, 3)
    stats.observe_draft(0, 0)  # no drafts this step: not a draft
    stats.observe_draft(4, 0)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 11, 5)
    assert stats.num_accepted_tokens_per_pos == [2, 2, 1, 0]
    assert stats.num_draft_tokens_per_pos == [3, 3, 3, 2]
    assert stats.acceptance_rate == pytest.approx(5 / 11)
    assert stats.mean_acceptance_length == pytest.approx(1 + 5 / 3)
    assert stats.acceptance_rate_per_pos == pytest.approx([2 / 3, 2 / 3, 1 / 3, 0.0])


def test_rates_before_any_draft_are_nan():
    stats = SpecDecodingStats(num_spec_tokens=2)
    assert math.isnan(stats.acceptance_rate) and math.isnan(stats.mean_acceptance_length)


@pytest.mark.parametrize(("drafted", "accepted"), [(2, 3), (5, 1), (3, -1)])
def test_impossible_counts_are_refused(drafted, accepted):
    with pytest.raises(ValueError, match="accepted"):
        SpecDecodingStats(num_spec_tokens=4).observe_draft(drafted, accepted)


def test_since_gives_an_intervals_counts_and_the_log_line_vllms_fields():
    stats = SpecDecodingStats(num_spec_tokens=2)
    stats.observe_draft(2, 1)
    earlier = stats.since(None)
    stats.observe_draft(2, 2)
    stats.observe_draft(1, 0)
    delta = stats.since(earlier)
    assert (delta.num_drafts, delta.num_draft_tokens, delta.num_accepted_tokens) == (2, 3, 2)
    assert delta.num_accepted_tokens_per_pos == [1, 1]
    assert earlier.num_drafts == 1  # a copy, not a view
    line = delta.log_line(elapsed_s=2.0)
    assert line == (
        "SpecDecoding metrics: Mean acceptance length: 2.00, Accepted throughput: 1.00 "
        "tokens/s, Drafted throughput: 1.50 tokens/s, Accepted: 2 tokens, Drafted: 3 tokens, "
        "Per-position acceptance rate: 0.500, 0.500, Avg Draft acceptance rate: 66.7%"
    )
    assert SpecDecodingStats.from_wire(stats.to_wire()) == stats
