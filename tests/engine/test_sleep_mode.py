"""Sleep mode (vLLM's): sleep frees the KV cache (level 2 also the weights), wake_up restores it
at the compiled shapes; errors leave the engine serving."""

from __future__ import annotations

import logging
import os

import jax
import pytest
import safetensors.numpy

from jaxpaged import LLM, SamplingParams
from jaxpaged.sequence import EngineSleepingError
from jaxpaged.worker.compilation_cache import CompileCounter
from jaxpaged.worker.weight_update import device_bytes_in_use
from tests.conftest import SMALL_ENGINE


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", enable_sleep_mode=True, **SMALL_ENGINE)


def _greedy_matches(llm, golden) -> bool:
    prompts = [{"prompt_token_ids": c["prompt_ids"]} for c in golden["cases"]]
    params = SamplingParams(temperature=0, max_tokens=golden["max_new_tokens"], ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs] == [
        c["greedy_new_ids"] for c in golden["cases"]
    ]


def _kv_bytes(llm) -> int:
    worker = llm.llm_engine.worker
    return worker.num_gpu_blocks * worker.kv_cache_spec.bytes_per_block


def test_sleep_level_1_frees_the_kv_cache_and_wake_up_restores_it_without_compiling(llm, golden):
    assert _greedy_matches(llm, golden)
    runner = llm.llm_engine.worker.model_runner
    compiled = runner.num_compilations
    device = jax.devices()[0]
    awake = device_bytes_in_use(device)
    llm.sleep(level=1)
    assert llm.is_sleeping()
    assert awake - device_bytes_in_use(device) >= _kv_bytes(llm)
    with pytest.raises(EngineSleepingError, match="wake_up"):
        llm.generate("Once upon a time", use_tqdm=False)
    with CompileCounter() as counter:
        llm.wake_up()
        assert not llm.is_sleeping()
        assert device_bytes_in_use(device) - awake < 0.01 * _kv_bytes(llm)
        assert _greedy_matches(llm, golden)
    assert counter.requests == 0  # no step, and not even the cache's fill, compiles again
    assert runner.num_compilations == compiled


def test_sleep_level_2_frees_the_weights_until_update_weights(llm, golden, stories_dir):
    device = jax.devices()[0]
    weights = sum(x.nbytes for x in jax.tree.leaves(llm.get_weights()))
    awake = device_bytes_in_use(device)
    llm.sleep(level=2)
    assert awake - device_bytes_in_use(device) >= _kv_bytes(llm) + weights
    with pytest.raises(RuntimeError, match="sleep"):
        llm.get_weights()
    llm.wake_up(tags=["kv_cache"])
    with pytest.raises(EngineSleepingError, match="update_weights"):
        llm.generate("Once upon a time", use_tqdm=False)
    hf = safetensors.numpy.load_file(os.path.join(stories_dir, "model.safetensors"))
    llm.update_weights(hf)
    assert _greedy_matches(llm, golden)


def test_wake_up_without_sleep_and_sleeping_twice_are_no_ops_with_a_warning(llm, golden, caplog):
    with caplog.at_level(logging.WARNING):
        llm.wake_up()
    assert "not sleeping" in caplog.text
    assert _greedy_matches(llm, golden)
    llm.sleep(1)
    with caplog.at_level(logging.WARNING):
        llm.sleep(2)  # already sleeping: the level-1 sleep stands (vLLM's warning)
    assert "already sleeping" in caplog.text
    llm.wake_up()
    assert _greedy_matches(llm, golden)


def test_bad_sleep_calls_are_refused_and_the_engine_still_serves(llm, golden):
    with pytest.raises(ValueError, match="level must be 1 or 2"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="tags"):
        llm.wake_up(tags=["everything"])
    engine = llm.llm_engine
    case = golden["cases"][1]
    params = SamplingParams(temperature=0, max_tokens=golden["max_new_tokens"], ignore_eos=True)
    engine.add_request("running", {"prompt_token_ids": case["prompt_ids"]}, params)
    engine.step()
    with pytest.raises(RuntimeError, match="unfinished"):
        llm.sleep(1)
    assert not llm.is_sleeping()
    tokens = []
    while engine.has_unfinished_requests():
        tokens = [list(o.outputs[0].token_ids) for o in engine.step() if o.finished] or tokens
    assert tokens == [case["greedy_new_ids"]]
    assert _greedy_matches(llm, golden)


def test_sleep_needs_enable_sleep_mode(stories_llm):
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        stories_llm.sleep(1)
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        stories_llm.wake_up()
    assert not stories_llm.is_sleeping()
