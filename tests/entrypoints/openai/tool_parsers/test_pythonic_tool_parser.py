"""``pythonic``: texts in the format of vLLM's pythonic tool-calling docs
(``[f(a=1), g(b="x")]``), whole and streamed."""

from __future__ import annotations

import json

import pytest

from jaxpaged.entrypoints.openai.tool_parsers import get_tool_parser
from tests.entrypoints.openai.tool_parsers.streaming import check_stream_matches_whole

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
