"""Async scheduling (the default) gives exactly the synchronous engine's outputs.

Both modes run on one engine (toggling ``async_scheduling`` reuses its compiled buckets), so
any difference comes from the step pipeline alone: placeholders, on-device token feed, stops
resolved one step late, aborts and preemption while a step is in flight.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.worker.model_runner import PLACEHOLDER_TOKEN_ID
from tests.conftest import SMALL_ENGINE


def _prompts(lengths, seed):
    rng = np.random.default_rng(seed)
    return [[1, *rng.integers(3, 512, size=n - 1).tolist()] for n in lengths]


def _run(llm, prompts, params, *, async_scheduling):
    engine = llm.llm_engine
    saved = engine.async_scheduling
    engine.async_scheduling = async_scheduling
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        engine.async_scheduling = saved
    return [
        (o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
        for o in outputs
    ]


def _mixed_params():
    return [
        SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12),
        SamplingParams(temperature=1.0, top_k=5, seed=3, max_tokens=25, ignore_eos=True),
        SamplingParams(temperature=0.7, min_p=0.05, seed=11, max_tokens=9),
        SamplingParams(temperature=0.0, max_tokens=30),
        SamplingParams(temperature=1.0, seed=5, max_tokens=1),
    ]


def test_async_outputs_equal_sync_for_greedy_and_seeded_filtered_sampling(stories_llm):
    prompts = _prompts((3, 15, 16, 17, 40, 1), seed=21)
    params = _mixed_params()
    sync = _run(stories_llm, prompts, params, async_scheduling=False)
    assert _run(stories_llm, prompts, params, async_scheduling=True) == sync
    assert all(PLACEHOLDER_TOKEN_ID not in tokens for tokens, _, _ in sync)


def test_stop_token_sampled_in_flight_ends_the_sequence_like_sync(stories_llm):
    prompts = _prompts((9, 30), seed=22)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    free_run = _run(stories_llm, prompts, greedy, async_scheduling=False)
    # Stop at a token the free run produces mid-way: the async engine learns it one step late.
    stop_id = free_run[0][0][6]
    params = SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_id]
    )
    sync = _run(stories_llm, prompts, params, async_scheduling=False)
    assert sync[0][1] == "stop" and sync[0][2] == stop_id
    assert _run(stories_llm, prompts, params, async_scheduling=True) == sync
    engine = stories_llm.llm_engine
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks


@pytest.fixture(scope="module")
def tight_llm():
    # 6 requests of up to 80 tokens need ~30 blocks at once; 12 force repeated preemption.
    return LLM(dtype="float32", num_gpu_blocks_override=12, **SMALL_ENGINE)


def test_async_preemption_by_recompute_equals_sync(tight_llm):
    prompts = _prompts((30, 12, 25, 40, 9, 18), seed=23)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1, max_tokens=40, ignore_eos=True)
    engine = tight_llm.llm_engine
    sync = _run(tight_llm, prompts, params, async_scheduling=False)
    before = engine.scheduler.num_preemptions
    assert _run(tight_llm, prompts, params, async_scheduling=True) == sync
    assert engine.scheduler.num_preemptions > before
    assert engine.kv_cache_manager.num_free_blocks == 12
    engine.kv_cache_manager.check_invariants()


def test_abort_while_step_in_flight_reports_real_tokens_and_frees_blocks(stories_llm):
    engine = stories_llm.llm_engine
    assert engine.async_scheduling
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    engine.add_request("inflight", {"prompt_token_ids": [1, 5, 9, 33]}, params)
    engine.add_request("other", {"prompt_token_ids": [1, 7, 8]}, params, final_only=True)
    for _ in range(3):
        engine.step()
    output = engine.abort_request("inflight")
    tokens = output.outputs[0].token_ids
    assert output.finished and output.outputs[0].finish_reason == "abort"
    assert tokens and PLACEHOLDER_TOKEN_ID not in tokens
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
    # The aborted request's tokens are a prefix of what it generates alone.
    alone = _run(stories_llm, [[1, 5, 9, 33]], params, async_scheduling=False)[0][0]
    assert alone[: len(tokens)] == tokens


def test_async_steady_state_with_filters_never_traces(stories_llm):
    runner = stories_llm.llm_engine.model_runner
    runner.compile_all(show_progress=False)
    compiled = runner.num_compilations
    prompts = _prompts((5, 33, 60, 17), seed=24)
    with jax.no_tracing(True):
        _run(stories_llm, prompts, _mixed_params()[:4], async_scheduling=True)
    assert runner.num_compilations == compiled
