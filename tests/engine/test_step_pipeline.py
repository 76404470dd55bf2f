"""The step plans of ``engine/step_pipeline.py``: which plan a step takes, and what each does."""

from __future__ import annotations

import itertools

import pytest

from jaxpaged.engine.step_pipeline import (
    COMMIT,
    PIPELINED,
    RESOLVE,
    SPLIT,
    SYNC,
    WAIT,
    choose_plan,
)
from jaxpaged.worker.step_program import FORWARD, SAMPLE, STAGES


@pytest.mark.parametrize(
    "beams, constrained, prompt_logprobs", list(itertools.product((0, 1), repeat=3))
)
def test_without_pipelining_every_step_is_synchronous(beams, constrained, prompt_logprobs):
    plan = choose_plan(
        pipelining=False,
        beams=bool(beams),
        constrained=bool(constrained),
        prompt_logprobs=bool(prompt_logprobs),
    )
    assert plan is SYNC


@pytest.mark.parametrize(
    "beams, constrained, prompt_logprobs, expected",
    [
        (False, False, False, PIPELINED),
        (False, False, True, PIPELINED),  # prompt logprobs alone pipeline
        (False, True, False, SPLIT),  # the bitmask is filled while the forward runs
        (False, True, True, SYNC),  # prompt logprobs read the hidden states: no split
        (True, False, False, SYNC),  # the host selects beams before the next step
        (True, True, False, SYNC),
    ],
)
def test_async_steps_take_the_plan_their_rows_need(beams, constrained, prompt_logprobs, expected):
    plan = choose_plan(
        pipelining=True, beams=beams, constrained=constrained, prompt_logprobs=prompt_logprobs
    )
    assert plan is expected


@pytest.mark.parametrize("plan", [SYNC, PIPELINED, SPLIT])
def test_every_plan_launches_each_stage_once_in_order_and_commits_last(plan):
    launched = [stage for segment in plan.segments for stage in segment]
    assert tuple(launched) == STAGES
    assert plan.actions.count(RESOLVE) == 1 and plan.actions[-1] == COMMIT


def test_only_the_synchronous_plan_reads_its_own_tokens_before_committing():
    assert SYNC.waits and not PIPELINED.waits and not SPLIT.waits
    assert SYNC.actions.index(WAIT) > SYNC.actions.index(SYNC.segments[-1])


def test_the_previous_step_is_resolved_where_the_plan_overlaps_it():
    assert SYNC.actions[0] == RESOLVE  # drained before anything launches
    assert PIPELINED.overlaps_resolve  # the whole step runs while the host resolves
    assert not SPLIT.overlaps_resolve and not SYNC.overlaps_resolve
    # SPLIT: the forward runs during RESOLVE, the sample after it (its bitmask needs it)
    assert SPLIT.actions.index((FORWARD,)) < SPLIT.actions.index(RESOLVE)
    assert SPLIT.actions.index(RESOLVE) < SPLIT.actions.index((SAMPLE,))
