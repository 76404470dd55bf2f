"""``hermes``: texts in the format of NousResearch's Hermes-Function-Calling README and Qwen2.5's
function-calling docs, whole and streamed."""

from __future__ import annotations

import json

import pytest

from jaxpaged.entrypoints.openai.tool_parsers import get_tool_parser
from tests.entrypoints.openai.tool_parsers.streaming import (
    check_stream_matches_whole,
    reassemble_pieces,
)

Parser = get_tool_parser("hermes")

# Hermes-Function-Calling's README writes "arguments" before "name".
HERMES = (
    '<tool_call>\n{"arguments": {"symbol": "TSLA"}, "name": "get_stock_fundamentals"}\n</tool_call>'
)
QWEN_TWO_CALLS = (
    "I'll check both.\n<tool_call>\n"
    '{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", '
    '"date": "2024-10-01", "unit": "celsius"}}\n</tool_call>'
)


@pytest.mark.parametrize(
    "text, content, calls",
    [
        (HERMES, None, [("get_stock_fundamentals", {"symbol": "TSLA"})]),
        (
            QWEN_TWO_CALLS,
            "I'll check both.\n",
            [
                ("get_current_temperature", {"location": "San Francisco, CA, USA"}),
                (
                    "get_temperature_date",
                    {"location": "San Francisco, CA, USA", "date": "2024-10-01", "unit": "celsius"},
                ),
            ],
        ),
        # The last call may lack its closing tag; escapes and non-ASCII survive.
        (
            '<tool_call>{"name": "say", "arguments": {"text": "a \\"b\\" } é"}}',
            None,
            [("say", {"text": 'a "b" } é'})],
        ),
    ],
)
def test_calls_and_content_of_documented_texts(text, content, calls):
    info = Parser().extract_tool_calls(text)
    assert info.tools_called
    assert info.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] == calls
    assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function" for c in info.tool_calls)
    assert len({c.id for c in info.tool_calls}) == len(calls)


@pytest.mark.parametrize(
    "text",
    [
        "The weather is nice today.",
        '<tool_call>{"name": "f", "arguments": {"a": 1}',  # cut off by max_tokens
        "<tool_call>not json</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
    ],
)
def test_text_that_is_not_well_formed_calls_is_content(text):
    info = Parser().extract_tool_calls(text)
    assert not info.tools_called and info.tool_calls == [] and info.content == text


@pytest.mark.parametrize("text", [HERMES, QWEN_TWO_CALLS, "Plain <tool text> with < signs"])
def test_streamed_deltas_reassemble_to_the_whole_answer(text):
    check_stream_matches_whole(Parser, text)


def test_stream_sends_name_before_arguments_and_holds_back_a_partial_tag():
    parser = Parser()
    assert parser.extract_tool_calls_streaming("", "Hi <tool_", "").content == "Hi "
    text = 'Hi <tool_call>{"name": "f", "arguments": {"x": '
    delta = parser.extract_tool_calls_streaming("", text, "")
    (call,) = delta.tool_calls
    assert (call.index, call.function.name, call.function.arguments) == (0, "f", '{"x": ')
    delta = parser.extract_tool_calls_streaming("", text + "12}}", "")
    (call,) = delta.tool_calls
    assert call.id is None and call.function.name is None and call.function.arguments == "12}"


# ---------------------------------------------------------------------------------------------
# Cases of vLLM 0.34's tests/tool_parsers/test_hermes_tool_parser.py: same outputs, streamed a
# character at a time and in pieces of 2 to 8 (vLLM's stream intervals over Qwen3's tokens).
TRIGGER = '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}\n</tool_call>'
TEMPERATURE = (
    '<tool_call>{"name": "get_current_temperature","arguments": {"location":"San Francisco, '
    'California, United States", "unit": "celsius"}}</tool_call>'
)
VLLM_STREAMED = [  # (text, content, [(name, arguments)])
    pytest.param("This is some prior text that has nothing to do with tool calling.",
                 "This is some prior text that has nothing to do with tool calling.", [],
                 id="just_forward_text"),
    pytest.param(TRIGGER, "", [("final_answer", '{"trigger": true}')], id="bug_19056"),
    pytest.param(TEMPERATURE, "", [("get_current_temperature",
                 '{"location":"San Francisco, California, United States", "unit": "celsius"}')],
                 id="temperature"),
    pytest.param('Sure, let me check the weather.<tool_call>{"name": "get_weather", '
                 '"arguments": {"city": "NYC"}}</tool_call>', "Sure, let me check the weather.",
                 [("get_weather", '{"city": "NYC"}')], id="content_then_tool_call"),
    pytest.param('<tool_call>{"name": "search", "arguments": {"q": "cats"}}</tool_call>'
                 '<tool_call>{"name": "search", "arguments": {"q": "dogs"}}</tool_call>', "",
                 [("search", '{"q": "cats"}'), ("search", '{"q": "dogs"}')],
                 id="multiple_tool_calls"),
    pytest.param('Hi!<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>', "Hi!",
                 [("f", '{"x": 1}')], id="content_and_tool_call_in_single_chunk"),
]  # fmt: skip


@pytest.mark.parametrize("cut", [-1, 2, 3, 5, 8, 9999])
@pytest.mark.parametrize("text, content, calls", VLLM_STREAMED)
def test_vllm_cases_streamed(text, content, calls, cut):
    chunks = list(text) if cut == -1 else [text[i : i + cut] for i in range(0, len(text), cut)]
    streamed_content, streamed = reassemble_pieces(Parser(), chunks)
    assert streamed_content == content
    assert [(c["name"], c["arguments"]) for c in streamed] == calls


def test_vllm_plain_text_streams_every_piece_as_it_comes():
    parser, current = Parser(), ""
    for piece in "This is some prior text that has nothing to do with tool calling.".split(" "):
        previous, current = current, current + piece + " "
        delta = parser.extract_tool_calls_streaming(previous, current, piece + " ")
        assert delta is not None and delta.content == piece + " " and not delta.tool_calls


@pytest.mark.parametrize(
    "text, calls",
    [
        pytest.param("This is not a tool call.", [], id="no_tool_call"),
        pytest.param(TRIGGER, [("final_answer", '{"trigger": true}')], id="between_tags"),
        pytest.param(TRIGGER[: TRIGGER.index("\n</tool_call>")],
                     [("final_answer", '{"trigger": true}')], id="until_eos"),
        pytest.param(TRIGGER[: TRIGGER.index("}\n</tool_call>")], [], id="invalid_json"),
    ],
)  # fmt: skip
def test_vllm_cases_whole(text, calls):
    info = Parser().extract_tool_calls(text)
    assert info.tools_called == bool(calls)
    assert [(c.function.name, c.function.arguments) for c in info.tool_calls] == calls
