"""A bad request is refused with a ValueError naming the limit and never disturbs the others."""

from __future__ import annotations

import pytest

from jaxpaged import SamplingParams


def test_bad_request_mid_run_leaves_running_requests_and_blocks_intact(stories_llm, golden):
    engine = stories_llm.llm_engine
    case = golden["cases"][1]
    params = SamplingParams(temperature=0.0, max_tokens=golden["max_new_tokens"])
    free_at_start = engine.kv_cache_manager.num_free_blocks
    engine.add_request("good", {"prompt_token_ids": case["prompt_ids"]}, params, final_only=True)
    engine.step()
    engine.step()
    used_mid_run = engine.kv_cache_manager.num_free_blocks
    max_model_len = engine.config.scheduler_config.max_model_len
    too_long = {"prompt_token_ids": [1] * max_model_len}
    with pytest.raises(ValueError, match=f"prompt has {max_model_len} tokens; max_model_len is"):
        engine.add_request("too-long", too_long, params)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", {"prompt_token_ids": [1]}, params)
    assert engine.kv_cache_manager.num_free_blocks == used_mid_run
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (final,) = [o for o in outputs if o.finished]
    assert final.request_id == "good"
    assert final.outputs[0].token_ids == case["greedy_new_ids"]
    assert engine.kv_cache_manager.num_free_blocks == free_at_start


def test_abort_frees_blocks_and_reports_abort(stories_llm):
    engine = stories_llm.llm_engine
    free_at_start = engine.kv_cache_manager.num_free_blocks
    engine.add_request("doomed", "Once upon a time", SamplingParams(max_tokens=50))
    engine.step()
    assert engine.kv_cache_manager.num_free_blocks < free_at_start
    output = engine.abort_request("doomed")
    assert output.finished and output.outputs[0].finish_reason == "abort"
    assert engine.kv_cache_manager.num_free_blocks == free_at_start
    assert engine.abort_request("doomed") is None
    assert not engine.has_unfinished_requests()
