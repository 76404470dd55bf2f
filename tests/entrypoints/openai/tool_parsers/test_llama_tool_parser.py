"""``llama3_json``: texts in the format of Meta's Llama 3.1 / 3.2 model cards (JSON tool calling,
``<|python_tag|>``), whole and streamed."""

from __future__ import annotations

import json

import pytest

from jaxpaged.entrypoints.openai.tool_parsers import get_tool_parser
from tests.entrypoints.openai.tool_parsers.streaming import (
    check_stream_matches_whole,
    reassemble_pieces,
)

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


# ---------------------------------------------------------------------------------------------
# Cases of vLLM 0.34's tests/parser/engine/test_llama_json.py: same outputs and expectations.
VLLM_CALLS = [  # (text, [(name, arguments as a dict)])
    pytest.param('{"name": "searchTool", "parameters": {"query": "test query", "limit": 10}}',
                 [("searchTool", {"query": "test query", "limit": 10})], id="with_arguments"),
    pytest.param('{"name": "searchTool", "arguments": {"query": "test"}}',
                 [("searchTool", {"query": "test"})], id="with_arguments_key"),
    pytest.param('<|python_tag|>{"name": "searchTool", "arguments": {"query": "test"}}<|eom_id|>',
                 [("searchTool", {"query": "test"})], id="with_output_end_token"),
    pytest.param('{"name": "searchTool", "arguments": {"query": "test"}};',
                 [("searchTool", {"query": "test"})], id="trailing_semicolon"),
    pytest.param('{"name": "searchTool", "arguments": {"query": "test"}}; ',
                 [("searchTool", {"query": "test"})], id="trailing_semicolon_space"),
    pytest.param('{"name": "searchTool", "parameters": {"query": "test1"}}; '
                 '{"name": "getOpenIncidentsTool", "parameters": {}}; '
                 '{"name": "searchTool", "parameters": {"query": "test2"}}',
                 [("searchTool", {"query": "test1"}), ("getOpenIncidentsTool", {}),
                  ("searchTool", {"query": "test2"})], id="multiple_json"),
    pytest.param('{"name": "searchTool", "parameters": {"query": "test1"}} ; '
                 '{"name": "getOpenIncidentsTool", "parameters": {}} ; '
                 '{"name": "searchTool", "parameters": {"query": "test2"}}',
                 [("searchTool", {"query": "test1"}), ("getOpenIncidentsTool", {}),
                  ("searchTool", {"query": "test2"})], id="multiple_json_with_whitespace"),
    pytest.param('{"name": "complexTool", "parameters": {"level1": {"level2": {"level3": '
                 '{"level4": {"value": "deep"}}}}}}',
                 [("complexTool", {"level1": {"level2": {"level3": {"level4": {"value": "deep"}}}}})],
                 id="deeply_nested_json"),
    pytest.param('{"name": "simpleTool", "parameters": {"value": "test"}}; {"name": "complexTool",'
                 ' "parameters": {"config": {"database": {"connection": {"pool": {"size": 10}}}}}}',
                 [("simpleTool", {"value": "test"}), ("complexTool", {"config": {"database": {
                     "connection": {"pool": {"size": 10}}}}})], id="multiple_with_deep_nesting"),
    pytest.param('{"name": "searchTool", "parameters": {"query": "test {value} [complex]",'
                 '"nested": {"inner": "more {brackets}"}}}',
                 [("searchTool", {"query": "test {value} [complex]",
                                  "nested": {"inner": "more {brackets}"}})],
                 id="quotes_and_brackets_in_string"),
    pytest.param('{"name": "parserTool", "parameters": {"text": "He said \\"Hello {world}\\""}}',
                 [("parserTool", {"text": 'He said "Hello {world}"'})],
                 id="escaped_quotes_in_nested_json"),
    pytest.param('{"name":"a","arguments":{"x":1}}; {"name":"b","parameters":{"y":2}}',
                 [("a", {"x": 1}), ("b", {"y": 2})], id="parallel_calls"),
    pytest.param('<|python_tag|>{"name":"a","arguments":{"x":1}}; {"name":"b","parameters":{"y":2}}',
                 [("a", {"x": 1}), ("b", {"y": 2})], id="parallel_calls_with_marker"),
]  # fmt: skip


@pytest.mark.parametrize("text, calls", VLLM_CALLS)
def test_vllm_cases_whole(text, calls):
    info = Parser().extract_tool_calls(text)
    assert info.tools_called and info.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] == calls


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 11])
@pytest.mark.parametrize("text, calls", VLLM_CALLS)
def test_vllm_cases_streamed(text, calls, cut):
    chunks = [text[i : i + cut] for i in range(0, len(text), cut)]
    content, streamed = reassemble_pieces(Parser(), chunks)
    assert content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == calls


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("This is just some text without any tool calls", id="no_json"),
        pytest.param('{"name": "invalidTool", "parameters": {invalid json}', id="invalid_json"),
        pytest.param('{"parameters": {}}', id="missing_name_key"),
        pytest.param('{"name": "toolWithoutParams"}', id="missing_parameters_and_arguments"),
        pytest.param('Example: {"name":"a","arguments":{}}', id="brace_in_plain_text"),
    ],
)
def test_vllm_cases_that_are_content(text):
    info = Parser().extract_tool_calls(text)
    assert not info.tools_called and info.tool_calls == [] and info.content == text
