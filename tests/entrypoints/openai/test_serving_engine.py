"""Shared serving pieces without HTTP: logprob formatting, usage, held-back text, stream merging,
and choice indexing for n > 1 (fed by a scripted engine, since the engine's n > 1 is not here
yet)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math

import hypothesis
import pytest

from jaxpaged.entrypoints.openai.errors import BadRequestError
from jaxpaged.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from jaxpaged.entrypoints.openai.serving_completion import OpenAIServingCompletion
from jaxpaged.entrypoints.openai.serving_engine import (
    UNSUPPORTED_FIELDS,
    OpenAIServing,
    chars_per_token_bound,
    merge_streams,
    stable_text,
    usage_of,
)
from jaxpaged.outputs import CompletionOutput, RequestOutput


@dataclasses.dataclass
class Logprob:  # vLLM's shape: logprob, rank, decoded_token
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"<{i}>" for i in ids)

    def encode(self, text, add_special_tokens=True):
        return [1, *range(10, 10 + len(text.split()))]


def _serving(cls=OpenAIServing, engine=None):
    return cls(engine, _Tokenizer(), ["m"], 64)


@pytest.mark.parametrize("request_class", [CompletionRequest, ChatCompletionRequest])
def test_unsupported_fields_default_to_a_neutral_value(request_class):
    """``check_supported`` reads only the fields a body set: an unset one must be neutral."""
    fields = request_class.model_fields
    declared = [name for name in UNSUPPORTED_FIELDS if name in fields]
    assert len(declared) >= 8  # (tools and structured outputs left the list)
    for name in declared:
        default = fields[name].get_default(call_default_factory=True)
        assert default is None or default in UNSUPPORTED_FIELDS[name], name


def test_unsupported_fields_are_refused_only_when_set_to_a_non_neutral_value():
    serving = _serving()
    body = {"model": "m", "prompt": [1, 2], "priority": 0, "suffix": None}
    serving.check_supported(CompletionRequest(**body))
    with pytest.raises(BadRequestError, match="priority"):
        serving.check_supported(CompletionRequest(**body | {"priority": 3}))
    with pytest.raises(ValueError, match="unknown field suffix"):  # not a chat field
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], suffix="s")


def test_completion_logprobs_follow_openai_shape():
    serving = _serving()
    steps = [
        None,  # first prompt token: no logprob
        {7: Logprob(-0.5, 1, "a"), 8: Logprob(-1.5, 2, "bb")},
        {9: Logprob(-math.inf, 3, "c"), 8: Logprob(-0.1, 1, "bb"), 7: Logprob(-2.0, 2, "a")},
    ]
    out = serving.completion_logprobs([5, 7, 9], steps, text_offset=3)
    assert out.tokens == ["<5>", "a", "c"]
    assert out.text_offset == [3, 6, 7]
    assert out.token_logprobs == [None, -0.5, -9999.0]
    assert out.top_logprobs[0] is None
    # The step's order (the engine's: sampled token first, then by rank), as vLLM lists them.
    assert list(out.top_logprobs[2]) == ["c", "bb", "a"]
    assert out.top_logprobs[2]["c"] == -9999.0
    # logprobs=k keeps k + 1 entries: the sampled token and the k best (OpenAI's rule).
    capped = serving.completion_logprobs([5, 7, 9], steps, text_offset=3, num_top=1)
    assert list(capped.top_logprobs[2]) == ["c", "bb"] and list(capped.top_logprobs[1]) == [
        "a",
        "bb",
    ]


def test_chat_logprobs_limit_alternatives_and_give_bytes():
    serving = _serving()
    step = {4: Logprob(-0.2, 1, "é"), 6: Logprob(-1.0, 2, "x"), 3: Logprob(-3.0, 3, "y")}
    out = serving.chat_logprobs([6], [step], num_top=2)
    (entry,) = out.content
    assert (entry.token, entry.logprob, entry.bytes) == ("x", -1.0, [120])
    assert [(t.token, t.logprob) for t in entry.top_logprobs] == [("é", -0.2), ("x", -1.0)]
    assert entry.top_logprobs[0].bytes == [0xC3, 0xA9]


def test_usage_counts_prompts_once_and_every_choice():
    output = RequestOutput(
        "r",
        None,
        [1, 2, 3],
        [CompletionOutput(0, "", [4, 5]), CompletionOutput(1, "", [6])],
        True,
    )
    usage = usage_of([output, output])
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (6, 6, 12)


def test_unfinished_text_holds_back_a_trailing_replacement_character():
    assert stable_text("ab\ufffd", finished=False) == "ab"
    assert stable_text("ab\ufffd", finished=True) == "ab\ufffd"


class _Stream:
    def __init__(self, items, delay=0.0):
        self.items, self.delay, self.closed = list(items), delay, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(self.delay)
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    def close(self):
        self.closed = True


def test_merge_streams_interleaves_and_reraises():
    async def collect(streams):
        return [pair async for pair in merge_streams(streams)]

    merged = asyncio.run(collect([_Stream("ab", 0.02), _Stream("xyz", 0.001)]))
    assert sorted(merged) == [(0, "a"), (0, "b"), (1, "x"), (1, "y"), (1, "z")]
    assert merged[0] == (1, "x")  # arrival order, not stream order
    with pytest.raises(ValueError, match="boom"):
        asyncio.run(collect([_Stream(["a", ValueError("boom")]), _Stream("xy")]))


class _ScriptedEngine:
    """Answers every request with two choices (as an engine with n = 2 would)."""

    def __init__(self):
        self.streams = []

    async def add_request(self, request_id, prompt, params, arrival_time=None):
        ids = prompt["prompt_token_ids"]

        def output(tokens, finished):
            reason = "length" if finished else None
            choices = [
                CompletionOutput(
                    i, "".join(f"<{t}>" for t in tokens[i]), tokens[i], finish_reason=reason
                )
                for i in range(2)
            ]
            return RequestOutput(request_id, prompt["prompt"], ids, choices, finished)

        stream = _Stream([output([[7], [8]], False), output([[7, 7], [8, 9]], True)])
        self.streams.append(stream)
        return stream


def test_choices_of_several_prompts_with_n_2_are_indexed_prompt_major():
    engine = _ScriptedEngine()
    serving = _serving(OpenAIServingCompletion, engine)
    serving.sampling_params = lambda values: values  # the engine's SamplingParams has n == 1
    request = CompletionRequest(prompt=["a b", "c"], n=2, max_tokens=2)
    response = asyncio.run(serving.create_completion(request))
    assert [(c.index, c.text) for c in response.choices] == [
        (0, "<7><7>"),
        (1, "<8><9>"),
        (2, "<7><7>"),
        (3, "<8><9>"),
    ]
    assert response.usage.prompt_tokens == 3 + 2
    assert response.usage.completion_tokens == 8
    assert all(stream.closed for stream in engine.streams)

    async def streamed():
        stream_request = request.model_copy(update={"stream": True})
        response = await serving.create_completion(stream_request)
        return [chunk async for chunk in response.body_iterator]

    events = asyncio.run(streamed())
    assert events[-1] == "data: [DONE]\n\n"
    texts: dict[int, str] = {}
    for event in events[:-1]:
        for choice in json.loads(event.removeprefix("data: "))["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: "<7><7>", 1: "<8><9>", 2: "<7><7>", 3: "<8><9>"}


def _wordpiece_tokenizer():
    """A BERT-style tokenizer built offline: its pre-tokenizer drops whitespace, so a text of
    spaces has no tokens at all and no characters-per-token bound holds."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "a": 1, "b": 2, "##b": 3}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


@pytest.fixture(scope="module")
def stories_tokenizer(stories_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(stories_dir)


def test_the_characters_per_token_bound_is_refused_for_a_tokenizer_that_drops_whitespace():
    tokenizer = _wordpiece_tokenizer()
    assert tokenizer.encode("a" + " " * 100_000, add_special_tokens=False) == [1]
    assert chars_per_token_bound(tokenizer) is None
    assert chars_per_token_bound(_Tokenizer()) is None  # no vocabulary to read
    serving = OpenAIServing(None, tokenizer, ["m"], 8)
    # Far past 8 tokens of any length, yet one token: tokenized, not refused.
    serving.check_text_fits("a" + " " * 100_000, CompletionRequest(prompt="x"), "prompt")


def test_a_text_over_max_model_len_tokens_of_the_longest_token_is_refused_naming_the_field(
    stories_tokenizer,
):
    bound = chars_per_token_bound(stories_tokenizer)
    assert bound is not None and bound > 1
    serving = OpenAIServing(None, stories_tokenizer, ["m"], 16)
    request = CompletionRequest(prompt="x")
    serving.check_text_fits("z" * (16 * bound), request, "prompt")  # at the limit: passes
    with pytest.raises(BadRequestError, match="maximum context length is 16") as error:
        serving.check_text_fits("z" * (16 * bound + 1), request, "prompt")
    assert error.value.param == "prompt"
    # Truncating requests are tokenized in full, as asked.
    truncating = CompletionRequest(prompt="x", truncate_prompt_tokens=4)
    serving.check_text_fits("z" * (16 * bound + 1), truncating, "prompt")


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(text=hypothesis.strategies.text(max_size=300))
def test_no_text_has_more_characters_per_token_than_the_bound(stories_tokenizer, text):
    """The bound's claim, on arbitrary Unicode (combining marks, whitespace runs, specials)."""
    bound = chars_per_token_bound(stories_tokenizer)
    ids = stories_tokenizer.encode(text, add_special_tokens=False)
    assert len(text) <= bound * len(ids)
