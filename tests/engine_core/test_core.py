"""``EngineCore`` in-process on the session's engine, with its deltas carried through the wire
format into ``ClientRequestState`` (what the API process does): final outputs equal
``LLM.generate``'s, which detokenizes and applies stop strings inside its own engine."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxpaged import SamplingParams
from jaxpaged.engine_core.client_outputs import ClientRequestState
from jaxpaged.engine_core.core import EngineCore
from jaxpaged.engine_core.core_messages import (
    Kind,
    decode,
    decode_output,
    encode,
    params_to_wire,
)
from jaxpaged.sampling_params import RequestOutputKind
from tests.engine_core.wire_reference import encode_output

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
    assert name == "PromptError" and "outside the vocabulary" in message and parameter == "prompt"
    for i, ids in enumerate(([1, None], [1, float("inf")], [float("nan")])):
        name, message, parameter = core.add_request(f"bad-{i}", ids, params, 0.0)
        assert name == "PromptError" and "must be integers" in message and parameter == "prompt"
    assert not stories_llm.llm_engine.has_unfinished_requests()  # nothing held, the core lives
    name, message, parameter = core.add_request("lp", [1, 2], {"logprobs": 10**4}, 0.0)
    assert name == "SamplingParamsError" and parameter == "logprobs"
    with pytest.raises(ValueError, match="not a utility"):
        core.call_utility("step", [])
    assert not core.has_work()


def test_core_holds_the_api_process_params_without_stop_strings_in_delta_mode(stories_llm):
    """What the engine holds after ``EngineCore.add_request``: the API process's
    ``SamplingParams`` through the wire, stop strings dropped (the API process applies them),
    DELTA output (FINAL_ONLY when best_of > n), the resolved bad-word ids kept; prompt ids as
    ints whether they came as a list or as an array."""
    engine = stories_llm.llm_engine
    tokenizer = stories_llm.get_tokenizer()
    banned = SamplingParams(
        logit_bias={"3": 150, 4: -2.5},
        allowed_token_ids=[3, 4, 5, 265],
        min_tokens=2,
        max_tokens=5,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        bad_words=["the"],
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    banned.update_from_tokenizer(tokenizer)  # as serving_engine.sampling_params does
    assert banned.bad_words_token_ids  # the case tests that they survive
    cases = {
        "plain": SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        "stops": SamplingParams(
            temperature=0.7,
            top_p=0.9,
            top_k=-1,
            seed=-1,
            stop=["a", " the"],
            stop_token_ids=[5, 5, 7],
            include_stop_str_in_output=True,
            output_kind=RequestOutputKind.DELTA,
        ),
        "best_of": SamplingParams(
            n=2,
            best_of=3,
            temperature=1.0,
            seed=4,
            logprobs=2,
            prompt_logprobs=1,
            logprobs_mode="processed",
        ),
        "banned": banned,
    }
    core = EngineCore(engine)
    ids = tokenizer.encode("Once upon a time")
    for i, (request_id, params) in enumerate(cases.items()):
        prompt = ids if i % 2 else np.asarray(ids, dtype=np.int32)
        wire = decode(encode(Kind.ADD, [request_id, prompt, params_to_wire(params), 0.0]))[1]
        assert core.add_request(*wire) is None
    held = {group.request_id: group for group in engine.scheduler.waiting}
    for request_id, params in cases.items():
        kind = RequestOutputKind.DELTA
        if request_id == "best_of":
            kind = RequestOutputKind.FINAL_ONLY
        # A request without a logprobs_mode takes the engine's (--logprobs-mode, raw_logprobs).
        mode = params.logprobs_mode or "raw_logprobs"
        expected = dataclasses.replace(params, stop=[], output_kind=kind, logprobs_mode=mode)
        got = held[request_id].sampling_params
        assert got == expected, request_id
        assert got.bad_words_token_ids == params.bad_words_token_ids
        assert engine.output_processor.requests[request_id].output_kind is kind
        prompt_ids = held[request_id].seqs[0].prompt_token_ids
        assert prompt_ids == ids and all(type(t) is int for t in prompt_ids)
    core.abort_requests(list(cases))
    assert not core.has_work()


def test_core_wire_deltas_equal_the_request_output_path_for_a_mixed_batch(stories_llm):
    """``engine.step(token_deltas=True)`` (the core's path: deltas built from the sequences,
    short ones for plain decode steps) against the old path, ``encode_output`` of each
    DELTA ``RequestOutput``: step by step, the same deltas once decoded, short ones read as
    "times and cached count unchanged". Step times differ between the runs: only which of
    them are set is compared."""
    engine = stories_llm.llm_engine
    tokenizer = stories_llm.get_tokenizer()
    requests = {
        "plain": SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
        "n2": SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=6, ignore_eos=True),
        "logprobs": SamplingParams(temperature=0, max_tokens=5, logprobs=2, prompt_logprobs=1),
        "short": SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
        "best_of": SamplingParams(n=1, best_of=3, temperature=1.0, seed=5, max_tokens=4),
        "aborted": SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    }

    def run(step) -> tuple[list[list], list[bool]]:
        core = EngineCore(engine)
        core.reset_prefix_cache()  # both runs schedule (and cache) the same
        for i, (request_id, params) in enumerate(requests.items()):
            ids = tokenizer.encode(PROMPTS[i % len(PROMPTS)])
            assert core.add_request(request_id, ids, params_to_wire(params), 1.5) is None
        steps, short, last = [], [], {}
        while core.has_work():
            if len(steps) == 3:
                core.abort_requests(["aborted"])
            outputs = decode(encode(Kind.OUTPUTS, [step(core), {}]))[1][0]
            steps.append([_normalized(wire, last) for wire in outputs])
            short += [len(wire) == 2 for wire in outputs]
        return steps, short

    new, short = run(lambda core: core.step()[0])
    old, _ = run(lambda core: [encode_output(output) for output in core.engine.step()])
    assert any(short) and not all(short)  # both forms were sent
    assert new == old
    finished = [d.request_id for step in new for d in step if d.finished]
    assert sorted(finished) == sorted(set(requests) - {"aborted"})
    (final_best_of,) = [d for step in new for d in step if d.request_id == "best_of"]
    assert final_best_of.finished and len(final_best_of.completions[0].token_ids) == 4
    assert any(d.prompt_logprobs for step in new for d in step if d.request_id == "logprobs")


def _normalized(wire: list, last: dict):
    """A decoded delta, a short one completed with its request's last times and cached count;
    times reduced to which of them are set."""
    delta = decode_output(wire)
    if delta.times is None:
        delta.num_cached_tokens, delta.times = last[delta.request_id]
    last[delta.request_id] = (delta.num_cached_tokens, delta.times)
    delta.times = [t is not None for t in delta.times]
    return delta
