"""``mistral``: texts in the format of Mistral's function-calling docs
(``[TOOL_CALLS][{"name", "arguments"}, ...]``), whole and streamed."""

from __future__ import annotations

import json

import pytest

from jaxpaged.entrypoints.openai.tool_parsers import get_tool_parser
from tests.entrypoints.openai.tool_parsers.streaming import check_stream_matches_whole

Parser = get_tool_parser("mistral")

DOCS = (
    '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
    '"format": "celsius"}}]'
)
TWO = (
    'Let me look.[TOOL_CALLS][{"name": "retrieve_payment_status", "arguments": '
    '{"transaction_id": "T1001"}}, {"name": "retrieve_payment_date", "arguments": '
    '{"transaction_id": "T1001"}}]'
)


# mistral-common v11+ tokenizers: one [TOOL_CALLS]name[ARGS]{...} per call.
V11 = (
    'Sure.[TOOL_CALLS]get_current_weather[ARGS]{"location": "Paris, France", "format": "celsius"}'
    '[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}'
)


@pytest.mark.parametrize(
    "text, content, calls",
    [
        (
            V11,
            "Sure.",
            [
                ("get_current_weather", {"location": "Paris, France", "format": "celsius"}),
                ("get_time", {"tz": "CET"}),
            ],
        ),
        (DOCS, None, [("get_current_weather", {"location": "Paris, France", "format": "celsius"})]),
        (
            TWO,
            "Let me look.",
            [
                ("retrieve_payment_status", {"transaction_id": "T1001"}),
                ("retrieve_payment_date", {"transaction_id": "T1001"}),
            ],
        ),
    ],
)
def test_calls_and_content_of_documented_texts(text, content, calls):
    info = Parser().extract_tool_calls(text)
    assert info.tools_called and info.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] == calls


@pytest.mark.parametrize(
    "text",
    [
        "No tools needed.",
        '[TOOL_CALLS] [{"name": "f"',
        '[TOOL_CALLS] {"name": 1}',
        "[TOOL_CALLS]f[ARGS]{bad}",
        "[TOOL_CALLS]no args tag",
    ],
)
def test_text_that_is_not_well_formed_calls_is_content(text):
    info = Parser().extract_tool_calls(text)
    assert not info.tools_called and info.content == text


def test_the_marker_is_a_special_token_kept_in_the_text():
    assert Parser.keeps_special_tokens


@pytest.mark.parametrize("text", [DOCS, TWO, V11, "A [TOOL list"])
def test_streamed_deltas_reassemble_to_the_whole_answer(text):
    check_stream_matches_whole(Parser, text)
