"""Multi-LoRA through ``LLM.generate`` against HF transformers + peft (``tests/data/lora``)."""

from __future__ import annotations

import jax
import pytest

import models.lora
from jaxpaged import LLM, SamplingParams
from jaxpaged.lora.request import LoRARequest
from tests.conftest import SMALL_ENGINE
from tests.lora.adapters import SPECS

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def lora_llm():
    # max_loras=2 slots for 3 adapters + base in flight; max_cpu_loras=2 makes the host LRU
    # evict and re-read; 12 KV blocks for 12 requests of ~2 blocks force preemption; async
    # scheduling (slots are written while the previous step may still run). The server test's
    # engine schedules synchronously. The fold layout (off by default, models.lora.LORA_FOLD)
    # is forced on, so these checks against peft run it; test_families_lora runs the default.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(models.lora, "LORA_FOLD", True)
        return _build_lora_llm()


def _build_lora_llm():
    return LLM(
        dtype="float32",
        async_scheduling=True,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        max_cpu_loras=2,
        num_gpu_blocks_override=12,
        **SMALL_ENGINE,
    )


def _mixed_batch(lora_requests, golden):
    """Every prompt under the base model and each adapter: prompts, requests, expected."""
    prompts, loras, expected = [], [], []
    for request, key in [(None, "base"), *((r, r.lora_name) for r in lora_requests)]:
        for prompt, tokens in zip(golden["prompts"], golden[key], strict=True):
            prompts.append({"prompt_token_ids": prompt})
            loras.append(request)
            expected.append(tokens)
    return prompts, loras, expected


def test_base_and_three_adapters_in_one_generate_match_peft(lora_llm, lora_requests, lora_golden):
    prompts, loras, expected = _mixed_batch(lora_requests, lora_golden)
    # Interleave so that every step sees more adapters than the 2 slots hold.
    order = sorted(range(len(prompts)), key=lambda i: (i % 3, i))
    outputs = lora_llm.generate(
        [prompts[i] for i in order],
        GREEDY,
        lora_request=[loras[i] for i in order],
        use_tqdm=False,
    )
    got = [list(out.outputs[0].token_ids) for out in outputs]
    assert got == [expected[i] for i in order]
    engine = lora_llm.llm_engine
    assert engine.scheduler.num_preemptions > 0  # preemption with adapters in flight
    manager = engine.lora_manager
    assert manager.slots.num_writes > len(SPECS)  # adapters were swapped through the 2 slots
    assert len(manager.host_ids) == 2
    manager.check_invariants()
    engine.kv_cache_manager.check_invariants()


def test_n_greater_than_one_samples_all_use_the_adapter(lora_llm, lora_requests, lora_golden):
    request = lora_requests[1]
    # top_k=1: every sample is the greedy continuation (greedy itself refuses n > 1).
    params = SamplingParams(n=3, temperature=1.0, top_k=1, max_tokens=12, ignore_eos=True)
    prompt = {"prompt_token_ids": lora_golden["prompts"][0]}
    (out,) = lora_llm.generate(prompt, params, lora_request=request, use_tqdm=False)
    assert len(out.outputs) == 3
    for completion in out.outputs:
        assert list(completion.token_ids) == lora_golden[request.lora_name][0]


def test_prefix_cache_is_keyed_by_adapter(lora_llm, lora_requests, lora_golden):
    lora_llm.reset_prefix_cache()
    prompt = {"prompt_token_ids": list(range(3, 40))}  # 2 full blocks of 16
    params = SamplingParams(temperature=0.0, max_tokens=2)
    first, second = lora_requests[0], lora_requests[2]
    (a,) = lora_llm.generate(prompt, params, lora_request=first, use_tqdm=False)
    (b,) = lora_llm.generate(prompt, params, lora_request=second, use_tqdm=False)
    (c,) = lora_llm.generate(prompt, params, lora_request=first, use_tqdm=False)
    (d,) = lora_llm.generate(prompt, params, use_tqdm=False)
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == 0  # another adapter's K/V must not be reused
    assert c.num_cached_tokens == 32  # the same adapter's are
    assert d.num_cached_tokens == 0  # nor the base model's
    assert a.outputs[0].token_ids == c.outputs[0].token_ids


def test_loading_swapping_unloading_adapters_never_compiles(
    lora_llm, lora_requests, lora_golden, tmp_path, stories_dir
):
    engine = lora_llm.llm_engine
    runner = engine.worker.model_runner
    runner.compile_all(show_progress=False)
    manager = engine.lora_manager
    prompts, loras, expected = _mixed_batch(lora_requests, lora_golden)
    lora_llm.generate(prompts[:2], GREEDY, lora_request=loras[:2], use_tqdm=False)  # warm-up
    compiled = runner.num_compilations
    lora_llm.reset_prefix_cache()
    # A fourth adapter, loaded while serving under a new id; then one of the others unloaded.
    extra = LoRARequest("extra", 9, lora_requests[2].lora_path)
    with jax.no_tracing(True):
        outputs = lora_llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected
        assert manager.remove_adapter(lora_requests[0].lora_int_id)
        (out,) = lora_llm.generate(prompts[-1], GREEDY, lora_request=extra, use_tqdm=False)
        assert list(out.outputs[0].token_ids) == expected[-1]
        assert manager.remove_adapter(extra.lora_int_id)
        # The unloaded adapter is read from its path again by the next request naming it.
        (out,) = lora_llm.generate(prompts[3], GREEDY, lora_request=loras[3], use_tqdm=False)
        assert list(out.outputs[0].token_ids) == expected[3]
    assert runner.num_compilations == compiled
    assert extra.lora_int_id not in manager.slot_ids
    # One device, float: the fold layout (``models.lora``) served all of the above.
    assert all(w.base_columns for layer in manager.slots.weights for w in layer.values())


def test_lora_request_without_enable_lora_is_refused(stories_llm, lora_requests):
    with pytest.raises(ValueError, match="enable_lora"):
        stories_llm.generate("Once", GREEDY, lora_request=lora_requests[0], use_tqdm=False)


def test_lora_request_list_of_wrong_length_is_refused(lora_llm, lora_requests):
    with pytest.raises(ValueError, match="2 lora_request for 1 prompts"):
        lora_llm.generate("Once", GREEDY, lora_request=lora_requests[:2], use_tqdm=False)


def test_adapter_id_reused_for_another_adapter_is_refused(lora_llm, lora_requests):
    lora_llm.llm_engine.add_lora(lora_requests[0])  # registered whatever ran before
    clash = LoRARequest("other-name", lora_requests[0].lora_int_id, lora_requests[1].lora_path)
    with pytest.raises(ValueError, match="lora_int_id 1 is already used"):
        lora_llm.generate("Once", GREEDY, lora_request=clash, use_tqdm=False)
