"""Tool calling through a live server and the ``openai`` client: bad tool requests are 400s
naming their field and leave the server serving with its KV cache free; "required" and named
choices always yield calls whose arguments validate against the tool's schema (stories260k
under the JSON-schema constraint), streamed as they are returned whole."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import pytest

from tests.entrypoints.openai.tool_template import (
    SHORT_TOOL_CHAT_TEMPLATE,
    TIME_TOOL,
    WEATHER_TOOL,
)
from tests.live_server import API_KEY, MODEL_NAME

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
        (
            {"tools": [WEATHER_TOOL, WEATHER_TOOL], "tool_choice": "none"},
            "tools",
            "appear more than once",
        ),
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
        (  # a valid schema the grammar backend cannot compile: refused when added
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"a": {"$ref": "#/$defs/missing"}},
                            },
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
            "cannot be compiled",
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


# ------------------------------------------------ a server with tools: constrained calls
TOOLS = [WEATHER_TOOL, TIME_TOOL]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
SAMPLING = [dict(temperature=0.0), *(dict(temperature=1.0, seed=seed) for seed in range(2))]


@pytest.fixture(scope="module")
def tool_client():
    from tests.live_server import start_server

    running = start_server(
        api_key=API_KEY,
        chat_template=SHORT_TOOL_CHAT_TEMPLATE,
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
        max_model_len=256,
        # The tiny model would fill any whitespace a JSON grammar allows until max_tokens.
        structured_outputs_config={"disable_any_whitespace": True},
    )
    yield openai.OpenAI(base_url=f"{running.url}/v1", api_key=API_KEY, max_retries=0), running
    running.stop()


def _check_calls(calls):
    for call in calls:
        assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("sampling", SAMPLING)
def test_required_always_yields_calls_that_validate(tool_client, sampling):
    # parallel_tool_calls=False: the array holds one call (the tiny model, left free, adds
    # calls until max_tokens; a real model closes the array).
    client, _ = tool_client
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_completion_tokens=200, **sampling,
    )  # fmt: skip
    (choice,) = response.choices
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls) == 1 and choice.message.content == ""
    _check_calls(choice.message.tool_calls)


def test_required_with_parallel_calls_allowed_ends_when_the_model_closes_the_array(tool_client):
    client, _ = tool_client
    from transformers import AutoTokenizer

    from jaxpaged.config import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    # Make "]" likely once the grammar allows it (after a complete call; nowhere else in these
    # schemas): the tiny model would otherwise add calls until max_tokens.
    (close_id,) = tokenizer.convert_tokens_to_ids(["]"])
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
        max_completion_tokens=200, temperature=1.0, seed=5, logit_bias={str(close_id): 50},
    )  # fmt: skip
    (choice,) = response.choices
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    _check_calls(choice.message.tool_calls)


@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_named_choice_always_yields_one_call_that_validates(tool_client, name, sampling):
    client, _ = tool_client
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_completion_tokens=200,
        tool_choice={"type": "function", "function": {"name": name}}, **sampling,
    )  # fmt: skip
    (choice,) = response.choices
    assert choice.finish_reason == "stop"
    (call,) = choice.message.tool_calls
    assert call.function.name == name
    _check_calls([call])


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_streamed_calls_equal_the_whole_response(tool_client, tool_choice):
    client, running = tool_client
    body = dict(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
        max_completion_tokens=200, temperature=0.0, parallel_tool_calls=False,
    )  # fmt: skip
    whole = client.chat.completions.create(**body).choices[0]
    calls, finish_reason = {}, None
    for chunk in client.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            finish_reason = choice.finish_reason or finish_reason
            for delta in choice.delta.tool_calls or ():
                if delta.index not in calls:
                    assert delta.id and delta.function.name  # name first
                    calls[delta.index] = [delta.function.name, ""]
                else:
                    assert delta.id is None and delta.function.name is None
                calls[delta.index][1] += delta.function.arguments or ""
    assert finish_reason == whole.finish_reason
    assert list(calls.values()) == [
        [c.function.name, c.function.arguments] for c in whole.message.tool_calls
    ]
    assert len(calls) == 1  # parallel_tool_calls=False
    stats = running.wait_idle()
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"]


def test_auto_reply_without_calls_is_content(tool_client):
    """The tiny model writes a story, not a call: "auto" returns it as content."""
    client, _ = tool_client
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_completion_tokens=8, temperature=0
    )
    (choice,) = response.choices
    assert choice.message.tool_calls in (None, []) and choice.message.content
    assert choice.finish_reason == "length"


def test_tokenize_renders_tools_like_the_chat_endpoint(tool_client):
    _, running = tool_client
    body = {"model": MODEL_NAME, "messages": MESSAGES, "tools": TOOLS}
    with httpx.Client(base_url=running.url, headers={"Authorization": f"Bearer {API_KEY}"}) as http:

        def rendered(request):
            tokens = http.post("/tokenize", json=request).json()["tokens"]
            return http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]

        assert rendered(body).startswith("tools: get_weather get_time\nuser: What is")
        assert rendered(body | {"tools": None}).startswith("user: What is")


# A regex that makes stories260k write the hermes format; the model still picks the values.
HERMES_REGEX = (
    r'It is (sunny|cold)\. <tool_call>\{"name": "get_weather", "arguments": '
    r'\{"city": "(Paris|Rome|Oslo)", "days": [1-7]\}\}</tool_call>'
)


@pytest.mark.parametrize("sampling", SAMPLING)
def test_auto_parses_the_calls_the_model_wrote(tool_client, sampling):
    """End to end for "auto": the same greedy/seeded request with tool_choice "none" shows the
    raw text; with "auto" the hermes parser must turn exactly that text into content + call."""
    client, _ = tool_client
    body = dict(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_completion_tokens=120,
        extra_body={"structured_outputs": {"regex": HERMES_REGEX}}, **sampling,
    )  # fmt: skip
    raw = client.chat.completions.create(**body, tool_choice="none").choices[0].message.content
    content, _, call = raw.partition("<tool_call>")
    expected = json.loads(call.removesuffix("</tool_call>"))
    (choice,) = client.chat.completions.create(**body, tool_choice="auto").choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == content
    ((name, arguments),) = [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]
    assert (name, json.loads(arguments)) == (expected["name"], expected["arguments"])
    _check_calls(choice.message.tool_calls)
    streamed, calls = "", {}
    for chunk in client.chat.completions.create(**body, tool_choice="auto", stream=True):
        for delta in (c.delta for c in chunk.choices):
            streamed += delta.content or ""
            for part in delta.tool_calls or ():
                calls.setdefault(part.index, [part.function.name, ""])[1] += (
                    part.function.arguments or ""
                )
    assert streamed == content
    assert list(calls.values()) == [[name, arguments]]


def test_streamed_tool_calls_keep_every_tokens_logprobs(tool_client):
    """Text the parser holds back (a possible "<tool_call>") still has its logprobs sent."""
    client, _ = tool_client
    entries, usage = 0, None
    for chunk in client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_completion_tokens=120,
        temperature=0.0, logprobs=True, stream=True, stream_options={"include_usage": True},
        extra_body={"structured_outputs": {"regex": HERMES_REGEX}},
    ):  # fmt: skip
        usage = chunk.usage or usage
        for choice in chunk.choices:
            entries += len(choice.logprobs.content) if choice.logprobs else 0
    assert entries == usage.completion_tokens > 40


def _chat_with_reasoning(running, parser: str, **fields):
    """A chat completion through a handler with ``--reasoning-parser parser`` over the live
    server's engine core (on its event loop): real output, real parser, no second server."""
    from jaxpaged.entrypoints.openai.protocol import ChatCompletionRequest
    from jaxpaged.entrypoints.openai.reasoning_parsers import get_reasoning_parser
    from jaxpaged.entrypoints.openai.serving_chat import OpenAIServingChat

    serving = OpenAIServingChat(
        running.engine, running.engine.tokenizer, [MODEL_NAME], 256,
        chat_template=SHORT_TOOL_CHAT_TEMPLATE, reasoning_parser=get_reasoning_parser(parser),
    )  # fmt: skip
    request = ChatCompletionRequest(messages=MESSAGES, temperature=0, **fields)
    coroutine = serving.create_chat_completion(request)
    return asyncio.run_coroutine_threadsafe(coroutine, running.engine.loop).result(60)


def test_reasoning_parsers_split_real_output_and_constraints_wait_for_the_reasoning(tool_client):
    client, running = tool_client
    plain = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=12, temperature=0
    ).choices[0]
    # stories260k never writes </think>: deepseek_r1 reads it all as reasoning (cut off).
    (choice,) = _chat_with_reasoning(running, "deepseek_r1", max_tokens=12).choices
    assert (choice.message.reasoning, choice.message.content) == (plain.message.content, None)
    # qwen3 with thinking switched off: all content.
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    (choice,) = _chat_with_reasoning(running, "qwen3", max_tokens=12, **off).choices
    assert (choice.message.reasoning, choice.message.content) == (None, plain.message.content)
    # A JSON constraint starts only after </think>, which never comes: the text is unchanged.
    json_object = {"response_format": {"type": "json_object"}, "max_tokens": 12}
    (choice,) = _chat_with_reasoning(running, "deepseek_r1", **json_object).choices
    assert choice.message.reasoning == plain.message.content
    # ... while with thinking off it applies from the first token.
    (choice,) = _chat_with_reasoning(running, "qwen3", **json_object, **off).choices
    assert choice.message.content.startswith("{")


@pytest.mark.parametrize("stream", [False, True])
def test_each_of_n_choices_gets_its_own_calls(tool_client, stream):
    client, _ = tool_client
    body = dict(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required", n=2,
        parallel_tool_calls=False, max_completion_tokens=200, temperature=1.0, seed=3,
    )  # fmt: skip
    if not stream:
        choices = client.chat.completions.create(**body).choices
        assert sorted(c.index for c in choices) == [0, 1]
        for choice in choices:
            assert choice.finish_reason == "tool_calls"
            _check_calls(choice.message.tool_calls)
        return
    calls = {0: {}, 1: {}}
    for chunk in client.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            for part in choice.delta.tool_calls or ():
                entry = calls[choice.index].setdefault(part.index, [part.function.name, ""])
                entry[1] += part.function.arguments or ""
    for per_choice in calls.values():
        ((name, arguments),) = per_choice.values()
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
