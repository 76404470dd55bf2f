"""Memory management end to end on stories260k: prefix caching, swap vs recompute preemption,
parallel sampling with copy-on-write, abort of forked and swapped requests, stats.

References: the same engine without the feature (prefix caching off, ample memory) and, for
cumulative log-probabilities, HF transformers (PyTorch) scoring the returned tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from tests.conftest import SMALL_ENGINE

BLOCK_SIZE = 16


def _random_prompt(n, seed):
    rng = np.random.default_rng(seed)
    return [1, *rng.integers(3, 512, size=n - 1).tolist()]


def _greedy(llm, prompts, max_tokens=8):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return outputs


class _CountComputedTokens:
    """Wraps the scheduler's `schedule` to sum the tokens each request computes."""

    def __init__(self, engine):
        self.per_seq: dict[str, int] = {}
        schedule = engine.scheduler.schedule

        def counting_schedule():
            out = schedule()
            for item in out.scheduled:
                key = item.seq.group.request_id
                self.per_seq[key] = self.per_seq.get(key, 0) + item.num_new_tokens
            return out

        engine.scheduler.schedule = counting_schedule


@pytest.fixture(scope="module")
def tight_llm():
    # Prefix caching off and 12 blocks: the reference for prefix caching (outputs do not depend
    # on memory), and tight enough to force preemption (6 requests x up to 80 tokens need ~30
    # blocks at once). swap_space 0.01 GiB holds ~500 host blocks of stories260k.
    return LLM(
        dtype="float32",
        num_gpu_blocks_override=12,
        swap_space=0.01,
        enable_prefix_caching=False,
        **SMALL_ENGINE,
    )


def test_prefix_caching_keeps_greedy_outputs_and_second_pass_computes_only_uncached_tokens(
    stories_llm, tight_llm
):
    base = _random_prompt(40, seed=10)  # 2 full blocks + 8 tokens
    prompts = {
        "nothing": _random_prompt(37, seed=11),
        "partial_block": base[:8] + _random_prompt(30, seed=12)[1:],
        "two_full_blocks": base[:32] + _random_prompt(9, seed=13)[1:],
        "exactly_two_blocks": base[:32],
        "whole_prompt": list(base),
    }
    names = list(prompts)
    expected = [o.outputs[0].token_ids for o in _greedy(tight_llm, [base, *prompts.values()])]

    engine = stories_llm.llm_engine
    stories_llm.reset_prefix_cache()
    assert _greedy(stories_llm, [base])[0].outputs[0].token_ids == expected[0]
    counter = _CountComputedTokens(engine)
    first = _greedy(stories_llm, list(prompts.values()))
    assert [o.outputs[0].token_ids for o in first] == expected[1:]
    # Hits on the base prompt: whole blocks only, never the last token.
    hits = {
        "nothing": 0,
        "partial_block": 0,
        "two_full_blocks": 32,
        "exactly_two_blocks": 16,
        "whole_prompt": 32,
    }
    assert {n: o.num_cached_tokens for n, o in zip(names, first, strict=True)} == hits

    counter.per_seq.clear()
    second = _greedy(stories_llm, list(prompts.values()))
    assert [o.outputs[0].token_ids for o in second] == expected[1:]
    for name, output in zip(names, second, strict=True):
        prompt_len = len(prompts[name])
        cached = (prompt_len - 1) // BLOCK_SIZE * BLOCK_SIZE  # everything cached after pass 1
        assert output.num_cached_tokens == cached, name
        # The uncached prompt tokens, then one decode per output token after the first.
        assert counter.per_seq[output.request_id] == prompt_len - cached + 7, name
    stats = engine.get_stats()
    assert stats.prefix_cache_hits > 0 and stats.prefix_cache_queries >= stats.prefix_cache_hits
    engine.kv_cache_manager.check_invariants([])


def test_swap_recompute_and_ample_memory_give_the_same_greedy_outputs(stories_llm, tight_llm):
    prompts = [_random_prompt(n, seed=20 + n) for n in (30, 12, 25, 40, 9, 18)]
    ample = [o.outputs[0].token_ids for o in _greedy(stories_llm, prompts, max_tokens=40)]
    engine = tight_llm.llm_engine
    kv, scheduler = engine.kv_cache_manager, engine.scheduler
    num_cpu_blocks = kv.num_cpu_blocks
    assert num_cpu_blocks > 100
    for mode in ("swap", "recompute"):
        scheduler.preemption_mode = mode  # one engine (one set of compiled buckets) for both
        before = dict(scheduler.num_preemptions_by_mode)
        outputs = _greedy(tight_llm, prompts, max_tokens=40)
        assert [o.outputs[0].token_ids for o in outputs] == ample, mode
        assert scheduler.num_preemptions_by_mode[mode] > before[mode], mode
        assert kv.num_free_blocks == 12 and kv.num_free_cpu_blocks == num_cpu_blocks
        kv.check_invariants([], [])


def test_parallel_samples_under_swap_pressure_equal_those_with_ample_memory(stories_llm, tight_llm):
    tight_llm.llm_engine.scheduler.preemption_mode = None  # vLLM's rule: swap for n > 1
    prompts = ["Once upon a time", "The little dog", "Lily and Ben"]
    params = SamplingParams(n=3, temperature=0.9, max_tokens=40, seed=5, ignore_eos=True)
    ample = stories_llm.generate(prompts, params, use_tqdm=False)
    before = tight_llm.llm_engine.scheduler.num_preemptions_by_mode["swap"]
    tight = tight_llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(ample, tight, strict=True):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert tight_llm.llm_engine.scheduler.num_preemptions_by_mode["swap"] > before
    kv = tight_llm.llm_engine.kv_cache_manager
    assert kv.num_free_blocks == 12 and kv.num_free_cpu_blocks == kv.num_cpu_blocks


def test_n4_seeded_samples_differ_reproduce_and_share_the_prompt_blocks(stories_llm):
    engine = stories_llm.llm_engine
    stories_llm.reset_prefix_cache()
    prompt = _random_prompt(40, seed=30)  # 2 full blocks + 8 tokens
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=123, ignore_eos=True)
    kv = engine.kv_cache_manager
    engine.add_request("fork", {"prompt_token_ids": prompt}, params)
    used = []
    while engine.has_unfinished_requests():
        engine.step()
        used.append(kv.num_blocks - kv.num_free_blocks)
    # Step 1 computes 39 prompt tokens (3 blocks); step 2 forks: each sample copies the partly
    # filled 3rd block on write, so 2 shared full blocks + 4 private ones. Unshared, the four
    # samples would hold 4 * 3 = 12 blocks.
    assert used[:2] == [3, 2 + 4]
    first = stories_llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    again = stories_llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    tokens = [c.token_ids for c in first.outputs]
    assert [c.index for c in first.outputs] == [0, 1, 2, 3]
    assert len({tuple(t) for t in tokens}) == 4
    assert tokens == [c.token_ids for c in again.outputs]
    single = SamplingParams(n=1, temperature=1.0, max_tokens=12, seed=123, ignore_eos=True)
    (alone,) = stories_llm.generate([{"prompt_token_ids": prompt}], single, use_tqdm=False)
    assert alone.outputs[0].token_ids == tokens[0]  # sample 0 keeps the request's seed
    assert kv.num_free_blocks == kv.num_blocks


def test_best_of_returns_the_n_samples_with_the_highest_cumulative_logprob(
    stories_llm, stories_dir
):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    prompt = _random_prompt(10, seed=40)
    all_four = SamplingParams(n=4, temperature=1.0, max_tokens=10, seed=9, ignore_eos=True)
    best_two = SamplingParams(
        n=2, best_of=4, temperature=1.0, max_tokens=10, seed=9, ignore_eos=True
    )
    (full,) = stories_llm.generate([{"prompt_token_ids": prompt}], all_four, use_tqdm=False)
    (top,) = stories_llm.generate([{"prompt_token_ids": prompt}], best_two, use_tqdm=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float32)
    scores = []
    with torch.no_grad():
        for completion in full.outputs:
            ids = torch.tensor([prompt + completion.token_ids])
            logprobs = torch.log_softmax(model(ids, use_cache=False).logits[0], dim=-1)
            positions = range(len(prompt) - 1, ids.shape[1] - 1)
            scores.append(sum(float(logprobs[p, ids[0, p + 1]]) for p in positions))
    ranked = [full.outputs[i].token_ids for i in np.argsort(scores)[::-1][:2]]
    assert [c.token_ids for c in top.outputs] == ranked
    assert [c.index for c in top.outputs] == [0, 1]


@pytest.mark.parametrize("state", ["waiting", "forked", "swapped"])
def test_abort_of_forked_or_swapped_request_frees_everything_and_reports_abort(tight_llm, state):
    engine = tight_llm.llm_engine
    kv, scheduler = engine.kv_cache_manager, engine.scheduler
    scheduler.preemption_mode = None
    params = SamplingParams(n=3, temperature=1.0, max_tokens=30, seed=1, ignore_eos=True)
    engine.add_request("victim", {"prompt_token_ids": _random_prompt(20, seed=50)}, params)
    if state != "waiting":
        for _ in range(3):
            engine.step()
        assert len(scheduler.requests["victim"].seqs) == 3
    if state == "swapped":
        assert scheduler.preempt("victim") == "swap"
    output = engine.abort_request("victim")
    assert output.finished and {c.finish_reason for c in output.outputs} == {"abort"}
    assert len(output.outputs) == (1 if state == "waiting" else 3)
    engine.step()  # runs (or drops) whatever block moves were pending
    assert not engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks and kv.num_free_cpu_blocks == kv.num_cpu_blocks
    kv.check_invariants([], [])


def test_stats_snapshot_names_follow_vllm_metrics(stories_llm):
    engine = stories_llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=4)
    engine.add_request("s1", {"prompt_token_ids": _random_prompt(20, seed=60)}, params)
    engine.add_request("s2", {"prompt_token_ids": _random_prompt(20, seed=61)}, params)
    stats = engine.get_stats()
    assert (stats.num_requests_running, stats.num_requests_waiting) == (0, 2)
    engine.step()
    stats = engine.get_stats()
    assert (stats.num_requests_running, stats.num_requests_waiting) == (2, 0)
    assert stats.kv_cache_usage_perc == 4 / stats.num_gpu_blocks  # 2 blocks each
    assert (stats.kv_cache_tokens_stored, stats.kv_cache_slots_held) == (40, 64)
    assert stats.kv_cache_fragmentation == pytest.approx(1 - 40 / 64)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_stats().kv_cache_usage_perc == 0.0
