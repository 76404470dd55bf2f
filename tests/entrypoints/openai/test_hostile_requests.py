"""Request content that made the API process or the engine core raise (a 500, and the
keep-alive connection reset) is a 400 naming its field, and a client's chat templates queue
apart from everything else: a full queue is a fast 503, and other requests never wait on it."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest

from jaxpaged.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from jaxpaged.entrypoints.openai.request_checks import MAX_JSON_DEPTH, FieldValueError, check_body
from jaxpaged.entrypoints.openai.template_sandbox import TemplateSandbox
from tests.live_server import API_KEY, MODEL_NAME

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MESSAGES = [{"role": "user", "content": "Tell me a story"}]
BIG = 10**40


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        yield client


def _raw(http, path: str, raw: str) -> httpx.Response:
    return http.post(path, content=raw, headers={"Content-Type": "application/json"})


def _tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def _nested_schema(levels: int) -> dict:
    schema = {"type": "object"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _chat(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2, **fields}


def _completion(**fields) -> dict:
    return {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 2, **fields}


BIG_SCHEMA = {"type": "integer", "maximum": BIG}


@pytest.mark.parametrize(
    "route, body, param",
    [
        # msgpack at the process boundary: TypeError "cannot encode int".
        ("completions", _completion(guided_json=BIG_SCHEMA), "guided_json.maximum"),
        (
            "chat/completions",
            _chat(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": BIG_SCHEMA},
                }
            ),
            "response_format.json_schema.schema",
        ),
        (
            "chat/completions",
            _chat(
                tools=[_tool({"type": "object", "properties": {"n": BIG_SCHEMA}})],
                tool_choice="required",
            ),
            "tools[0].function.parameters",
        ),
        (
            "chat/completions",
            _chat(
                tools=[_tool({"type": "object", "properties": {"n": BIG_SCHEMA}})],
                tool_choice="none",
            ),
            "tools[0].function.parameters",
        ),
        # jsonschema's check of a tool schema 120 levels deep (5 KB): RecursionError.
        (
            "chat/completions",
            _chat(tools=[_tool(_nested_schema(120))], tool_choice="none"),
            "tools[0].function.parameters",
        ),
    ],
)
def test_unencodable_content_is_a_400_naming_its_field_on_a_kept_connection(
    http, route, body, param
):
    response = http.post(f"/v1/{route}", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert ("64-bit" in error["message"]) or (f"deeper than {MAX_JSON_DEPTH}" in error["message"])
    # The same keep-alive connection serves the next request (a 500 closed it before).
    assert http.post("/v1/completions", json=_completion()).status_code == 200


def test_an_internal_error_is_a_500_that_keeps_the_connection(http, monkeypatch):
    """Starlette's catch-all handler re-raised after answering, and uvicorn then closed the
    connection: the client's next request on it failed with "connection reset"."""
    from jaxpaged.entrypoints.openai.serving_completion import OpenAIServingCompletion

    async def broken(self, request):
        raise RuntimeError("a bug")

    with monkeypatch.context() as patch:
        patch.setattr(OpenAIServingCompletion, "create_completion", broken)
        response = http.post("/v1/completions", json=_completion())
    assert response.status_code == 500
    assert response.json()["error"]["message"] == "internal server error: RuntimeError: a bug"
    assert http.post("/v1/completions", json=_completion()).status_code == 200


@pytest.mark.parametrize("value", ["Infinity", "-Infinity", "NaN"])
def test_a_non_finite_logit_bias_is_refused_naming_the_field(http, value):
    """vLLM clamps a bias to [-100, 100], so Infinity became a bias of 100."""
    raw = '{"model": "%s", "prompt": "hi", "max_tokens": 1, "logit_bias": {"5": %s}}' % (
        MODEL_NAME,
        value,
    )
    response = _raw(http, "/v1/completions", raw)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "logit_bias.5"


def test_offline_logit_bias_and_float32_overflowing_values_are_refused():
    from jaxpaged import SamplingParams

    for value in (math.inf, -math.inf):
        with pytest.raises(ValueError, match="logit_bias values must be finite") as caught:
            SamplingParams(logit_bias={5: value})
        assert caught.value.parameter == "logit_bias"
    assert SamplingParams(logit_bias={5: 1e6}).logit_bias == {5: 100.0}  # vLLM's clamp
    for name in ("temperature", "repetition_penalty"):
        with pytest.raises(ValueError, match=r"float32's range") as caught:
            SamplingParams(**{name: 1e39})
        assert caught.value.parameter == name


def test_check_body_names_the_first_offending_value_and_passes_real_bodies():
    ok = {
        "model": "m",
        "prompt": list(range(1000)),
        "tools": [_tool(_nested_schema(40))],
        "seed": -(2**63),
        "logit_bias": {"5": -100.0},
        "stop_token_ids": [2**64 - 1],
    }
    check_body(ok)
    with pytest.raises(FieldValueError) as caught:
        check_body({"a": [1, {"b": [BIG]}], "c": -BIG})
    assert caught.value.parameter == "a[1].b" and "a[1].b[0] holds an integer of 41 digits" in str(
        caught.value
    )
    with pytest.raises(FieldValueError) as caught:
        check_body({"x": {"y": {"z": {"w": -BIG}}}})
    assert caught.value.parameter == "x.y.z"
    deep = {"k": []}
    inner = deep["k"]
    for _ in range(MAX_JSON_DEPTH):
        inner.append([])
        inner = inner[0]
    with pytest.raises(FieldValueError, match=f"deeper than {MAX_JSON_DEPTH} levels"):
        check_body(deep)
    # Top-level integers are left to their declared types (pydantic words their bounds).
    with pytest.raises(ValueError, match="less than or equal to 9223372036854775807"):
        CompletionRequest.model_validate({"prompt": "x", "seed": 2**63})


def test_check_body_checks_flat_lists_in_one_pass_and_still_names_the_item():
    """Lists of strings and numbers (choices, enums, stop strings) are checked in C-level
    passes, and the first offending item is still the one named."""
    check_body({"guided_choice": [f"item{i}" for i in range(1000)], "stop": ["a", None, 1.5]})
    with pytest.raises(
        FieldValueError, match=r"guided_json.enum\[3\] holds a lone surrogate"
    ) as caught:
        check_body({"guided_json": {"enum": ["a", 1, "b", "\udc00", "\ud800"]}})
    assert caught.value.parameter == "guided_json.enum"
    # A high and a low surrogate side by side stay two lone ones when joined.
    with pytest.raises(FieldValueError, match=r"x\[0\] holds a lone surrogate U\+D800"):
        check_body({"x": ["\ud800", "\udc00"]})
    with pytest.raises(FieldValueError, match=r"x\[1\] is nan"):
        check_body({"x": ["a", math.nan]})


# A value of each kind that broke something, for every declared field.
_HOSTILE_VALUES = {
    "bigint in object": '{"a": %d}' % BIG,
    "bigint in list": "[%d]" % BIG,
    "deep": "[" * 150 + "]" * 150,
    "deep object": '{"a":' * 150 + "1" + "}" * 150,
    "infinity": "Infinity",
    "nan": "NaN",
    "negative bigint": "-%d" % BIG,
}


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_no_field_of_a_request_makes_a_500(http, route):
    """Every declared field, set to each kind of value that made a 500 somewhere: a 400 (or
    a 200 where the field takes it), never a 500, and the connection stays up."""
    model = CompletionRequest if route == "completions" else ChatCompletionRequest
    base = _completion(max_tokens=1) if route == "completions" else _chat(max_tokens=1)
    failures = []
    for field in model.model_fields:
        for name, value in _HOSTILE_VALUES.items():
            fields = {k: json.dumps(v) for k, v in base.items() if k != field}
            fields[field] = value
            raw = "{" + ", ".join(f'"{k}": {v}' for k, v in fields.items()) + "}"
            response = _raw(http, f"/v1/{route}", raw)
            if response.status_code >= 500:
                failures.append((field, name, response.text[:200]))
    assert not failures, failures


def test_deep_tool_call_arguments_stay_text_for_the_template(http):
    """An assistant's ``arguments`` are parsed for the template; a string nested 5,000 deep
    raised RecursionError there (a 500). Such arguments stay text."""
    call = {"id": "1", "type": "function",
            "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}  # fmt: skip
    messages = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [call]}]
    response = http.post("/v1/chat/completions", json=_chat(messages=messages))
    assert response.status_code == 200, response.text


# --------------------------------------------------------------------- chat template queue
HOSTILE_TEMPLATE = (
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
)


def test_template_renders_queue_apart_and_a_full_queue_is_a_fast_503(server, monkeypatch):
    """Twelve hostile templates at once: one renders, two wait, nine are refused at once
    (503, Retry-After); a long completion prompt, tokenized off the event loop, is answered
    before any of the admitted templates has run out its budget (before, it waited behind
    them on the shared worker threads: 13 s)."""
    sandbox = TemplateSandbox(num_workers=1, max_queued=2, timeout_s=1.0)
    sandbox.render("{{ 1 }}", {})  # its worker is started: the budget is the template's own
    monkeypatch.setattr(server.app.state.chat, "template_sandbox", sandbox)
    order: list[str] = []

    async def hostile(client):
        body = _chat(chat_template=HOSTILE_TEMPLATE)
        response = await client.post("/v1/chat/completions", json=body)
        order.append(f"template {response.status_code}")
        return response

    async def plain(client):
        await asyncio.sleep(0.2)  # the templates are admitted first
        # Past the size that is tokenized in a worker thread (serving_engine).
        body = _completion(prompt="Once upon a time " * 300, truncate_prompt_tokens=32)
        response = await client.post("/v1/completions", json=body)
        order.append(f"plain {response.status_code}")
        return response

    async def run():
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(
            base_url=server.url, headers=AUTH, timeout=60, limits=limits
        ) as client:
            return await asyncio.gather(*[hostile(client) for _ in range(12)], plain(client))

    try:
        *templates, completion = asyncio.run(run())
    finally:
        sandbox.close()
    assert completion.status_code == 200, completion.text
    codes = sorted(r.status_code for r in templates)
    assert codes == [400] * 3 + [503] * 9, codes
    busy = next(r for r in templates if r.status_code == 503)
    assert busy.headers["Retry-After"] == "1"
    assert "retry later" in busy.json()["error"]["message"]
    # Refusals first, then the plain completion, then the templates' budgets running out.
    assert order[:9] == ["template 503"] * 9 and order[9] == "plain 200", order
