"""The request-life trace (``engine_core/request_trace.py``): what ``TracingEngineCore`` records on the
session's engine, and the lives and lags ``request_lives`` / ``summarize`` derive from a trace."""

from __future__ import annotations

import pytest

from jaxpaged import SamplingParams
from jaxpaged.engine_core.core_messages import params_to_wire
from jaxpaged.engine_core.request_trace import TracingEngineCore, request_lives, summarize


def test_the_tracing_core_records_each_request_and_step_in_order(stories_llm):
    engine = stories_llm.llm_engine
    was_async = engine.async_scheduling
    engine.async_scheduling = True
    core = TracingEngineCore(engine)
    params = params_to_wire(SamplingParams(max_tokens=3, ignore_eos=True))
    try:
        assert core.add_request("a", [1, 5, 6, 7], params, 0.0) is None
        core.step()
        assert core.add_request("b", [1, 8, 9], params, 0.0) is None
        assert core.add_request("bad", [1, 10**9], params, 0.0) is not None  # refused: no record
        while core.has_work():
            core.step()
        trace = core.call_utility("request_trace", [])
    finally:
        engine.async_scheduling = was_async
    assert set(trace["requests"]) == {"a", "b"}
    a, b = trace["requests"]["a"], trace["requests"]["b"]
    assert a["scheduled_call"] == 0 and b["scheduled_call"] == 1
    # Async: a step's tokens leave with the next call's outputs.
    assert a["first_token_call"] == 1 and b["first_token_call"] == 2
    for record in (a, b):
        assert record["received"] <= record["added"] <= record["first_token_sent"]
        assert record["finished_call"] > record["first_token_call"]
    steps = trace["steps"]
    assert [s["call"] for s in steps] == list(range(len(steps)))
    assert steps[0]["prefill_tokens"] == 4 and steps[1]["prefill_tokens"] == 3
    assert steps[1]["decode_tokens"] == 1
    for step, following in zip(steps, steps[1:], strict=False):
        assert step["started"] <= step["dispatched"] <= step["ended"] <= following["started"]
        if step["device_work"]:  # its end is read by the next call
            assert step["device_start"] <= step["device_end"] <= following["ended"]
    assert core.call_utility("clear_request_trace", []) is True
    assert core.request_trace() == {"requests": {}, "steps": []}


def _step(call, start, end, prefill=0):
    return {
        "call": call,
        "started": start - 0.001,
        "dispatched": start - 0.0005,
        "ended": end,
        "async": True,
        "device_work": True,
        "device_start": start,
        "device_end": end,
        "device_end_exact": True,
        "prefill_tokens": prefill,
        "decode_tokens": 4,
        "num_seqs": 4,
    }


def _request(arrival, scheduled, first_token_call, sent):
    return {
        "arrival": arrival,
        "received": arrival + 0.001,
        "added": arrival + 0.002,
        "prompt_len": 16,
        "scheduled_call": scheduled,
        "first_token_call": first_token_call,
        "first_token_sent": sent,
        "finished_call": None if first_token_call is None else first_token_call + 3,
    }


def test_lives_give_the_step_running_at_arrival_and_the_lag():
    # Steps of 10 ms back to back from t = 0; step 3 carries a 16-token prefill.
    steps = [_step(k, 0.01 * k, 0.01 * (k + 1), prefill=16 if k == 3 else 0) for k in range(6)]
    trace = {
        "requests": {
            "joined": _request(0.015, 2, 3, 0.0305),  # arrived in step 1, scheduled in 2
            "late": _request(0.019, 3, 4, 0.0405),  # arrived in step 1, scheduled in 3
            "idle": _request(0.5, 5, 6, 0.6),  # after the last step: the device was idle
            "unscheduled": _request(0.02, None, None, None),
        },
        "steps": steps,
    }
    lives = {life["request_id"]: life for life in request_lives(trace)}
    assert set(lives) == {"joined", "late", "idle"}
    assert (lives["joined"]["running_step"], lives["joined"]["lag"]) == (1, 1)
    assert (lives["late"]["running_step"], lives["late"]["lag"]) == (1, 2)
    assert lives["idle"]["running_step"] is None and lives["idle"]["lag"] is None
    joined = lives["joined"]
    assert joined["api_to_core_ms"] == pytest.approx(1.0)
    assert joined["to_schedule_ms"] == pytest.approx(1000 * (0.019 - 0.017))
    assert joined["ttft_ms"] == pytest.approx(15.5)
    assert lives["late"]["prefill_tokens_in_step"] == 16
    summary = summarize(trace)
    assert summary["lags"] == {"1": 1, "2": 1, "device idle": 1}
    assert summary["num_requests"] == 3
    assert summary["device_step_ms"]["p50"] == pytest.approx(10.0)
    assert summary["steps_with_prefill"] == 1
    assert summary["device_idle_fraction"] == pytest.approx(0.0)
