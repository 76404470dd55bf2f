"""``llama3_json``: texts in the format of Meta's Llama 3.1 / 3.2 model cards (JSON tool calling,
``<|python_tag|>``), whole and streamed."""

from __future__ import annotations

import json

import pytest

from jaxpaged.entrypoints.openai.tool_parsers import get_tool_parser
from tests.entrypoints.openai.tool_parsers.streaming import check_stream_matches_whole

Parser = get_tool_parser("llama3_json")

CARD = (
    '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", '
    '"unit": "Fahrenheit"}}'
)
TAGGED_TWO = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "get_time", "arguments": {"tz": "Europe/Paris", "h24": true}}'
)


@pytest.mark.parametrize(
    "text, calls",
    [
        (
            CARD,
            [("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})],
        ),
        (
            TAGGED_TWO,
            [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris", "h24": True})],
        ),
        ("  " + CARD + "\n", [("get_current_conditions", json.loads(CARD)["parameters"])]),
    ],
)
def test_calls_of_documented_texts(text, calls):
    info = Parser().extract_tool_calls(text)
    assert info.tools_called and info.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] == calls


@pytest.mark.parametrize(
    "text",
    [
        "Paris is sunny.",
        '{"answer": 42}',  # JSON, but not a call
        '{"name": "f", "parameters": {"a": 1}} and then text',
        '<|python_tag|>{"name": "f", "parameters": {',
    ],
)
def test_text_that_is_not_well_formed_calls_is_content(text):
    info = Parser().extract_tool_calls(text)
    assert not info.tools_called and info.content == text


@pytest.mark.parametrize("text", [CARD, TAGGED_TWO, "Paris is sunny, <|python"])
def test_streamed_deltas_reassemble_to_the_whole_answer(text):
    check_stream_matches_whole(Parser, text)
