"""LLM.generate end to end on the real stories260k checkpoint (float32, paged engine)."""

from __future__ import annotations

import pytest

from jaxpaged import LLM, SamplingParams
from tests.conftest import SMALL_ENGINE


def test_greedy_continuations_equal_golden_with_all_prompts_together(stories_llm, golden):
    cases = golden["cases"]
    prompts = [{"prompt_token_ids": case["prompt_ids"]} for case in cases]
    params = SamplingParams(temperature=0.0, max_tokens=golden["max_new_tokens"])
    outputs = stories_llm.generate(prompts, params, use_tqdm=False)
    for case, output in zip(cases, outputs, strict=True):
        assert output.prompt_token_ids == case["prompt_ids"]
        assert output.outputs[0].token_ids == case["greedy_new_ids"], case["prompt"]
        assert output.outputs[0].finish_reason == "length"
        assert output.finished


def test_text_prompts_are_tokenized_like_golden_and_decoded(stories_llm, golden):
    cases = [c for c in golden["cases"] if c["prompt"]]
    params = SamplingParams(temperature=0.0, max_tokens=golden["max_new_tokens"])
    outputs = stories_llm.generate([c["prompt"] for c in cases], params, use_tqdm=False)
    for case, output in zip(cases, outputs, strict=True):
        assert output.prompt == case["prompt"]
        assert output.prompt_token_ids == case["prompt_ids"]
        assert output.outputs[0].text == case["new_text"]


def test_outputs_come_back_in_input_order_with_per_prompt_params(stories_llm):
    prompts = ["Once upon a time", "The cat", "Lily was"]
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in (3, 9, 5)]
    outputs = stories_llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outputs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 9, 5]


def test_stop_token_ids_end_generation_with_reason(stories_llm, golden):
    case = golden["cases"][0]
    stop_id = case["greedy_new_ids"][5]
    params = SamplingParams(temperature=0.0, max_tokens=32, stop_token_ids=[stop_id])
    (output,) = stories_llm.generate(
        [{"prompt_token_ids": case["prompt_ids"]}], params, use_tqdm=False
    )
    completion = output.outputs[0]
    first = case["greedy_new_ids"].index(stop_id)
    assert completion.token_ids == case["greedy_new_ids"][: first + 1]
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == stop_id


def test_seeded_sampling_is_reproducible_and_seeds_differ(stories_llm):
    prompt = ["Once upon a time"]

    def run(seed):
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=24, seed=seed)
        return stories_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_top_k_and_min_tokens_beyond_int32_keep_their_meaning(stories_llm):
    """A top_k above the vocabulary is no filter and a min_tokens above any length bans EOS to
    the end; both once overflowed the step's int32 buffer (the served core died)."""

    def run(**kwargs):
        params = SamplingParams(**{"temperature": 1.0, "max_tokens": 40, "seed": 3} | kwargs)
        return stories_llm.generate(["Once"], params, use_tqdm=False)[0].outputs[0]

    assert run(top_k=2**40).token_ids == run(top_k=0).token_ids
    huge = run(min_tokens=2**40, max_tokens=2**40)  # ends at max_model_len, never by EOS
    assert huge.finish_reason == "length"
    assert huge.token_ids[:40] == run(min_tokens=40).token_ids


@pytest.mark.parametrize(
    "prompt, message",
    [
        ({"prompt_token_ids": []}, "The decoder prompt cannot be empty"),  # vLLM's words
        ({"prompt_token_ids": list(range(3, 3 + 128))}, "max_model_len is 128"),
        ({"prompt_token_ids": [5, 9999]}, "outside the vocabulary"),
        (42, "a prompt must be"),
    ],
)
def test_bad_prompt_raises_value_error_and_queues_nothing(stories_llm, prompt, message):
    engine = stories_llm.llm_engine
    free_before = engine.kv_cache_manager.num_free_blocks
    with pytest.raises(ValueError, match=message):
        stories_llm.generate(
            ["Once upon a time", prompt], SamplingParams(max_tokens=4), use_tqdm=False
        )
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == free_before
    # The engine still serves the next request normally.
    (output,) = stories_llm.generate(
        ["Once upon a time"], SamplingParams(max_tokens=4), use_tqdm=False
    )
    assert len(output.outputs[0].token_ids) == 4


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-1.0), "temperature must be non-negative, got -1.0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
        (dict(top_k=-3), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(max_tokens=0), "max_tokens must be at least 1, got 0"),
        (
            dict(n=2, temperature=0.0),
            r"n must be 1 when using greedy sampling \(temperature 0\), got 2",
        ),
        (dict(n=3, best_of=2), r"best_of must be greater than or equal to n \(3\), got 2"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_missing_model_directory_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_unsupported_architecture_is_a_value_error(tmp_path, stories_dir):
    import json
    import shutil

    shutil.copytree(stories_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="FalconForCausalLM"):
        LLM(str(tmp_path / "m"), **SMALL_ENGINE)


def test_invalid_engine_argument_is_a_value_error():
    with pytest.raises(ValueError, match="block_size must be one of"):
        LLM(block_size=12)
    with pytest.raises(ValueError, match="unknown LLM arguments"):
        LLM(max_num_seq=4)


def test_logprob_token_ids_give_true_logprobs_and_ranks_under_the_default_max_logprobs(
    stories_llm,
):
    """Up to 128 ids (vLLM's MAX_LOGPROB_TOKEN_IDS) with max_logprobs 20: each id's logprob and
    rank equal the top-20 list's where the id is in it (its rank counts the whole vocabulary)."""
    greedy = dict(temperature=0, max_tokens=3)
    top = stories_llm.generate(
        ["Once upon a time"], SamplingParams(logprobs=20, **greedy), use_tqdm=False
    )[0].outputs[0]
    best = list(top.logprobs[0])[:20]
    wanted = list(dict.fromkeys(best[::-1] + list(range(0, 512, 4))))[:128]
    chosen = stories_llm.generate(
        ["Once upon a time"], SamplingParams(logprob_token_ids=wanted, **greedy), use_tqdm=False
    )[0].outputs[0]
    assert chosen.token_ids == top.token_ids
    for position, step in enumerate(chosen.logprobs):
        sampled = chosen.token_ids[position]
        assert list(step) == list(dict.fromkeys([sampled, *wanted]))
        for token_id, logprob in step.items():
            known = top.logprobs[position].get(token_id)
            if known is not None:
                assert logprob.logprob == pytest.approx(known.logprob, abs=1e-5)
                assert logprob.rank == known.rank
            else:  # outside the top 20: ranked below them
                assert logprob.rank > 20
    with pytest.raises(ValueError, match="max allowed: 128"):
        SamplingParams(logprob_token_ids=list(range(129)))
