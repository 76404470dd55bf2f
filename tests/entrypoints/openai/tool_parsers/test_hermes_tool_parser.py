"""``hermes``: texts in the format of NousResearch's Hermes-Function-Calling README and Qwen2.5's
function-calling docs, whole and streamed."""

from __future__ import annotations

import json

import pytest

from jaxpaged.entrypoints.openai.tool_parsers import get_tool_parser
from tests.entrypoints.openai.tool_parsers.streaming import check_stream_matches_whole

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
