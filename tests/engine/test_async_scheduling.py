"""Async scheduling (step N+1 launched before step N's tokens reach the host) against the
synchronous engine: the same tokens, logprobs, texts and finish reasons, with placeholders
resolved in order, through EOS and stop-string stops, preemption, prefix caching, parallel
sampling and beam search, and every block returned at the end."""

from __future__ import annotations

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.beam_search import BeamSearchParams
from tests.conftest import SMALL_ENGINE


def _prompts(lengths, seed):
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": [1, *rng.integers(3, 512, n - 1).tolist()]} for n in lengths]


def _rounded(logprobs):
    """Logprob entries to 4 decimals: a sequence that finished one step late still fills a row,
    so a step can fall in another batch bucket, whose kernels round differently in the last ulp."""
    if logprobs is None:
        return None
    return [
        None if entry is None else {k: (round(v.logprob, 4), v.rank) for k, v in entry.items()}
        for entry in logprobs
    ]


def _summary(outputs):
    return [
        [
            (
                c.token_ids,
                c.text,
                c.finish_reason,
                None if c.cumulative_logprob is None else round(c.cumulative_logprob, 3),
                _rounded(c.logprobs),
            )
            for c in o.outputs
        ]
        + [_rounded(o.prompt_logprobs)]
        for o in outputs
    ]


@pytest.fixture(scope="module")
def engines():
    sync = LLM(dtype="float32", **SMALL_ENGINE)
    async_ = LLM(dtype="float32", async_scheduling=True, **SMALL_ENGINE)
    return sync, async_


def _mixed_params():
    """Stop tokens, stop strings, seeds, penalties, logprobs and min_tokens: every stop rule and
    every sampler stage, in one batch (for the golden prompts, whose greedy texts are known)."""
    return [
        SamplingParams(temperature=0.0, max_tokens=60, stop_token_ids=[376]),  # " little"
        SamplingParams(temperature=0.8, seed=7, max_tokens=40, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=50, stop=[" big"], include_stop_str_in_output=True),
        SamplingParams(temperature=1.0, seed=3, top_p=0.9, top_k=20, max_tokens=30),
        SamplingParams(
            temperature=0.7, seed=11, presence_penalty=0.5, repetition_penalty=1.2, min_tokens=5,
            max_tokens=45, prompt_logprobs=1,
        ),
        SamplingParams(temperature=0.0, max_tokens=1),
    ]  # fmt: skip


def test_golden_greedy_outputs_are_exact_with_async_scheduling(engines, golden):
    _, llm = engines
    cases = golden["cases"]
    prompts = [{"prompt_token_ids": c["prompt_ids"]} for c in cases]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [c["greedy_new_ids"] for c in cases]


def test_every_stop_rule_and_sampler_stage_matches_the_synchronous_engine(engines, golden):
    sync, async_ = engines
    prompts = [{"prompt_token_ids": c["prompt_ids"]} for c in golden["cases"]]
    prompts.append(_prompts((9,), seed=1)[0])
    params = _mixed_params()
    expected = _summary(sync.generate(prompts, params, use_tqdm=False))
    assert _summary(async_.generate(prompts, params, use_tqdm=False)) == expected
    finish = [c[0][2] for c in expected]
    assert finish[0] == finish[2] == "stop" and finish[5] == "length"  # token and string stops
    manager = async_.llm_engine.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks
    manager.check_invariants()


def test_recompute_preemption_with_async_scheduling_matches_ample_memory(engines):
    sync, _ = engines
    prompts = _prompts((30, 12, 25, 40, 9, 18), seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = _summary(sync.generate(prompts, params, use_tqdm=False))
    small = LLM(dtype="float32", num_gpu_blocks_override=12, async_scheduling=True, **SMALL_ENGINE)
    assert _summary(small.generate(prompts, params, use_tqdm=False)) == expected
    engine = small.llm_engine
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_cache_manager.num_free_blocks == 12
    engine.kv_cache_manager.check_invariants()


def test_prefix_caching_parallel_sampling_and_beam_search_match(engines):
    sync, async_ = engines
    shared = _prompts((40,), seed=4)[0]["prompt_token_ids"]
    prompts = [{"prompt_token_ids": shared + [5 + i]} for i in range(3)]
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=20)
    for _ in range(2):  # the second pass reads the first pass's cached prefix blocks
        expected = _summary(sync.generate(prompts, params, use_tqdm=False))
        assert _summary(async_.generate(prompts, params, use_tqdm=False)) == expected
    assert async_.llm_engine.scheduler.prefix_cache_hits > 0
    beam = BeamSearchParams(beam_width=3, max_tokens=8)
    beam_prompts = [{"prompt_token_ids": p["prompt_token_ids"][:12]} for p in prompts[:2]]
    sync_beams = sync.beam_search(beam_prompts, beam)
    async_beams = async_.beam_search(beam_prompts, beam)
    assert [[s.tokens for s in r.sequences] for r in async_beams] == [
        [s.tokens for s in r.sequences] for r in sync_beams
    ]


def test_abort_while_a_step_is_in_flight_frees_everything(engines):
    _, llm = engines
    engine = llm.llm_engine
    for i, prompt in enumerate(_prompts((20, 30, 10), seed=6)):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=50))
    engine.step()
    engine.step()  # r* are decoding with a step in flight
    assert engine.step_in_flight_done() is not None
    engine.abort_request("r1")
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == {"r0", "r2"}
    while engine.step_in_flight_done() is not None:  # the pipeline drains on empty steps
        engine.step()
    manager = engine.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks
    manager.check_invariants()


def test_abort_of_a_request_finished_on_a_token_still_in_flight(engines):
    """The scheduler finishes a request by length on its in-flight placeholder before the
    output is emitted; aborting it then must not leak the placeholder (the server's disconnect
    path), and resolving the step must leave the aborted sequence alone."""
    _, llm = engines
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": [1, 2, 3, 4, 5]}, params)
    for _ in range(3):
        engine.step()
    output = engine.abort_request("a")
    assert output.finished and output.outputs[0].finish_reason == "abort"
    assert -1 not in output.outputs[0].token_ids and len(output.outputs[0].token_ids) == 2
    while engine.step_in_flight_done() is not None:
        engine.step()
    assert not engine.has_unfinished_requests()
    manager = engine.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks
    manager.check_invariants()


def test_a_reused_request_id_gets_none_of_the_aborted_requests_prompt_logprobs(engines):
    sync, llm = engines
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=1)
    engine.add_request("z", {"prompt_token_ids": list(range(1, 60))}, params)
    engine.step()  # the prefill is in flight
    engine.abort_request("z")
    short = {"prompt_token_ids": [1, 2, 3]}
    engine.add_request("z", short, params)
    finals = []
    while engine.has_unfinished_requests():
        finals += [out for out in engine.step() if out.finished]
    (expected,) = sync.generate([short], params, use_tqdm=False)
    assert _summary(finals) == _summary([expected])
