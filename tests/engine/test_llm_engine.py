"""The paged engine against an independent, cache-free reference, and its scheduling behaviour.

The reference is HF transformers (PyTorch) run without any KV cache (``use_cache=False``): each
greedy step recomputes the whole sequence, so nothing about paging can hide in it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxpaged import LLM, SamplingParams
from jaxpaged.sample.metadata import SamplerVariant
from tests.conftest import SMALL_ENGINE

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 16
# Lengths 1, block_size-1, block_size, block_size+1 and several blocks: the edges of a block.
PROMPT_LENGTHS = (1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 3 * BLOCK_SIZE + 5)
MAX_TOKENS = 20


def _random_prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    # ids 3.. skip <unk>, <s>, </s>; BOS first as the tokenizer would add it.
    return [[1, *rng.integers(3, 512, size=n - 1).tolist()] for n in lengths]


def _hf_greedy_without_cache(model_dir, prompts, max_tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    results = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_tokens):
                logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1]
                ids.append(int(torch.argmax(logits)))
            results.append(ids[len(prompt) :])
    return results


@pytest.fixture(scope="module")
def reference_outputs(stories_dir):
    prompts = _random_prompts(PROMPT_LENGTHS)
    return prompts, _hf_greedy_without_cache(stories_dir, prompts, MAX_TOKENS)


def _greedy(llm, prompts, max_tokens=MAX_TOKENS):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def _poison_kv_cache_with_nan(llm):
    llm.llm_engine.worker.reset_kv_caches(fill_value=jnp.nan)
    llm.reset_prefix_cache()  # the cached prefixes' K/V are gone


def test_paged_engine_equals_cache_free_reference_across_block_boundaries(
    stories_llm, reference_outputs
):
    prompts, expected = reference_outputs
    assert _greedy(stories_llm, prompts) == expected


def test_nan_in_unused_and_stale_cache_slots_changes_nothing(stories_llm, reference_outputs):
    prompts, expected = reference_outputs
    _poison_kv_cache_with_nan(stories_llm)
    assert _greedy(stories_llm, prompts) == expected
    # Run again: freed blocks now hold stale data of earlier requests, plus NaN elsewhere.
    assert _greedy(stories_llm, prompts[::-1]) == expected[::-1]


def test_float32_batch_invariance_alone_batched_and_arriving_mid_decode(stories_llm):
    prompts = _random_prompts((7, 23, 40, 2), seed=1)
    alone = [_greedy(stories_llm, [p])[0] for p in prompts]
    assert _greedy(stories_llm, prompts) == alone

    engine = stories_llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.add_request("early", {"prompt_token_ids": prompts[0]}, params, final_only=True)
    finished = {}
    for step in range(200):
        if step == 5:  # the others arrive while "early" is decoding
            for i, p in enumerate(prompts[1:], start=1):
                engine.add_request(f"late{i}", {"prompt_token_ids": p}, params, final_only=True)
        for out in engine.step():
            finished[out.request_id] = out.outputs[0].token_ids
        if len(finished) == len(prompts):
            break
    assert finished["early"] == alone[0]
    assert [finished[f"late{i}"] for i in range(1, len(prompts))] == alone[1:]


def test_recompute_preemption_gives_the_same_outputs_as_ample_memory(stories_llm):
    prompts = _random_prompts((30, 12, 25, 40, 9, 18), seed=2)
    ample = _greedy(stories_llm, prompts, max_tokens=40)
    # 6 requests x up to 80 tokens need ~30 blocks at once; 12 force repeated preemption.
    small = LLM(dtype="float32", num_gpu_blocks_override=12, **SMALL_ENGINE)
    assert _greedy(small, prompts, max_tokens=40) == ample
    engine = small.llm_engine
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_cache_manager.num_free_blocks == 12
    engine.kv_cache_manager.check_invariants()


# What a greedy request without extras compiles: no beam candidates, no optional sampler stage.
PLAIN = dict(num_beam_candidates=0, variant=SamplerVariant())


def test_compilations_stay_within_bucket_count_and_steady_state_never_traces(stories_llm):
    runner = stories_llm.llm_engine.worker.model_runner
    num_buckets = len(runner.all_bucket_keys())
    runner.compile_all(show_progress=False)  # start-up compilation (lazy on CPU by default)
    # The engine is shared: other tests may have compiled sampler variants or beam steps too.
    default = {key for key in runner._executables if key == dataclasses.replace(key, **PLAIN)}
    assert default == set(runner.all_bucket_keys())
    compiled = runner.num_compilations
    prompts = _random_prompts((5, 33, 60, 17, 3, 9, 44, 21, 30), seed=3)
    with jax.no_tracing(True):
        _greedy(stories_llm, prompts, max_tokens=12)
    assert runner.num_compilations == compiled
    assert num_buckets == len(runner.seq_buckets) + len(runner.token_buckets)


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    requests=st.lists(
        st.tuples(st.integers(1, 50), st.integers(1, 30), st.integers(0, 6)),
        min_size=1,
        max_size=7,
    ),
    num_blocks=st.integers(6, 20),
)
def test_random_request_streams_keep_block_invariant_and_free_every_block(
    small_block_llm, requests, num_blocks
):
    """Random prompts, lengths and arrival steps on a tight, randomly sized KV cache."""
    engine = small_block_llm.llm_engine
    engine.kv_cache_manager.__init__(num_blocks, BLOCK_SIZE)  # fresh pool of a random size
    engine.scheduler.kv_cache_manager = engine.kv_cache_manager
    rng = np.random.default_rng(len(requests))
    pending = sorted(
        (arrival, f"r{i}", [1, *rng.integers(3, 512, size=plen - 1).tolist()], max_tokens)
        for i, (plen, max_tokens, arrival) in enumerate(requests)
    )
    done = {}
    for step in range(2000):
        while pending and pending[0][0] <= step:
            _, rid, prompt, max_tokens = pending.pop(0)
            engine.add_request(
                rid,
                {"prompt_token_ids": prompt},
                SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                final_only=True,
            )
        for out in engine.step():
            done[out.request_id] = out
        engine.kv_cache_manager.check_invariants()
        if not pending and not engine.has_unfinished_requests():
            break
    assert len(done) == len(requests)
    assert all(
        len(o.outputs[0].token_ids) == requests[int(o.request_id[1:])][1] for o in done.values()
    )
    assert engine.kv_cache_manager.num_free_blocks == num_blocks


@pytest.fixture(scope="module")
def small_block_llm():
    # The largest prompt+output (80 tokens = 5 blocks) must fit in the smallest pool (6 blocks).
    return LLM(dtype="float32", num_gpu_blocks_override=20, **SMALL_ENGINE)
