"""``EngineCore`` in-process on the session's engine, with its deltas carried through the wire
format into ``ClientRequestState`` (what the API process does): final outputs equal
``LLM.generate``'s, which detokenizes and applies stop strings inside its own engine."""

from __future__ import annotations

import pytest

from jaxpaged import SamplingParams
from jaxpaged.engine.client_outputs import ClientRequestState
from jaxpaged.engine.core import EngineCore
from jaxpaged.engine.core_messages import Kind, decode, decode_output, encode, params_to_wire

PROMPTS = ["Once upon a time", "The dog ran", "Tom had a red ball"]


def _run_core(core: EngineCore, tokenizer, requests):
    """Add ``(request_id, prompt, params)`` requests, step until done; final outputs by id."""
    states, finals = {}, {}
    for request_id, prompt, params in requests:
        ids = tokenizer.encode(prompt)
        wire = decode(encode(Kind.ADD, [request_id, ids, params_to_wire(params), 0.0]))[1]
        assert core.add_request(*wire) is None
        states[request_id] = ClientRequestState(request_id, prompt, ids, params, tokenizer)
    for _ in range(500):
        if not core.has_work():
            break
        outputs, stats = decode(encode(Kind.OUTPUTS, core.step()))[1]
        assert {"num_requests_running", "scheduled", "step_start"} <= set(stats)
        for wire in outputs:
            delta = decode_output(wire)
            state = states[delta.request_id]
            output = state.update(delta)
            if state.finished:
                finals[delta.request_id] = output
                if state.needs_core_abort:
                    core.abort_requests([delta.request_id])
    stats = core.check_idle()
    assert stats["num_unfinished_requests"] == 0
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"]
    return finals


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=12, logprobs=2),
        SamplingParams(temperature=0, max_tokens=30, stop=[" the", "."]),
        SamplingParams(n=2, temperature=0.9, seed=7, max_tokens=10, stop=["e"]),
    ],
    ids=["greedy-logprobs", "stop-strings", "n2-seeded-stop"],
)
def test_core_deltas_rebuilt_in_the_api_process_equal_llm_generate(stories_llm, params):
    engine = stories_llm.llm_engine
    tokenizer = stories_llm.get_tokenizer()
    expected = stories_llm.generate(PROMPTS, params, use_tqdm=False)
    core = EngineCore(engine)
    finals = _run_core(core, tokenizer, [(f"r{i}", p, params) for i, p in enumerate(PROMPTS)])
    for i, reference in enumerate(expected):
        got = finals[f"r{i}"]
        assert got.finished and got.prompt == PROMPTS[i]
        assert len(got.outputs) == len(reference.outputs)
        for ours, theirs in zip(got.outputs, reference.outputs, strict=True):
            assert ours.text == theirs.text
            assert ours.finish_reason == theirs.finish_reason
            assert ours.stop_reason == theirs.stop_reason
            assert ours.token_ids == theirs.token_ids
            if params.logprobs is not None:
                assert [{t: lp.logprob for t, lp in step.items()} for step in ours.logprobs] == [
                    {t: lp.logprob for t, lp in step.items()} for step in theirs.logprobs
                ]


def test_core_refuses_with_the_error_the_api_process_maps_to_a_status(stories_llm):
    core = EngineCore(stories_llm.llm_engine, max_num_queued_requests=0)
    params = params_to_wire(SamplingParams(max_tokens=4))
    assert core.add_request("full", [1, 2], params, 0.0)[0] == "QueueFullError"
    core.max_num_queued_requests = None
    name, message, parameter = core.add_request("bad", [1, 10**6], params, 0.0)
    assert name == "ValueError" and "outside the vocabulary" in message and parameter is None
    name, message, parameter = core.add_request("lp", [1, 2], {"logprobs": 10**4}, 0.0)
    assert name == "SamplingParamsError" and parameter == "logprobs"
    with pytest.raises(ValueError, match="not a utility"):
        core.call_utility("step", [])
    assert not core.has_work()
