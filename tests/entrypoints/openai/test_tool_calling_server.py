"""Tool calling through a live server and the ``openai`` client: bad tool requests are 400s
naming their field and leave the server serving with its KV cache free."""

from __future__ import annotations

import pytest

from tests.entrypoints.openai.tool_template import TIME_TOOL, WEATHER_TOOL
from tests.live_server import MODEL_NAME

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(
    "fields, param, message",
    [
        # The shared server has no --enable-auto-tool-choice.
        ({"tools": [WEATHER_TOOL]}, "tool_choice", '"auto" tool choice requires'),
        (
            {"tools": [TIME_TOOL], "tool_choice": NAMED},
            "tool_choice",
            "does not match any of the specified `tools`",
        ),
        ({"tool_choice": NAMED}, "tool_choice", "`tools` must be set"),
        ({"tools": [], "tool_choice": "none"}, "tools", "must not be an empty array"),
        (
            {"tools": [{"type": "function", "function": {"description": "no name"}}]},
            "tools.0.function.name",
            "Field required",
        ),
        (
            {"tools": [WEATHER_TOOL], "tool_choice": "sometimes"},
            "tool_choice",
            "tool_choice",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}
                ],
                "tool_choice": "none",
            },
            "tools.0.function.parameters",
            "is not a valid JSON schema",
        ),
    ],
)
def test_bad_tool_requests_are_a_400_naming_the_field(client, server, fields, param, message):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=4, **fields
        )
    body = error.value.body
    assert error.value.status_code == 400
    assert body["param"] == param or body["param"].startswith(param), body
    assert message in body["message"], body
    # Still serving, nothing left behind.
    ok = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=2, temperature=0
    )
    assert ok.choices[0].finish_reason == "length"
    stats = server.wait_idle()
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"]
