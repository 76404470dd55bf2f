"""SamplingParams: vLLM's defaults, normalisations and validation messages."""

from __future__ import annotations

import pytest

from jaxpaged.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    SamplingParamsError,
    verify_for_model,
)


def test_defaults_are_vllms():
    p = SamplingParams()
    assert (p.n, p.best_of, p.temperature, p.top_p, p.top_k, p.min_p) == (1, None, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs) == (16, 0, None, None)
    assert p.stop == [] and p.stop_token_ids == [] and p.logit_bias is None
    assert p.skip_special_tokens and p.spaces_between_special_tokens
    assert p.output_kind is RequestOutputKind.CUMULATIVE
    assert p.logprobs_mode is None  # the engine's logprobs_mode (vLLM's default raw_logprobs)
    assert not p.uses_logits_state and not p.skip_reading_prefix_cache


def test_normalisations():
    p = SamplingParams(
        seed=-1,
        top_k=-1,
        stop="END",
        stop_token_ids=[5, 5, 7],
        logprobs=True,
        logit_bias={"12": 250, 3: -1000.0, 4: 0.5},
        logprobs_mode="processed",
    )
    assert p.seed is None and p.top_k == 0 and p.stop == ["END"] and p.stop_token_ids == [5, 7]
    assert p.logprobs == 1 and p.logprobs_mode == "processed_logprobs"
    assert p.logit_bias == {12: 100.0, 3: -100.0, 4: 0.5}
    assert p.stop_buffer_length == 2
    assert (
        SamplingParams(stop=["a", "abcd"], include_stop_str_in_output=True).stop_buffer_length == 0
    )
    greedy = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(temperature=0.001).effective_temperature == 0.01
    assert SamplingParams(prompt_logprobs=0).skip_reading_prefix_cache
    for kwargs in (
        dict(presence_penalty=0.1),
        dict(repetition_penalty=1.1),
        dict(min_tokens=1),
        dict(logit_bias={1: 1.0}),
        dict(allowed_token_ids=[1]),
    ):
        assert SamplingParams(**kwargs).uses_logits_state


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n=0), "n must be at least 1, got 0"),
        (dict(n=2, best_of=1), r"best_of must be greater than or equal to n \(2\), got 1"),
        (
            dict(n=3, temperature=0.0),
            r"n must be 1 when using greedy sampling \(temperature 0\), got 3",
        ),
        (
            dict(best_of=2, temperature=0.0),
            r"best_of must be 1 when using greedy sampling \(temperature 0\), got 2",
        ),
        (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\], got 2.5"),
        (dict(frequency_penalty=-3), r"frequency_penalty must be in \[-2, 2\], got -3"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0, got 0.0"),
        (dict(temperature=float("nan")), "temperature must be non-negative"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
        (dict(top_k=-2), "top_k must be 0 or -1 .off., or at least 1, got -2"),
        (dict(top_k=2.5), "top_k must be an integer, got 2.5"),
        (dict(min_p=-0.1), r"min_p must be in \[0, 1\]"),
        (dict(max_tokens=0), "max_tokens must be at least 1, got 0"),
        (dict(min_tokens=5, max_tokens=4), r"min_tokens must be at most max_tokens \(4\), got 5"),
        (dict(seed=2**64), "seed must be a 64-bit integer"),
        (dict(seed=-(2**63) - 1), "seed must be a 64-bit integer"),
        (dict(n=2**70, temperature=1.0), r"n must be below 2\*\*63, got 1180591620717411303424"),
        (dict(top_k=2**63), r"top_k must be below 2\*\*63"),
        (dict(logprobs=-2), "logprobs must be non-negative, -1 or None, got -2"),
        (dict(prompt_logprobs=-2), "prompt_logprobs must be non-negative, -1 or None"),
        (dict(logprob_token_ids=[]), "logprob_token_ids must not be empty"),
        (dict(logprob_token_ids=[-3]), "logprob_token_ids must contain only non-negative"),
        (dict(stop=["ok", ""]), "stop cannot contain an empty string"),
        (dict(stop=[3]), "stop must be a string or a list of strings"),
        (dict(stop_token_ids=[-1]), "stop_token_ids must contain only non-negative integer ids"),
        (dict(allowed_token_ids=[]), "allowed_token_ids must not be empty when given"),
        (dict(logit_bias={"x": 1.0}), "logit_bias keys must be integer token ids"),
        (dict(logit_bias={1: "big"}), "logit_bias values must be finite numbers"),
        (dict(logprobs_mode="logits"), "logprobs_mode must be one of"),
        (dict(output_kind="delta"), "output_kind must be a RequestOutputKind"),
    ],
)
def test_invalid_values_raise_value_errors_naming_field_rule_and_value(kwargs, message):
    with pytest.raises(SamplingParamsError, match=message) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, ValueError)
    assert info.value.parameter == next(iter(kwargs)) or info.value.parameter in kwargs


def test_model_checks_name_the_limit():
    with pytest.raises(
        ValueError, match=r"logprobs must be at most the engine's max_logprobs \(5\), got 6"
    ):
        verify_for_model(SamplingParams(logprobs=6), vocab_size=100, max_logprobs=5)
    with pytest.raises(
        ValueError, match=r"logit_bias has token ids out of vocabulary .*size 100\), got 100"
    ):
        verify_for_model(SamplingParams(logit_bias={100: 1}), vocab_size=100, max_logprobs=5)
    verify_for_model(
        SamplingParams(logprobs=5, stop_token_ids=[99]), vocab_size=100, max_logprobs=5
    )


def test_bad_words_resolve_to_single_token_ids_or_are_refused(stories_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(stories_dir)
    # SentencePiece writes the leading space itself: " time" (2 ids) is not a second variant.
    (time,) = tokenizer.encode("time", add_special_tokens=False)
    params = SamplingParams(bad_words=[" time", "time"])
    assert params.uses_logits_state and params.bad_words_token_ids is None
    params.update_from_tokenizer(tokenizer)
    assert params.bad_words_token_ids == [time]
    with pytest.raises(SamplingParamsError, match="bad_words must each be one token") as info:
        SamplingParams(bad_words=["cat"]).update_from_tokenizer(tokenizer)
    assert info.value.parameter == "bad_words"
    with pytest.raises(SamplingParamsError, match="bad_words needs a tokenizer"):
        SamplingParams(bad_words=["cat"]).update_from_tokenizer(None)
    with pytest.raises(SamplingParamsError, match="bad_words must be a list of non-blank"):
        SamplingParams(bad_words=[" "])
