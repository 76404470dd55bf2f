"""The engine with ``kv_cache_dtype="fp8"`` on stories260k (float32 compute).

- Block count: a fixed byte budget holds exactly 4x the float32 blocks and 2x the bf16 ones.
- Quality: teacher-forced along golden.json's greedy continuations, the FP8-cache engine's top-1
  token and the logprob of the golden token against the float32-cache engine (docs/quantization.md
  reports the numbers; the bounds here leave a margin over them).
- Memory management: prefix caching, swap and recompute preemption and n > 1 on a tight FP8
  engine give the same tokens as an ample FP8 engine, and every block comes back.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxpaged import LLM, EngineArgs, SamplingParams
from jaxpaged.worker.worker import Worker
from tests.conftest import SMALL_ENGINE


@pytest.fixture(scope="module")
def fp8_llm():
    return LLM(dtype="float32", kv_cache_dtype="fp8", **SMALL_ENGINE)


def test_bad_kv_cache_dtype_and_calculate_kv_scales_are_refused_by_name():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \['auto', 'fp8', "):
        EngineArgs(kv_cache_dtype="int8").create_engine_config()
    with pytest.raises(ValueError, match="calculate_kv_scales is not supported yet"):
        EngineArgs(kv_cache_dtype="fp8", calculate_kv_scales=True).create_engine_config()


def test_a_byte_budget_holds_2x_the_bf16_blocks_and_4x_the_float32_blocks():
    budget = 3 * 5 * 16 * 4 * 8 * 2 * 4 * 7  # 21 float32 blocks (5 layers, Hkv 4, D 8)
    blocks, reports = {}, {}
    for dtype, kv_cache_dtype in [("float32", "auto"), ("bfloat16", "auto"), ("float32", "fp8")]:
        config = EngineArgs(
            dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=budget,
            **SMALL_ENGINE,
        ).create_engine_config()  # fmt: skip
        worker = Worker(config, show_progress=False)
        worker.load_model()
        blocks[dtype, kv_cache_dtype] = worker.num_gpu_blocks = worker.determine_num_blocks()
        reports[dtype, kv_cache_dtype] = worker.kv_cache_report()
    assert blocks["float32", "auto"] == 21
    assert blocks["bfloat16", "auto"] == 42 and blocks["float32", "fp8"] == 84
    assert reports["float32", "fp8"].startswith("KV cache: ")
    assert "84 blocks of 16 tokens = 1344 tokens in float8_e4m3fn" in reports["float32", "fp8"]


def _teacher_forced(llm, golden):
    """Per golden case, ``(top-1 token, logprob of the golden token)`` at each generated
    position, with the prompt plus the golden continuation fed as one prompt."""
    cases = golden["cases"]
    prompts = [{"prompt_token_ids": c["prompt_ids"] + c["greedy_new_ids"]} for c in cases]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    rows = []
    for case, out in zip(cases, llm.generate(prompts, params, use_tqdm=False), strict=True):
        ids = case["prompt_ids"] + case["greedy_new_ids"]
        for i in range(len(case["prompt_ids"]), len(ids)):
            entry = out.prompt_logprobs[i]
            top = max(entry, key=lambda token: entry[token].logprob)
            rows.append((top, entry[ids[i]].logprob))
    return rows


@pytest.mark.parametrize(
    ("kv_cache_dtype", "min_agreement", "max_mean_drift"),
    # Measured: e4m3 157/160 and 0.043; e5m2 150/160 and 0.094 (docs/quantization.md).
    [("fp8", 0.95, 0.08), ("fp8_e5m2", 0.9, 0.15)],
)
def test_teacher_forced_agreement_with_the_float_cache(
    kv_cache_dtype, min_agreement, max_mean_drift, stories_llm, fp8_llm, golden
):
    if kv_cache_dtype == "fp8":
        llm = fp8_llm
    else:
        llm = LLM(dtype="float32", kv_cache_dtype=kv_cache_dtype, **SMALL_ENGINE)
    reference = _teacher_forced(stories_llm, golden)
    quantized = _teacher_forced(llm, golden)
    agreement = np.mean([a[0] == b[0] for a, b in zip(reference, quantized, strict=True)])
    drift = np.abs([a[1] - b[1] for a, b in zip(reference, quantized, strict=True)])
    assert agreement >= min_agreement
    assert 0 < drift.mean() <= max_mean_drift  # quantized (not exact), yet close


def _greedy(llm, prompts, max_tokens):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_prefix_caching_preemption_and_n_gt_1_work_on_an_fp8_cache(fp8_llm):
    rng = np.random.default_rng(7)
    shared = [1, *rng.integers(3, 512, 33).tolist()]  # 2 full blocks + 2 tokens
    prompts = [shared + rng.integers(3, 512, n).tolist() for n in (5, 14)]
    prompts += [[1, *rng.integers(3, 512, 20).tolist()], [1, 17, 42]]
    ample = _greedy(fp8_llm, prompts, 24)
    # 8 blocks of 16 tokens: the four requests (up to 62 tokens each) preempt each other.
    tight = LLM(
        dtype="float32", kv_cache_dtype="fp8", num_gpu_blocks_override=8, swap_space=0.01,
        **SMALL_ENGINE,
    )  # fmt: skip
    engine = tight.llm_engine
    kv, scheduler = engine.kv_cache_manager, engine.scheduler
    assert engine.worker.block_mover.host_cache.dtype == np.dtype("float8_e4m3fn")
    for mode in ("swap", "recompute"):
        scheduler.preemption_mode = mode
        before = scheduler.num_preemptions_by_mode[mode]
        assert _greedy(tight, prompts, 24) == ample, mode
        assert scheduler.num_preemptions_by_mode[mode] > before, mode
        assert kv.num_free_blocks == 8 and kv.num_free_cpu_blocks == kv.num_cpu_blocks
    assert engine.get_stats().prefix_cache_hits > 0
    # n > 1: copy-on-write of the shared last prompt block, under swap pressure.
    scheduler.preemption_mode = None
    params = SamplingParams(n=3, temperature=0.9, max_tokens=20, seed=5, ignore_eos=True)
    requests = ["Once upon a time there was", "The little dog"]
    expected = fp8_llm.generate(requests, params, use_tqdm=False)
    got = tight.generate(requests, params, use_tqdm=False)
    for a, b in zip(expected, got, strict=True):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert kv.num_free_blocks == 8 and kv.num_free_cpu_blocks == kv.num_cpu_blocks
    kv.check_invariants([], [])


def test_pallas_backend_reads_the_fp8_cache_like_the_reference_backend(fp8_llm, golden):
    llm = LLM(dtype="float32", kv_cache_dtype="fp8", attention_backend="pallas", **SMALL_ENGINE)
    prompts = [c["prompt_ids"] for c in golden["cases"][2:4]]  # ragged kernel, then decode
    assert _greedy(llm, prompts, 3) == _greedy(fp8_llm, prompts, 3)
