"""``pythonic``: texts in the format of vLLM's pythonic tool-calling docs
(``[f(a=1), g(b="x")]``), whole and streamed."""

from __future__ import annotations

import json

import pytest

from jaxpaged.entrypoints.openai.tool_parsers import get_tool_parser
from tests.entrypoints.openai.tool_parsers.streaming import (
    check_stream_matches_whole,
    reassemble,
    reassemble_pieces,
)

Parser = get_tool_parser("pythonic")

DOCS = (
    "[get_weather(city='San Francisco', metric='celsius'), "
    "get_weather(city='Seattle', metric='celsius')]"
)
LITERALS = (
    '[register_user(name="Doe, John", age=-37, tags=["a, b", (1, 2)], meta={"k": [1, {"x": None}]},'
    " active=true, score=9.5, nothing=null), ping()]"
)


@pytest.mark.parametrize(
    "text, calls",
    [
        (
            DOCS,
            [
                ("get_weather", {"city": "San Francisco", "metric": "celsius"}),
                ("get_weather", {"city": "Seattle", "metric": "celsius"}),
            ],
        ),
        (
            LITERALS,
            [
                (
                    "register_user",
                    {
                        "name": "Doe, John",
                        "age": -37,
                        "tags": ["a, b", [1, 2]],
                        "meta": {"k": [1, {"x": None}]},
                        "active": True,
                        "score": 9.5,
                        "nothing": None,
                    },
                ),
                ("ping", {}),
            ],
        ),
    ],
)
def test_calls_of_documented_texts(text, calls):
    info = Parser().extract_tool_calls(text)
    assert info.tools_called and info.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] == calls


@pytest.mark.parametrize(
    "text",
    [
        "It is sunny.",
        "[1, 2, 3]",
        "[get_weather(city='Paris'",  # cut off
        "[get_weather('Paris')]",  # positional
        "[f(x=open('/etc/passwd'))]",  # not a literal
        "[f(x=1)] trailing prose",
    ],
)
def test_text_that_is_not_well_formed_calls_is_content(text):
    info = Parser().extract_tool_calls(text)
    assert not info.tools_called and info.content == text


@pytest.mark.parametrize("text", [DOCS, LITERALS, "[1, 2] is a list", "plain"])
def test_streamed_deltas_reassemble_to_the_whole_answer(text):
    check_stream_matches_whole(Parser, text)


# ---------------------------------------------------------------------------------------------
# Cases of vLLM 0.34's tests/tool_parsers/test_pythonic_tool_parser.py: same outputs, and the
# argument texts compared exactly (vLLM's ``json.dumps`` of the keyword arguments).
SIMPLE = (
    "get_weather(city='San Francisco', metric='celsius')",
    ("get_weather", '{"city": "San Francisco", "metric": "celsius"}'),
)
MORE_TYPES = (
    "register_user(name='John Doe', age=37, address={'city': 'San Francisco', 'state': 'CA'}, "
    "role=None, passed_test=True, aliases=['John', 'Johnny'])",
    (
        "register_user",
        '{"name": "John Doe", "age": 37, "address": {"city": "San Francisco", '
        '"state": "CA"}, "role": null, "passed_test": true, "aliases": ["John", "Johnny"]}',
    ),
)
PARAMETERLESS = ("get_weather()", ("get_weather", "{}"))
EMPTY_DICT = (
    "do_something_cool(additional_data={})",
    ("do_something_cool", '{"additional_data": {}}'),
)
EMPTY_LIST = ("do_something_cool(steps=[])", ("do_something_cool", '{"steps": []}'))
ESCAPED = (
    r"get_weather(city='Martha\'s Vineyard', metric='\"cool units\"')",
    ("get_weather", '{"city": "Martha\'s Vineyard", "metric": "\\"cool units\\""}'),
)
VLLM_CALLS = [
    pytest.param(f"[{SIMPLE[0]}]", [SIMPLE[1]], id="simple"),
    pytest.param(f"[{MORE_TYPES[0]}]", [MORE_TYPES[1]], id="more_types"),
    pytest.param(f"[{PARAMETERLESS[0]}]", [PARAMETERLESS[1]], id="parameterless"),
    pytest.param(f"[{EMPTY_DICT[0]}]", [EMPTY_DICT[1]], id="empty_dict"),
    pytest.param(f"[{EMPTY_LIST[0]}]", [EMPTY_LIST[1]], id="empty_list"),
    pytest.param(f"[{ESCAPED[0]}]", [ESCAPED[1]], id="escaped_string"),
    pytest.param(f"[{SIMPLE[0]}, {MORE_TYPES[0]}]", [SIMPLE[1], MORE_TYPES[1]],
                 id="parallel_calls"),
]  # fmt: skip


@pytest.mark.parametrize("text, calls", VLLM_CALLS)
def test_vllm_cases_whole(text, calls):
    info = Parser().extract_tool_calls(text)
    assert info.tools_called and info.content is None
    assert [(c.function.name, c.function.arguments) for c in info.tool_calls] == calls


@pytest.mark.parametrize("seed", [-1, 0, 5])
@pytest.mark.parametrize("text, calls", VLLM_CALLS)
def test_vllm_cases_streamed(text, calls, seed):
    content, streamed = reassemble(Parser(), text, seed)
    assert content == ""
    assert [(c["name"], c["arguments"]) for c in streamed] == calls


def test_vllm_no_tool_call_is_content():
    text = "How can I help you today?"
    info = Parser().extract_tool_calls(text)
    assert not info.tools_called and info.content == text
    assert reassemble(Parser(), text, -1) == (text, [])


def test_vllm_streaming_with_large_steps():
    chunks = [
        "[get_weather(city='San",
        f" Francisco', metric='celsius'), {PARAMETERLESS[0]}, {EMPTY_LIST[0]}]",
    ]
    content, streamed = reassemble_pieces(Parser(), chunks)
    assert content == ""
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        SIMPLE[1],
        PARAMETERLESS[1],
        EMPTY_LIST[1],
    ]
