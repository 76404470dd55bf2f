"""Tool calls and reasoning through ``OpenAIServingChat`` with each parser, fed by a scripted
engine that replies with a fixed text in the parser's documented format (the tiny test model
never writes such text by itself): the whole response, the streamed one reassembled, the
rendered prompt, the sampling values, and the request checks."""

from __future__ import annotations

import asyncio
import json

import pytest

from jaxpaged.config import default_model_path
from jaxpaged.entrypoints.openai.chat_tools import tool_constraint_schema
from jaxpaged.entrypoints.openai.errors import BadRequestError
from jaxpaged.entrypoints.openai.protocol import ChatCompletionRequest
from jaxpaged.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from jaxpaged.entrypoints.openai.serving_chat import OpenAIServingChat
from jaxpaged.entrypoints.openai.tool_parsers import get_tool_parser
from jaxpaged.outputs import CompletionOutput, RequestOutput
from tests.entrypoints.openai.tool_parsers.streaming import pieces
from tests.entrypoints.openai.tool_template import TIME_TOOL, TOOL_CHAT_TEMPLATE, WEATHER_TOOL

CITY = {"city": "Paris", "days": 2}
REPLIES = {  # parser -> (reply, content, calls)
    "hermes": (
        'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
        '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}'
        "</tool_call>",
        "Checking.",
        [("get_weather", CITY), ("get_time", {"zone": "Europe/Paris"})],
    ),
    "llama3_json": (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}',
        None,
        [("get_weather", CITY)],
    ),
    "mistral": (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]',
        None,
        [("get_weather", CITY)],
    ),
    "pythonic": ("[get_weather(city='Paris', days=2)]", None, [("get_weather", CITY)]),
}


class _Stream:
    def __init__(self, outputs):
        self._outputs = iter(outputs)

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            return next(self._outputs)
        except StopIteration:
            raise StopAsyncIteration from None

    def close(self):
        pass


class _ScriptedEngine:
    """Replies to every request with ``reply``, a few characters per step, then finishes with
    ``finish_reason``."""

    def __init__(self, reply: str, finish_reason: str = "stop", token_ids=None):
        self.reply = reply
        self.finish_reason = finish_reason
        self.token_ids = token_ids  # the reply's ids (the last output's); None: 0, 1, ...
        self.requests = []  # (prompt, params)

    async def add_request(self, request_id, prompt, params, arrival_time=None):
        self.requests.append((prompt, params))
        steps = pieces(self.reply, 7)
        outputs, text = [], ""
        for n, piece in enumerate(steps):
            text += piece
            last = n == len(steps) - 1
            ids = list(range(n + 1)) if self.token_ids is None or not last else self.token_ids
            completion = CompletionOutput(
                0, text, ids, finish_reason=self.finish_reason if last else None
            )
            outputs.append(
                RequestOutput(request_id, prompt["prompt"], [1], [completion], finished=last)
            )
        return _Stream(outputs)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path())


def _chat(
    tokenizer, reply, *, tool_parser=None, reasoning_parser=None, auto=True, finish_reason="stop"
):
    engine = _ScriptedEngine(reply, finish_reason)
    serving = OpenAIServingChat(
        engine,
        tokenizer,
        ["m"],
        4096,
        chat_template=TOOL_CHAT_TEMPLATE,
        enable_auto_tool_choice=auto and tool_parser is not None,
        tool_parser=get_tool_parser(tool_parser) if tool_parser else None,
        reasoning_parser=get_reasoning_parser(reasoning_parser) if reasoning_parser else None,
    )
    serving.sampling_params = lambda values: values  # recorded as the engine's "params"
    return serving, engine


def _request(**fields):
    body = {"messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 50}
    return ChatCompletionRequest(**(body | {"tools": [WEATHER_TOOL, TIME_TOOL]} | fields))


def _run(serving, request):
    return asyncio.run(serving.create_chat_completion(request))


def _streamed(serving, request) -> tuple[dict, list[dict]]:
    """(merged message, chunks) of a streamed response, merged as the openai client does."""

    async def collect():
        response = await serving.create_chat_completion(request)
        return [chunk async for chunk in response.body_iterator]

    events = [e.removeprefix("data: ").strip() for e in asyncio.run(collect())]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    message = {"content": "", "reasoning": "", "tool_calls": [], "finish_reason": None}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        delta = choice["delta"]
        message["content"] += delta.get("content") or ""
        message["reasoning"] += delta.get("reasoning") or ""
        for call in delta.get("tool_calls") or ():
            if call["index"] == len(message["tool_calls"]):
                assert set(call) == {"index", "id", "type", "function"}, call
                assert call["function"]["name"], call
                message["tool_calls"].append(call | {"function": dict(call["function"])})
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {
                    "arguments"
                }, call
                message["tool_calls"][call["index"]]["function"]["arguments"] += call["function"][
                    "arguments"
                ]
        message["finish_reason"] = choice["finish_reason"] or message["finish_reason"]
    return message, chunks


def _calls(tool_calls):
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls]


@pytest.mark.parametrize("parser", sorted(REPLIES))
def test_auto_tool_calls_whole_and_streamed_with_each_parser(tokenizer, parser):
    reply, content, calls = REPLIES[parser]
    serving, engine = _chat(tokenizer, reply, tool_parser=parser)
    response = _run(serving, _request(tool_choice="auto"))
    (choice,) = response.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == content
    assert _calls(choice.message.tool_calls) == calls
    id_ok = (
        (lambda i: len(i) == 9 and i.isalnum())
        if parser == "mistral"
        else (lambda i: i.startswith("chatcmpl-tool-"))
    )
    assert all(id_ok(c.id) for c in choice.message.tool_calls)
    # Special-token markers ([TOOL_CALLS], <|python_tag|>) must survive detokenization.
    assert engine.requests[0][1]["skip_special_tokens"] is not (parser != "pythonic")

    message, _ = _streamed(serving, _request(tool_choice="auto", stream=True))
    assert message["finish_reason"] == "tool_calls"
    assert message["content"] == (content or "")
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message["tool_calls"]
    ] == calls
    assert [c["index"] for c in message["tool_calls"]] == list(range(len(calls)))


def test_auto_without_a_call_in_the_text_is_plain_content(tokenizer):
    serving, _ = _chat(tokenizer, "It is sunny in Paris.", tool_parser="hermes")
    (choice,) = _run(serving, _request()).choices  # tools without tool_choice: "auto"
    assert choice.finish_reason == "stop"
    assert choice.message.content == "It is sunny in Paris." and choice.message.tool_calls == []


def test_parallel_tool_calls_false_keeps_the_first_call(tokenizer):
    reply, _, calls = REPLIES["hermes"]
    serving, _ = _chat(tokenizer, reply, tool_parser="hermes")
    (choice,) = _run(serving, _request(parallel_tool_calls=False)).choices
    assert _calls(choice.message.tool_calls) == calls[:1]
    message, _ = _streamed(serving, _request(parallel_tool_calls=False, stream=True))
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]


def test_tool_choice_none_leaves_calls_in_the_text(tokenizer):
    reply = REPLIES["hermes"][0]
    serving, _ = _chat(tokenizer, reply, tool_parser="hermes")
    (choice,) = _run(serving, _request(tool_choice="none")).choices
    assert choice.message.content == reply and choice.message.tool_calls == []
    assert choice.finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_is_split_before_tool_calls_are_read(tokenizer, stream):
    reply = (
        "<think>The user wants weather; call the tool.</think>\n"
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>'
    )
    serving, _ = _chat(tokenizer, reply, tool_parser="hermes", reasoning_parser="qwen3")
    if stream:
        message, chunks = _streamed(serving, _request(stream=True))
        assert message["reasoning"] == "The user wants weather; call the tool."
        assert message["content"] == "\n"
        assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == CITY
        assert message["finish_reason"] == "tool_calls"
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    else:
        (choice,) = _run(serving, _request()).choices
        assert choice.message.reasoning == "The user wants weather; call the tool."
        assert choice.message.content == "\n"
        assert _calls(choice.message.tool_calls) == [("get_weather", CITY)]
        assert choice.finish_reason == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_include_reasoning_false_drops_the_reasoning(tokenizer, stream):
    serving, _ = _chat(tokenizer, "<think>hmm</think>Hello", reasoning_parser="deepseek_r1")
    request = ChatCompletionRequest(
        messages=[{"role": "user", "content": "Hi"}], include_reasoning=False, stream=stream
    )
    if stream:
        message, _ = _streamed(serving, request)
        assert (message["reasoning"], message["content"]) == ("", "Hello")
    else:
        (choice,) = _run(serving, request).choices
        assert (choice.message.reasoning, choice.message.content) == (None, "Hello")


def test_tools_tool_calls_and_tool_results_render_through_the_template(tokenizer):
    serving, engine = _chat(tokenizer, "Sunny.", tool_parser="hermes")
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
    ]
    _run(serving, _request(messages=messages, tools=[WEATHER_TOOL]))
    prompt = engine.requests[0][0]["prompt"]
    parameters = json.dumps(WEATHER_TOOL["function"]["parameters"])
    assert prompt == (
        f"tools: get_weather{parameters}\n"
        "user: Weather?\n"
        'assistant calls: get_weather{"city": "Oslo", "days": 1}\n'  # arguments as an object
        "tool[call_1]: -3 C\n"
        "assistant:"
    )


def test_auto_without_the_flag_is_a_400_naming_tool_choice(tokenizer):
    serving, _ = _chat(tokenizer, "x", tool_parser="hermes", auto=False)
    with pytest.raises(BadRequestError) as error:
        _run(serving, _request(tool_choice="auto"))
    assert error.value.param == "tool_choice"
    assert '"auto" tool choice requires --enable-auto-tool-choice' in str(error.value)


def test_parameters_that_are_not_a_json_schema_are_a_400_naming_them(tokenizer):
    serving, _ = _chat(tokenizer, "x", tool_parser="hermes")
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}
    with pytest.raises(BadRequestError) as error:
        _run(serving, _request(tools=[WEATHER_TOOL, bad]))
    assert error.value.param == "tools.1.function.parameters"


def test_constraint_schema_of_named_and_required_choices():
    named = _request(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert tool_constraint_schema(named) == TIME_TOOL["function"]["parameters"]
    assert tool_constraint_schema(_request(tool_choice="auto")) is None
    schema = tool_constraint_schema(_request(tool_choice="required"))
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]] == [
        ["get_weather"],
        ["get_time"],
    ]
    single = tool_constraint_schema(_request(tool_choice="required", parallel_tool_calls=False))
    assert single["maxItems"] == 1


def test_required_schema_lifts_defs_to_the_root_and_refuses_conflicting_ones():
    shared = {"Unit": {"enum": ["C", "F"]}}
    tool = {
        "type": "function",
        "function": {
            "name": "t",
            "parameters": {"type": "object", "properties": {"u": {"$ref": "#/$defs/Unit"}}}
            | {"$defs": shared},
        },
    }
    schema = tool_constraint_schema(_request(tools=[tool], tool_choice="required"))
    assert schema["$defs"] == shared
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    other = json.loads(json.dumps(tool))
    other["function"]["name"] = "u"
    other["function"]["parameters"]["$defs"]["Unit"] = {"enum": ["K"]}
    with pytest.raises(BadRequestError) as error:
        tool_constraint_schema(_request(tools=[tool, other], tool_choice="required"))
    assert error.value.param == "tools.1.function.parameters"


NAMED = {"type": "function", "function": {"name": "get_weather"}}
REQUIRED_REPLY = (
    '[{"name": "get_weather", "parameters": {"city": "Rome", "days": 3}}, '
    '{"name": "get_time", "parameters": {"zone": "Europe/Rome"}}]'
)


@pytest.mark.parametrize("stream", [False, True])
def test_named_choice_constrains_to_the_parameters_and_finishes_stop(tokenizer, stream):
    serving, engine = _chat(tokenizer, '{"city": "Oslo", "days": 1}')
    request = _request(tool_choice=NAMED, stream=stream)
    if stream:
        message, _ = _streamed(serving, request)
        ((name, arguments),) = [
            (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]
        ]
        finish_reason, content = message["finish_reason"], message["content"]
    else:
        (choice,) = _run(serving, request).choices
        ((name, arguments),) = [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls
        ]
        finish_reason, content = choice.finish_reason, choice.message.content
    assert (name, json.loads(arguments)) == ("get_weather", {"city": "Oslo", "days": 1})
    assert finish_reason == "stop" and content == ""  # OpenAI's and vLLM's convention
    params = engine.requests[0][1]
    assert params["structured_outputs"].json == WEATHER_TOOL["function"]["parameters"]


@pytest.mark.parametrize("stream", [False, True])
def test_required_choice_constrains_to_a_call_array_and_finishes_tool_calls(tokenizer, stream):
    serving, engine = _chat(tokenizer, REQUIRED_REPLY)  # no auto parser: none is needed
    request = _request(tool_choice="required", stream=stream)
    if stream:
        message, _ = _streamed(serving, request)
        calls = [
            (c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]
        ]
        finish_reason = message["finish_reason"]
    else:
        (choice,) = _run(serving, request).choices
        calls, finish_reason = _calls(choice.message.tool_calls), choice.finish_reason
    assert calls == [
        ("get_weather", {"city": "Rome", "days": 3}),
        ("get_time", {"zone": "Europe/Rome"}),
    ]
    assert finish_reason == "tool_calls"
    schema = engine.requests[0][1]["structured_outputs"].json
    assert schema == tool_constraint_schema(_request(tool_choice="required"))


def test_with_a_reasoning_parser_the_constraint_starts_after_the_end_of_thinking(tokenizer):
    reply = '<think>Oslo it is.</think>{"city": "Oslo", "days": 1}'
    serving, engine = _chat(tokenizer, reply, reasoning_parser="deepseek_r1")
    (choice,) = _run(serving, _request(tool_choice=NAMED)).choices
    assert choice.message.reasoning == "Oslo it is."
    assert _calls(choice.message.tool_calls) == [("get_weather", {"city": "Oslo", "days": 1})]
    constraint = engine.requests[0][1]["structured_outputs"]
    assert constraint.reasoning_end_token_ids == tokenizer.encode(
        "</think>", add_special_tokens=False
    )
    # Thinking switched off (qwen3): the constraint starts at once.
    serving, engine = _chat(tokenizer, '{"city": "Oslo", "days": 1}', reasoning_parser="qwen3")
    _run(serving, _request(tool_choice=NAMED, chat_template_kwargs={"enable_thinking": False}))
    assert engine.requests[0][1]["structured_outputs"].reasoning_end_token_ids is None


@pytest.mark.parametrize(
    ("parser", "reply", "reasoning", "kwargs"),
    [
        ("deepseek_r1", "<think>Oslo, surely.</think>It is Oslo.", "Oslo, surely.", {}),
        ("deepseek_r1", "Oslo, surely.</think>It is Oslo.", "Oslo, surely.", {}),  # opened
        ("deepseek_r1", "<think>Oslo, surely, or", "Oslo, surely, or", {}),  # cut off
        ("qwen3", "Oslo, surely.<tool_call>{}", "Oslo, surely.", {}),  # an implicit end
        ("qwen3", "It is Oslo.", "", {"enable_thinking": False}),
    ],
)
def test_usage_counts_the_reasoning_tokens_whole_and_streamed(parser, reply, reasoning, kwargs):
    """vLLM's ``usage.completion_tokens_details.reasoning_tokens`` with --reasoning-parser:
    the reply's tokens before the end of the reasoning, markers not counted."""
    from transformers import AutoTokenizer

    thinking = AutoTokenizer.from_pretrained(default_model_path())  # markers as special tokens
    thinking.add_special_tokens(
        {"additional_special_tokens": ["<think>", "</think>", "<tool_call>"]}
    )
    expected = len(thinking.encode(reasoning, add_special_tokens=False)) if reasoning else 0
    assert expected > 0 or not reasoning
    request = dict(chat_template_kwargs=kwargs, tool_choice="none")
    for stream in (False, True):
        serving, engine = _chat(thinking, reply, reasoning_parser=parser)
        engine.token_ids = thinking.encode(reply, add_special_tokens=False)
        if stream:
            body = _request(stream=True, stream_options={"include_usage": True}, **request)

            async def events(body=body, serving=serving):
                response = await serving.create_chat_completion(body)
                return [event async for event in response.body_iterator]

            *_, last, done = asyncio.run(events())
            assert done.strip() == "data: [DONE]"
            usage = json.loads(last.removeprefix("data: "))["usage"]
        else:
            usage = _run(serving, _request(**request)).usage.model_dump()
        assert usage["completion_tokens_details"] == {"reasoning_tokens": expected}, stream
    serving, _ = _chat(thinking, reply)  # no reasoning parser: no details (vLLM's rule)
    assert _run(serving, _request(**request)).usage.completion_tokens_details is None


def test_with_qwen3_the_constraint_also_starts_at_a_tool_call_token(tokenizer):
    """Qwen3 may open a <tool_call> without closing its thinking: the reply reader ends the
    reasoning there, and so must the grammar (vLLM's implicit reasoning end)."""
    from transformers import AutoTokenizer

    qwen_like = AutoTokenizer.from_pretrained(default_model_path())
    qwen_like.add_special_tokens({"additional_special_tokens": ["<tool_call>"]})
    (tool_call,) = qwen_like.encode("<tool_call>", add_special_tokens=False)
    serving, engine = _chat(qwen_like, '{"city": "Oslo", "days": 1}', reasoning_parser="qwen3")
    _run(serving, _request(tool_choice=NAMED))
    constraint = engine.requests[0][1]["structured_outputs"]
    assert constraint.reasoning_end_token_ids == qwen_like.encode(
        "</think>", add_special_tokens=False
    )
    assert constraint.reasoning_implicit_end_token_ids == [tool_call]
    serving, engine = _chat(tokenizer, '{"city": "Oslo", "days": 1}', reasoning_parser="qwen3")
    _run(serving, _request(tool_choice=NAMED))  # a vocabulary without such a token: none
    assert engine.requests[0][1]["structured_outputs"].reasoning_implicit_end_token_ids is None


@pytest.mark.parametrize("tool_choice", [NAMED, "required"])
def test_a_tool_choice_and_a_structured_output_field_together_are_a_400(tokenizer, tool_choice):
    serving, engine = _chat(tokenizer, "x")
    request = _request(tool_choice=tool_choice, response_format={"type": "json_object"})
    with pytest.raises(BadRequestError) as error:
        _run(serving, request)
    assert error.value.param == "response_format" and "not both" in str(error.value)
    assert engine.requests == []


def test_with_a_reasoning_parser_a_response_format_also_waits_for_the_reasoning(tokenizer):
    serving, engine = _chat(tokenizer, '<think>k</think>{"a": 1}', reasoning_parser="deepseek_r1")
    request = ChatCompletionRequest(
        messages=[{"role": "user", "content": "Hi"}], response_format={"type": "json_object"}
    )
    (choice,) = _run(serving, request).choices
    assert (choice.message.reasoning, choice.message.content) == ("k", '{"a": 1}')
    constraint = engine.requests[0][1]["structured_outputs"]
    assert constraint.json_object is True
    assert constraint.reasoning_end_token_ids == tokenizer.encode(
        "</think>", add_special_tokens=False
    )


def test_explicit_null_tool_choice_reads_as_auto_only_with_the_flag(tokenizer):
    reply = REPLIES["hermes"][0]
    serving, _ = _chat(tokenizer, reply, tool_parser="hermes")
    (choice,) = _run(serving, _request(tool_choice=None)).choices
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather", "get_time"]
    serving, _ = _chat(tokenizer, reply, tool_parser="hermes", auto=False)
    (choice,) = _run(serving, _request(tool_choice=None)).choices
    assert choice.message.content == reply and choice.message.tool_calls == []


def _message(serving, request) -> tuple[str | None, list, str]:
    """(content, [(name, arguments)], finish_reason) of the reply, whole or streamed."""
    if request.stream:
        message, _ = _streamed(serving, request)
        calls = [
            (c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]
        ]
        return message["content"] or None, calls, message["finish_reason"]
    (choice,) = _run(serving, request).choices
    return choice.message.content or None, _calls(choice.message.tool_calls), choice.finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_required_cut_by_max_tokens_returns_its_complete_calls_and_length(tokenizer, stream):
    cut = REQUIRED_REPLY[: REQUIRED_REPLY.index('"Europe/Rome"')]
    serving, _ = _chat(tokenizer, cut, finish_reason="length")
    content, calls, finish_reason = _message(
        serving, _request(tool_choice="required", stream=stream)
    )
    assert calls == [("get_weather", {"city": "Rome", "days": 3})]
    assert finish_reason == "length" and content is None


# Cases of vLLM 0.34's own tests of the chat endpoint's tool handling
# (tests/tool_use/test_chat_completion_request_validations.py,
# tests/entrypoints/openai/chat_completion/test_completion_with_function_calling.py and
# test_serving_chat.py): same requests, same expected answers.


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", [NAMED, "required"])
def test_vllm_a_forced_choice_cut_at_one_token_returns_no_call(tokenizer, tool_choice, stream):
    first_token = "{" if tool_choice is NAMED else "["
    serving, _ = _chat(tokenizer, first_token, finish_reason="length")
    request = _request(tool_choice=tool_choice, max_completion_tokens=1, stream=stream)
    if stream and tool_choice is NAMED:
        pytest.skip("a named call's arguments stream as they are written")
    content, calls, finish_reason = _message(serving, request)
    assert (content, calls, finish_reason) == (None, [], "length")


@pytest.mark.parametrize(
    "tool_choice, reply, engine_reason, finish_reason, called",
    [
        ("auto", REPLIES["hermes"][0], "stop", "tool_calls", True),
        ("auto", REPLIES["hermes"][0], "length", "length", True),
        ("required", "Hello, how are you?", "stop", "stop", False),
        (NAMED, '{"city": "Oslo", "days": 1}', "stop", "stop", True),
    ],
)
def test_vllm_finish_reason_matches_the_tool_calls(
    tokenizer, tool_choice, reply, engine_reason, finish_reason, called
):
    serving, _ = _chat(tokenizer, reply, tool_parser="hermes", finish_reason=engine_reason)
    (choice,) = _run(serving, _request(tool_choice=tool_choice)).choices
    assert choice.finish_reason == finish_reason
    assert bool(choice.message.tool_calls) == called


def _body(**fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "Hello"}]} | fields


@pytest.mark.parametrize("tool_choice", [None, "none", "auto", "required"])
def test_vllm_empty_tools_are_no_tools(tool_choice):
    fields = {"tools": []} | ({} if tool_choice is None else {"tool_choice": tool_choice})
    request = ChatCompletionRequest.model_validate(_body(**fields))
    assert request.tools is None and request.tool_choice == "none"


def test_vllm_empty_tools_with_a_named_choice_name_the_missing_tool():
    with pytest.raises(ValueError, match="The tool `f` specified"):
        ChatCompletionRequest.model_validate(
            _body(tools=[], tool_choice={"type": "function", "function": {"name": "f"}})
        )


def test_vllm_reasoning_content_of_input_messages_is_renamed_reasoning():
    assistant = {"role": "assistant", "content": "4", "reasoning_content": "2+2 equals 4"}
    request = ChatCompletionRequest.model_validate(
        _body(messages=[{"role": "user", "content": "What is 2+2?"}, assistant])
    )
    message = request.messages[1].model_dump(exclude_none=True)
    assert message["reasoning"] == "2+2 equals 4" and "reasoning_content" not in message
    both = assistant | {"reasoning": "from reasoning field"}
    request = ChatCompletionRequest.model_validate(
        _body(messages=[{"role": "user", "content": "?"}, both])
    )
    message = request.messages[1].model_dump(exclude_none=True)
    assert message["reasoning"] == "from reasoning field" and "reasoning_content" not in message
    plain = ChatCompletionRequest.model_validate(_body()).messages[0].model_dump(exclude_none=True)
    assert "reasoning" not in plain and "reasoning_content" not in plain


def _validation_error(body: dict) -> tuple[str, str | None]:
    """The 400 (message, param) the server answers for ``body``."""
    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError

    from jaxpaged.entrypoints.openai.errors import _validation_message

    with pytest.raises(ValidationError) as error:
        ChatCompletionRequest.model_validate(body)
    errors = [dict(e, loc=("body", *e["loc"])) for e in error.value.errors()]
    return _validation_message(RequestValidationError(errors))


def test_duplicate_tool_names_are_a_400_naming_tools():
    message, param = _validation_error(_body(tools=[WEATHER_TOOL, TIME_TOOL, WEATHER_TOOL]))
    assert param == "tools" and "get_weather" in message and "more than once" in message


@pytest.mark.parametrize(
    "tool_choice",
    ["sometimes", 5, {"type": "function"}, {"type": "function", "function": {}},
     {"type": "function", "function": {"name": 3}}, {"function": {"name": "get_weather"},
     "type": "tool"}],
)  # fmt: skip
def test_a_bad_tool_choice_is_a_400_naming_tool_choice_plainly(tool_choice):
    message, param = _validation_error(_body(tools=[WEATHER_TOOL], tool_choice=tool_choice))
    assert param in ("tool_choice", "tool_choice.function", "tool_choice.function.name")
    assert "literal[" not in message and "ChatCompletionNamed" not in message
    assert "tool_choice" in message


def test_an_assistants_reasoning_reaches_the_template_under_both_names(tokenizer):
    template = (
        "{% for m in messages %}{{ m.role }}|{{ m.reasoning }}|{{ m.reasoning_content }}\n"
        "{% endfor %}"
    )
    serving = OpenAIServingChat(
        _ScriptedEngine("x"), tokenizer, ["m"], 4096, chat_template=template
    )
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "2+2 equals 4"},
    ]
    request = ChatCompletionRequest(messages=messages)
    prompt = asyncio.run(serving.render_messages(request.messages))
    assert prompt == "user||\nassistant|2+2 equals 4|2+2 equals 4\n"
