"""``mistral``: texts in the format of Mistral's function-calling docs
(``[TOOL_CALLS][{"name", "arguments"}, ...]``), whole and streamed."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpaged.entrypoints.openai.tool_parsers import get_tool_parser
from jaxpaged.entrypoints.openai.tool_parsers.json_scan import MalformedToolCall
from tests.entrypoints.openai.tool_parsers.streaming import (
    check_stream_matches_whole,
    pieces,
    reassemble_pieces,
)

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
    "text, content",
    [
        ("No tools needed.", "No tools needed."),
        ('[TOOL_CALLS] [{"name": "f"', '[TOOL_CALLS] [{"name": "f"'),  # cut off
        ("[TOOL_CALLS]f[ARGS]{bad}", "[TOOL_CALLS]f[ARGS]{bad}"),
        # JSON after the marker that holds no call: that text is the content (vLLM's rule).
        ("[TOOL_CALLS]no args tag", "no args tag"),
        ('[TOOL_CALLS] {"answer": 1}', '{"answer": 1}'),
    ],
)
def test_text_that_is_not_well_formed_calls_is_content(text, content):
    info = Parser().extract_tool_calls(text)
    assert not info.tools_called and info.content == content


def test_the_marker_is_a_special_token_kept_in_the_text():
    assert Parser.keeps_special_tokens


@pytest.mark.parametrize("text", [DOCS, TWO, V11, "A [TOOL list"])
def test_streamed_deltas_reassemble_to_the_whole_answer(text):
    check_stream_matches_whole(Parser, text)


# ---------------------------------------------------------------------------------------------
# Cases of vLLM 0.34's own tests (tests/parser/mistral/test_tool_calls.py), same inputs and
# expected outputs, against this parser. vLLM tells the two Mistral formats apart by the
# tokenizer: one without an ``[ARGS]`` token (Mistral-7B-Instruct-v0.3) writes a JSON array of
# calls after ``[TOOL_CALLS]``; a v11+ one (Mistral-Small-3.2) writes ``name{args}`` or
# ``name[ARGS]{args}`` per call. Argument texts are compared exactly, as vLLM's tests do.


class _Tokenizer:
    """A tokenizer as far as the parser asks: its vocabulary."""

    def __init__(self, *tokens: str):
        self._vocab = {token: i for i, token in enumerate(tokens)}

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)


PRE_V11 = _Tokenizer("[TOOL_CALLS]")
V11 = _Tokenizer("[TOOL_CALLS]", "[ARGS]")
WEATHER_SF = '{"city": "San Francisco", "state": "CA", "unit": "celsius"}'
WEATHER_DALLAS = '{"city": "Dallas", "state": "TX", "unit": "fahrenheit"}'
BASH = '{"command": "print(\\"hello world!\\")\\nre.compile(r\'{}\')"}'

# (tokenizer, model output, [(name, arguments)], content of the whole reply)
VLLM_WHOLE = [
    pytest.param(PRE_V11, '[TOOL_CALLS][{"name": "add", "arguments":{"a": 3.5, "b": 4}}]',
                 [("add", '{"a": 3.5, "b": 4}')], None, id="pre_v11-single_tool_add"),
    pytest.param(PRE_V11, '[TOOL_CALLS] [{"name": "get_current_weather", "arguments":'
                 + WEATHER_SF + "}]", [("get_current_weather", WEATHER_SF)], None,
                 id="pre_v11-single_tool_weather"),
    pytest.param(PRE_V11, '[TOOL_CALLS] [{"arguments":' + WEATHER_SF
                 + ', "name": "get_current_weather"}]', [("get_current_weather", WEATHER_SF)],
                 None, id="pre_v11-argument_before_name"),
    pytest.param(PRE_V11, '[TOOL_CALLS] [{"arguments":{"name": "John Doe"}, "name": "get_age"}]',
                 [("get_age", '{"name": "John Doe"}')], None,
                 id="pre_v11-argument_before_name_and_name_in_argument"),
    pytest.param(PRE_V11, '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 3.5, "b": 4}}, '
                 '{"name": "get_current_weather", "arguments":' + WEATHER_SF + "}]",
                 [("add", '{"a": 3.5, "b": 4}'), ("get_current_weather", WEATHER_SF)], None,
                 id="pre_v11-multiple_tools"),
    pytest.param(PRE_V11, 'Hello[TOOL_CALLS] [{"name": "add", "arguments":{"a": 1, "b": 2}}]',
                 [("add", '{"a": 1, "b": 2}')], "Hello", id="pre_v11-content_before_tool"),
    pytest.param(PRE_V11, '[TOOL_CALLS] [{"name": "get_current_weather", "arguments":'
                 + WEATHER_DALLAS + "}]\nextra trailing data",
                 [("get_current_weather", WEATHER_DALLAS)], None,
                 id="pre_v11-trailing_data_after_json"),
    # A second marker: only the calls after the first count.
    pytest.param(PRE_V11, '[TOOL_CALLS] [{"name": "add", "arguments":{"a": 1}}]'
                 '[TOOL_CALLS] [{"name": "sub", "arguments":{"b": 2}}]',
                 [("add", '{"a": 1}')], None, id="pre_v11-multiple_bot_tokens"),
    # Junk before the array and after it.
    pytest.param(PRE_V11, '[TOOL_CALLS]  junk [{"name": "add", "arguments":{"a": 1, "b": 2}}] trail',
                 [("add", '{"a": 1, "b": 2}')], None, id="pre_v11-junk_before_the_array"),
    # No call in the JSON after the marker: that text is the content.
    pytest.param(PRE_V11, "[TOOL_CALLS] not json at all", [], "not json at all",
                 id="pre_v11-invalid_json"),
    pytest.param(PRE_V11, "[TOOL_CALLS] 42", [], "42", id="pre_v11-scalar"),
    pytest.param(PRE_V11, '[TOOL_CALLS] ["add"]', [], '["add"]', id="pre_v11-list_of_str"),
    pytest.param(PRE_V11, '[TOOL_CALLS] {"foo": 1}', [], '{"foo": 1}', id="pre_v11-not_a_call"),
    pytest.param(V11, '[TOOL_CALLS]add_this_and_that{"a": 3.5, "b": 4}',
                 [("add_this_and_that", '{"a": 3.5, "b": 4}')], None, id="v11-single_tool_add"),
    pytest.param(V11, "[TOOL_CALLS]get_current_weather" + WEATHER_SF,
                 [("get_current_weather", WEATHER_SF)], None, id="v11-single_tool_weather"),
    pytest.param(V11, '[TOOL_CALLS]add{"a": 3.5, "b": 4}[TOOL_CALLS]multiply{"a": 3, "b": 6}',
                 [("add", '{"a": 3.5, "b": 4}'), ("multiply", '{"a": 3, "b": 6}')], None,
                 id="v11-multiple_tool_calls"),
    pytest.param(V11, '[TOOL_CALLS]add_this_and_that[ARGS]{"a": 3.5, "b": 4}',
                 [("add_this_and_that", '{"a": 3.5, "b": 4}')], None,
                 id="v11-single_tool_add_args"),
    pytest.param(V11, "[TOOL_CALLS]get_current_weather[ARGS]" + WEATHER_SF,
                 [("get_current_weather", WEATHER_SF)], None, id="v11-single_tool_weather_args"),
    pytest.param(V11, '[TOOL_CALLS]add[ARGS]{"a": 3.5, "b": 4}'
                 '[TOOL_CALLS]multiply[ARGS]{"a": 3, "b": 6}',
                 [("add", '{"a": 3.5, "b": 4}'), ("multiply", '{"a": 3, "b": 6}')], None,
                 id="v11-multiple_tool_calls_args"),
    pytest.param(V11, 'hi[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}', [("add", '{"a": 1, "b": 2}')],
                 "hi", id="v11-content_before_tool_args"),
    pytest.param(V11, "hi{hi[TOOL_CALLS]bash" + BASH, [("bash", BASH)], "hi{hi",
                 id="v11-braces_in_content_and_arguments"),
    pytest.param(V11, '[TOOL_CALLS]get_current_weather{"city": "San Francisco"}Estimating the '
                 "weather...", [("get_current_weather", '{"city": "San Francisco"}')], None,
                 id="v11-trailing_text_after_json"),
    pytest.param(V11, '[TOOL_CALLS]get_current_weather[ARGS]{"city": "San Francisco"}Estimating '
                 "the weather...", [("get_current_weather", '{"city": "San Francisco"}')], None,
                 id="v11-trailing_text_after_args_json"),
    pytest.param(V11, "[TOOL_CALLS]toolname_no_args", [("toolname_no_args", "{}")], None,
                 id="v11-without_args"),
    # A name written before the marker: the call has an empty name, the name stays content.
    pytest.param(V11, 'bash[TOOL_CALLS]{"command": "cat file.py"}',
                 [("", '{"command": "cat file.py"}')], "bash", id="v11-name_before_marker"),
    pytest.param(V11, '[TOOL_CALLS]bash[ARGS]{"command": "ls -la"}',
                 [("bash", '{"command": "ls -la"}')], None, id="v11-well_formed_name"),
    pytest.param(V11, 'bash[TOOL_CALLS]{"command": "ls"}[TOOL_CALLS]submit[ARGS]'
                 '{"answer": {"nested": 1}}', [("", '{"command": "ls"}'),
                 ("submit", '{"answer": {"nested": 1}}')], "bash",
                 id="v11-parallel_malformed_then_well_formed"),
    pytest.param(V11, "This is a test", [], "This is a test", id="v11-no_tools"),
    pytest.param(PRE_V11, "This is a test", [], "This is a test", id="pre_v11-no_tools"),
]  # fmt: skip

# Pre-v11 leniency (vLLM's _PRE_V11_UNUSUAL_CALLS): (output, calls, streamed content). The
# whole reply drops the text after the calls; the stream sends it as content.
VLLM_UNUSUAL = [
    pytest.param('[TOOL_CALLS] {"name": "add", "arguments": {"a": 1}}', [("add", '{"a": 1}')],
                 "", id="bare_object"),
    pytest.param('[TOOL_CALLS] {"name": "add", "arguments": {"a": 1}}, '
                 '{"name": "sub", "arguments": {"b": 2}}', [("add", '{"a": 1}')],
                 ', {"name": "sub", "arguments": {"b": 2}}', id="bare_object_then_text"),
    pytest.param('[TOOL_CALLS] {"arguments": {"a": 1}, "name": "add"}, '
                 '{"name": "sub", "arguments": {"b": 2}}', [("add", '{"a": 1}')],
                 ', {"name": "sub", "arguments": {"b": 2}}',
                 id="bare_object_name_last_then_text"),
    pytest.param('[TOOL_CALLS] {"name": "add", "arguments": "{\\"a\\": 1}"}, '
                 '{"name": "sub", "arguments": {"b": 2}}', [("add", '{"a": 1}')],
                 ', {"name": "sub", "arguments": {"b": 2}}',
                 id="bare_object_string_arguments_then_text"),
    pytest.param('[TOOL_CALLS] [{"arguments": {"a": 1}}]', [("", '{"a": 1}')], "",
                 id="missing_name"),
    pytest.param('[TOOL_CALLS] [{"name": "add", "arguments": "{\\"a\\": 1}"}, '
                 '{"name": "sub", "arguments": {"b": 2}}]',
                 [("add", '{"a": 1}'), ("sub", '{"b": 2}')], "", id="string_arguments"),
    pytest.param('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}, "junk"]',
                 [("add", '{"a": 1}')], "", id="entry_not_a_call"),
    pytest.param('[TOOL_CALLS] [TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}]',
                 [("add", '{"a": 1}')], "", id="consecutive_bot_tokens"),
    pytest.param('[TOOL_CALLS] [TOOL_CALLS] {"name": "add", "arguments": {"a": 1}}',
                 [("add", '{"a": 1}')], "", id="consecutive_bot_tokens_bare_object"),
]  # fmt: skip

# Streamed (vLLM's test_extract_tool_calls_streaming*): (tokenizer, output, calls, content).
VLLM_STREAMED = [
    pytest.param(PRE_V11, "This is a test", [], "This is a test", id="pre_v11-no_tools"),
    pytest.param(PRE_V11, '[TOOL_CALLS]  [ {"name":"add" , "arguments" : {"a": 3, "b": 4} } ]',
                 [("add", '{"a": 3, "b": 4}')], "", id="pre_v11-single_tool_add"),
    pytest.param(PRE_V11, '[TOOL_CALLS] [{"name": "add", "arguments":{"a": "3", "b": "4"}}]',
                 [("add", '{"a": "3", "b": "4"}')], "", id="pre_v11-single_tool_add_strings"),
    pytest.param(PRE_V11, '[TOOL_CALLS] [{"arguments": ' + WEATHER_SF
                 + ', "name": "get_current_weather"}]', [("get_current_weather", WEATHER_SF)], "",
                 id="pre_v11-argument_before_name"),
    pytest.param(PRE_V11, '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 3.5, "b": 4}}, '
                 '{"name": "get_current_weather", "arguments":' + WEATHER_SF + "}]",
                 [("add", '{"a": 3.5, "b": 4}'), ("get_current_weather", WEATHER_SF)], "",
                 id="pre_v11-multiple_tools"),
    pytest.param(PRE_V11, '[TOOL_CALLS] [{"name": "get_current_weather", "arguments":'
                 + WEATHER_DALLAS + "}]\nextra trailing data",
                 [("get_current_weather", WEATHER_DALLAS)], "\nextra trailing data",
                 id="pre_v11-trailing_data_after_json"),
    pytest.param(PRE_V11, 'Some text[TOOL_CALLS] [{"name": "add", "arguments":{"a": 1, "b": 2}}]',
                 [("add", '{"a": 1, "b": 2}')], "Some text", id="pre_v11-content_before_tool"),
    pytest.param(V11, "This is a test", [], "This is a test", id="v11-no_tools"),
    pytest.param(V11, '[TOOL_CALLS]add{"a": 3, "b": 4}', [("add", '{"a": 3, "b": 4}')], "",
                 id="v11-single_tool_add"),
    pytest.param(V11, '[TOOL_CALLS]add_two_strings{"a": "3", "b": "4"}',
                 [("add_two_strings", '{"a": "3", "b": "4"}')], "",
                 id="v11-single_tool_add_strings"),
    pytest.param(V11, '[TOOL_CALLS]add{"a": 3.5, "b": 4}[TOOL_CALLS]get_current_weather'
                 + WEATHER_SF, [("add", '{"a": 3.5, "b": 4}'), ("get_current_weather", WEATHER_SF)],
                 "", id="v11-multiple_tools"),
    pytest.param(V11, 'bla[TOOL_CALLS]add_this_and_that[ARGS]{"a": 3.5, "b": 4}',
                 [("add_this_and_that", '{"a": 3.5, "b": 4}')], "bla",
                 id="v11-content_before_tool_args"),
    pytest.param(V11, "hi{hi[TOOL_CALLS]bash" + BASH, [("bash", BASH)], "hi{hi", id="v11-complex"),
    pytest.param(V11, 'bash[TOOL_CALLS]{"command": "cat file.py"}',
                 [("", '{"command": "cat file.py"}')], "bash", id="v11-name_before_marker"),
]  # fmt: skip


def _is_mistral_call_id(call_id: str) -> bool:
    # mistral-common's validator: 9 alphanumeric characters (its templates refuse others).
    return len(call_id) == 9 and call_id.isascii() and call_id.isalnum()


@pytest.mark.parametrize("tokenizer, text, calls, content", VLLM_WHOLE)
def test_vllm_cases_whole(tokenizer, text, calls, content):
    info = Parser(tokenizer).extract_tool_calls(text)
    assert info.tools_called == bool(calls)
    assert [(c.function.name, c.function.arguments) for c in info.tool_calls] == calls
    assert info.content == content
    assert all(_is_mistral_call_id(c.id) for c in info.tool_calls)


@pytest.mark.parametrize("text, calls, _", VLLM_UNUSUAL)
def test_vllm_pre_v11_leniency_whole(text, calls, _):
    info = Parser(PRE_V11).extract_tool_calls(text)
    assert info.tools_called and info.content is None
    assert [(c.function.name, c.function.arguments) for c in info.tool_calls] == calls


@pytest.mark.parametrize("seed", [-1, 0, 3, "one_piece"])
@pytest.mark.parametrize("text, calls, content", VLLM_UNUSUAL)
def test_vllm_pre_v11_leniency_streamed(text, calls, content, seed):
    chunks = [text] if seed == "one_piece" else pieces(text, seed)
    streamed_content, streamed = reassemble_pieces(Parser(PRE_V11), chunks)
    assert [(c["name"], c["arguments"]) for c in streamed] == calls
    assert streamed_content == content


@pytest.mark.parametrize("seed", [-1, 0, 3, "one_piece"])
@pytest.mark.parametrize("tokenizer, text, calls, content", VLLM_STREAMED)
def test_vllm_cases_streamed(tokenizer, text, calls, content, seed):
    chunks = [text] if seed == "one_piece" else pieces(text, seed)
    streamed_content, streamed = reassemble_pieces(Parser(tokenizer), chunks)
    assert [(c["name"], c["arguments"]) for c in streamed] == calls
    assert streamed_content == content
    assert all(_is_mistral_call_id(c["id"]) for c in streamed)


@pytest.mark.parametrize(
    "text, content",
    [
        # Arguments that never close: vLLM returns a call holding the broken JSON text; here
        # a call's arguments are always valid JSON, so the reply is content.
        ("hi{hi[TOOL_CALLS]bash" + BASH[:-2], "hi{hi[TOOL_CALLS]bash" + BASH[:-2]),
        ("bash[TOOL_CALLS]{not valid json at all", "bash[TOOL_CALLS]{not valid json at all"),
    ],
)
def test_arguments_that_are_not_json_are_content_not_a_broken_call(text, content):
    info = Parser(V11).extract_tool_calls(text)
    assert not info.tools_called and info.content == content


_FRAGMENTS = st.sampled_from(
    ["[TOOL_CALLS]", "[ARGS]", "add", "hi", " ", "\n", ",", "}", "]", '"s"', '{"a": 1}',
     '{"name": "g"}', '[{"name": "f", "arguments": {"x": [1]}}]', "junk"]
)  # fmt: skip


@settings(max_examples=400, deadline=None, derandomize=True)
@given(fragments=st.lists(_FRAGMENTS, min_size=1, max_size=7), v11=st.booleans())
def test_every_prefix_reads_as_a_prefix_of_the_whole_reply(fragments, v11):
    """What the stream sends at any cut (content, named calls, their arguments) stays a prefix
    of what the whole text gives, so nothing sent is ever wrong."""
    text = "".join(fragments)
    tokenizer = V11 if v11 else PRE_V11
    try:
        whole = Parser(tokenizer).parse(text, final=True)
    except MalformedToolCall:
        return
    streamed = whole.content + whole.trailing
    for cut in range(len(text)):
        try:
            part = Parser(tokenizer).parse(text[:cut], final=False)
        except MalformedToolCall:
            continue
        assert streamed.startswith(part.content + part.trailing)
        named = [call for call in part.calls if call.name is not None]
        assert len(named) <= len(whole.calls)
        for call, final_call in zip(named, whole.calls, strict=False):
            assert call.name == final_call.name
            assert final_call.arguments.startswith(call.arguments)
            assert not call.complete or call.arguments == final_call.arguments
