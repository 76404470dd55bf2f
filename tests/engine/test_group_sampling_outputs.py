"""Sequence groups through the output processor on stories260k: per-sample logprobs and
cumulative logprobs, stop strings ending single samples, streaming of n > 1, and prompt
logprobs bypassing the prefix cache.

References: the model's own reported logprobs (summed independently here), runs of the same
request without the feature (n = 1, no prefix cache), and the tokenizer's decode.
"""

from __future__ import annotations

import math

import numpy as np

from jaxpaged import SamplingParams
from jaxpaged.sampling_params import RequestOutputKind


def _prompt(n, seed):
    rng = np.random.default_rng(seed)
    return {"prompt_token_ids": [1, *rng.integers(3, 512, size=n - 1).tolist()]}


def test_each_sample_reports_its_logprobs_and_their_sum(stories_llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=5, logprobs=2)
    (out,) = stories_llm.generate([_prompt(12, seed=1)], params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for completion in out.outputs:
        assert len(completion.logprobs) == len(completion.token_ids)
        chosen = [
            entry[token].logprob
            for entry, token in zip(completion.logprobs, completion.token_ids, strict=True)
        ]
        assert completion.cumulative_logprob == sum(chosen)
        assert all(len(entry) in (2, 3) for entry in completion.logprobs)
    # Without logprobs, vLLM v1 reports no cumulative logprob.
    plain = SamplingParams(n=2, temperature=1.0, max_tokens=4, seed=5)
    (out,) = stories_llm.generate([_prompt(12, seed=1)], plain, use_tqdm=False)
    assert [c.cumulative_logprob for c in out.outputs] == [None, None]


def test_best_of_picks_the_sample_with_the_highest_reported_cumulative_logprob(stories_llm):
    prompt = _prompt(10, seed=2)
    all_four = SamplingParams(n=4, temperature=1.0, max_tokens=6, seed=7, logprobs=0)
    best = SamplingParams(n=1, best_of=4, temperature=1.0, max_tokens=6, seed=7, logprobs=0)
    (full,) = stories_llm.generate([prompt], all_four, use_tqdm=False)
    (top,) = stories_llm.generate([prompt], best, use_tqdm=False)
    winner = max(full.outputs, key=lambda c: c.cumulative_logprob)
    assert len(top.outputs) == 1 and top.outputs[0].index == 0
    assert top.outputs[0].token_ids == winner.token_ids
    assert math.isclose(top.outputs[0].cumulative_logprob, winner.cumulative_logprob)


def test_a_stop_string_ends_only_the_sample_that_produced_it(stories_llm):
    engine = stories_llm.llm_engine
    kv = engine.kv_cache_manager
    prompt = "Once upon a time"
    free = SamplingParams(n=4, temperature=1.0, max_tokens=30, seed=3, ignore_eos=True)
    (reference,) = stories_llm.generate([prompt], free, use_tqdm=False)
    # A stop string that some but not all samples produce (samples 0, 1 and 3 of this seed).
    hits = [" She" in c.text for c in reference.outputs]
    assert any(hits) and not all(hits), hits
    stopped = SamplingParams(
        n=4, temperature=1.0, max_tokens=30, seed=3, ignore_eos=True, stop=" She"
    )
    (out,) = stories_llm.generate([prompt], stopped, use_tqdm=False)
    for ref, got, hit in zip(reference.outputs, out.outputs, hits, strict=True):
        if hit:
            assert (got.finish_reason, got.stop_reason) == ("stop", " She")
            assert got.text == ref.text[: ref.text.index(" She")]
            assert ref.token_ids[: len(got.token_ids)] == got.token_ids
            assert len(got.token_ids) < len(ref.token_ids)
        else:
            assert (got.finish_reason, got.text) == ("length", ref.text)
            assert got.token_ids == ref.token_ids
    assert not engine.has_unfinished_requests()
    kv.check_invariants([], [])


def test_delta_streams_of_each_sample_add_up_to_its_final_output(stories_llm):
    engine = stories_llm.llm_engine
    prompt = _prompt(9, seed=3)
    kwargs = dict(n=2, temperature=1.0, max_tokens=7, seed=11, ignore_eos=True)
    engine.add_request(
        "delta-n2", prompt, SamplingParams(output_kind=RequestOutputKind.DELTA, **kwargs)
    )
    deltas = []
    while engine.has_unfinished_requests():
        deltas += [o for o in engine.step() if o.request_id == "delta-n2"]
    (final,) = stories_llm.generate([prompt], SamplingParams(**kwargs), use_tqdm=False)
    for index, completion in enumerate(final.outputs):
        streamed = [d.outputs[index] for d in deltas]
        assert {c.index for c in streamed} == {index}
        assert sum((c.token_ids for c in streamed), []) == completion.token_ids
        assert "".join(c.text for c in streamed) == completion.text
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]


def test_prompt_logprobs_requests_read_no_cached_prefix_but_fill_the_cache(stories_llm):
    stories_llm.reset_prefix_cache()
    prompt = _prompt(40, seed=4)  # 2 full blocks of 16 + 8 tokens
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    (first,) = stories_llm.generate([prompt], with_logprobs, use_tqdm=False)
    (second,) = stories_llm.generate([prompt], with_logprobs, use_tqdm=False)
    (third,) = stories_llm.generate([prompt], plain, use_tqdm=False)
    assert first.num_cached_tokens == second.num_cached_tokens == 0
    assert second.prompt_logprobs == first.prompt_logprobs
    assert first.prompt_logprobs[0] is None
    assert all(entry is not None for entry in first.prompt_logprobs[1:])
    assert third.num_cached_tokens == 32  # the blocks the logprobs requests computed
    assert third.outputs[0].token_ids == first.outputs[0].token_ids
