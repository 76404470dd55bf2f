"""What the engine reports per step: streamed (DELTA) text, stop strings and stop tokens,
min_tokens, max_tokens=1, on the real stories260k checkpoint."""

from __future__ import annotations

import itertools

import pytest

from jaxpaged import SamplingParams
from jaxpaged.detokenizer import IncrementalDetokenizer
from jaxpaged.sampling_params import RequestOutputKind

EOS = 2
_ids = itertools.count()


def _stream(llm, prompt, params):
    """Run one request alone; return every RequestOutput it produced, in order."""
    engine = llm.llm_engine
    request_id = f"stream{next(_ids)}"
    engine.add_request(request_id, prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs


def _greedy_case(golden):
    (case,) = [c for c in golden["cases"] if c["prompt"] == "Once upon a time"]
    assert case["new_text"].startswith(", there was a little girl")
    return {"prompt_token_ids": case["prompt_ids"]}, case["greedy_new_ids"], case["new_text"]


def test_delta_outputs_concatenate_to_the_cumulative_ones(stories_llm):
    prompt = "Once upon a time"
    params = dict(temperature=1.0, seed=11, max_tokens=24, logprobs=2)
    deltas = _stream(
        stories_llm, prompt, SamplingParams(output_kind=RequestOutputKind.DELTA, **params)
    )
    cumulative = _stream(stories_llm, prompt, SamplingParams(**params))
    final = cumulative[-1].outputs[0]
    assert len(deltas) == len(cumulative) == len(final.token_ids)
    assert "".join(d.outputs[0].text for d in deltas) == final.text
    assert sum((d.outputs[0].token_ids for d in deltas), []) == final.token_ids
    assert sum((d.outputs[0].logprobs for d in deltas), []) == final.logprobs
    assert all(len(d.outputs[0].token_ids) == 1 for d in deltas)
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    # Cumulative outputs grow: each text extends the previous one.
    texts = [c.outputs[0].text for c in cumulative]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))


def test_byte_fallback_output_streams_as_the_reference_detokenizer_decodes_it(stories_llm):
    """Exact multi-byte sequences (CJK, emoji) are checked in tests/test_detokenizer.py; here
    the engine streams sampled byte-fallback pieces (those of 日本語 😀, with "▁" made rare so
    runs stay short) through its Rust DecodeStream detokenizer."""
    tokenizer = stories_llm.get_tokenizer()
    allowed = sorted(set(tokenizer.encode("日本語 😀", add_special_tokens=False)))
    params = dict(
        temperature=1.5, seed=2, max_tokens=40, allowed_token_ids=allowed, logit_bias={410: -12}
    )
    kind = RequestOutputKind.DELTA
    deltas = _stream(stories_llm, "Once upon a time", SamplingParams(output_kind=kind, **params))
    (final,) = stories_llm.generate(["Once upon a time"], SamplingParams(**params), use_tqdm=False)
    text = "".join(d.outputs[0].text for d in deltas)
    assert text == final.outputs[0].text
    assert sum(len(d.outputs[0].token_ids) for d in deltas) == 40
    assert len(set(final.outputs[0].token_ids)) > 4  # many byte pieces were drawn
    reference = IncrementalDetokenizer(
        tokenizer, final.prompt_token_ids, SamplingParams(**params), use_fast=False
    )
    reference.update(final.outputs[0].token_ids, stop_terminated=False, finished=True)
    assert text == reference.output_text


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA])
def test_stop_string_split_across_tokens_ends_the_request(stories_llm, golden, include, kind):
    prompt, ids, text = _greedy_case(golden)
    tokenizer = stories_llm.get_tokenizer()
    # A stop string from the last 2 characters of token 4 to the first 2 of token 5.
    cut = len(tokenizer.decode(prompt["prompt_token_ids"] + ids[:5])) - len(
        tokenizer.decode(prompt["prompt_token_ids"])
    )
    stop = text[cut - 2 : cut + 2]
    params = SamplingParams(
        temperature=0.0,
        max_tokens=30,
        stop=[stop],
        include_stop_str_in_output=include,
        output_kind=kind,
    )
    outputs = _stream(stories_llm, prompt, params)
    final = outputs[-1].outputs[0]
    streamed = (
        "".join(o.outputs[0].text for o in outputs)
        if kind is RequestOutputKind.DELTA
        else final.text
    )
    assert streamed == (text[: cut + 2] if include else text[: cut - 2])
    assert final.finish_reason == "stop" and final.stop_reason == stop
    all_ids = (
        sum((o.outputs[0].token_ids for o in outputs), [])
        if kind is RequestOutputKind.DELTA
        else final.token_ids
    )
    assert all_ids == ids[:6]  # ends with the token that completed the stop string
    if not include:  # streaming never showed a character of the stop string
        assert all(stop not in o.outputs[0].text for o in outputs)
    assert (
        stories_llm.llm_engine.kv_cache_manager.num_free_blocks == stories_llm.llm_engine.num_blocks
    )


def test_stop_string_in_the_last_allowed_token_makes_the_reason_stop(stories_llm, golden):
    prompt, ids, text = _greedy_case(golden)
    # " little" is the 5th token: max_tokens=5 ends the request by length in the same step.
    params = SamplingParams(temperature=0.0, max_tokens=5, stop=["little"])
    (out,) = stories_llm.generate([prompt], params, use_tqdm=False)
    assert out.outputs[0].token_ids == ids[:5]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == "little"
    assert out.outputs[0].text == text[: text.index("little")]


def test_stop_token_id_ends_the_request_and_its_text_is_left_out(stories_llm, golden):
    prompt, ids, text = _greedy_case(golden)
    tokenizer = stories_llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[ids[3]])
    (out,) = stories_llm.generate([prompt], params, use_tqdm=False)
    completion = out.outputs[0]
    assert completion.token_ids == ids[:4] and completion.stop_reason == ids[3]
    prompt_text = tokenizer.decode(prompt["prompt_token_ids"])
    assert (
        completion.text
        == tokenizer.decode(prompt["prompt_token_ids"] + ids[:3])[len(prompt_text) :]
    )


@pytest.mark.parametrize("min_tokens", [0, 4])
def test_min_tokens_suppresses_eos_and_stop_token_ids_until_reached(stories_llm, min_tokens):
    # +100 makes EOS (or token 300) the sure choice as soon as it is allowed.
    eos_first = SamplingParams(
        temperature=1.0, seed=1, max_tokens=20, min_tokens=min_tokens, logit_bias={EOS: 100.0}
    )
    stop_first = SamplingParams(
        temperature=0.0,
        max_tokens=20,
        min_tokens=min_tokens,
        stop_token_ids=[300],
        logit_bias={300: 100.0},
    )
    a, b = stories_llm.generate(["Once upon a time"] * 2, [eos_first, stop_first], use_tqdm=False)
    for out, stop_id in ((a, EOS), (b, 300)):
        tokens = out.outputs[0].token_ids
        assert len(tokens) == min_tokens + 1 and tokens[-1] == stop_id
        assert stop_id not in tokens[:-1]
        assert out.outputs[0].finish_reason == "stop"
    assert a.outputs[0].stop_reason is None and b.outputs[0].stop_reason == 300


def test_max_tokens_one_gives_one_token_and_one_final_output(stories_llm, golden):
    prompt, ids, _ = _greedy_case(golden)
    params = SamplingParams(
        temperature=0.0, max_tokens=1, output_kind=RequestOutputKind.DELTA, logprobs=0
    )
    outputs = _stream(stories_llm, prompt, params)
    assert len(outputs) == 1 and outputs[0].finished
    completion = outputs[0].outputs[0]
    assert completion.token_ids == ids[:1] and completion.finish_reason == "length"
    assert completion.text == ","
    assert list(completion.logprobs[0]) == ids[:1] and completion.logprobs[0][ids[0]].rank == 1


def test_abort_returns_the_text_so_far(stories_llm):
    engine = stories_llm.llm_engine
    engine.add_request(
        "to_abort", "Once upon a time", SamplingParams(temperature=0.0, max_tokens=30)
    )
    for _ in range(4):
        engine.step()
    out = engine.abort_request("to_abort")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert out.outputs[0].text.startswith(",") and len(out.outputs[0].token_ids) >= 2
    assert not engine.has_unfinished_requests()
