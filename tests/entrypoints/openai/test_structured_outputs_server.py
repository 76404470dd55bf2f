"""Structured outputs through the server with the ``openai`` client: ``structured_outputs``,
the ``guided_*`` aliases and ``response_format`` on completions and chat; bad constraints and
two constraints at once are a 400 naming the field, and the server keeps serving with its KV
cache empty."""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest

from tests.entrypoints.openai.test_api_server import _metrics, _value
from tests.live_server import MODEL_NAME
from tests.structured_output.schemas import SCHEMAS

pytest.importorskip("xgrammar")
openai = pytest.importorskip("openai")

PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Tell me about Lily"}]
COMPACT = {"disable_any_whitespace": True}
SERVED_SCHEMAS = [SCHEMAS[i] for i in (0, 2, 7, 17, 20, 26, 32, 36)]


def _complete(client, **extra):
    extra = {"max_tokens": 60, "temperature": 0.0, **extra}
    return client.completions.create(model=MODEL_NAME, prompt=PROMPT, **extra)


def _chat(client, **extra):
    extra = {"max_tokens": 60, **extra}
    return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **extra)


@pytest.mark.parametrize("schema", SERVED_SCHEMAS)
def test_completions_structured_outputs_json_validates(client, schema):
    body = {"structured_outputs": {"json": schema, **COMPACT}}
    choice = _complete(client, extra_body=body).choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.text), schema)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_response_format_json_schema_validates(client, temperature):
    # response_format has no whitespace option: a schema without room for whitespace keeps the
    # tiny model (which loves newlines) from running out of tokens.
    schema = SCHEMAS[7]
    response = _chat(
        client,
        temperature=temperature,
        seed=4,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_response_format_json_object_on_both_endpoints(client):
    fmt = {"type": "json_object"}
    texts = [
        _complete(client, extra_body={"response_format": fmt}, max_tokens=100).choices[0],
        _chat(client, temperature=0.0, response_format=fmt, max_tokens=100).choices[0],
    ]
    for choice in texts:
        text = getattr(choice, "text", None) or choice.message.content
        assert text.lstrip().startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)


def test_guided_aliases_on_completions_and_chat(client):
    regex = _complete(client, extra_body={"guided_regex": r"[a-c]{3}-\d{2}"}).choices[0]
    assert re.fullmatch(r"[a-c]{3}-\d{2}", regex.text)
    choice = _chat(client, temperature=1.0, extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].message.content in ("yes", "no")
    js = _complete(client, extra_body={"guided_json": SCHEMAS[17]}, max_tokens=100).choices[0]
    if js.finish_reason == "stop":  # free whitespace: the tiny model may still run out
        jsonschema.validate(json.loads(js.text), SCHEMAS[17])
    grammar = 'root ::= "<" [a-z] [a-z]? ">"'
    g = _complete(client, extra_body={"guided_grammar": grammar}).choices[0]
    assert re.fullmatch(r"<[a-z]{1,2}>", g.text)


def test_streamed_constrained_chat_concatenates_to_valid_json(client):
    schema = SCHEMAS[20]
    stream = _chat(
        client,
        temperature=0.0,
        stream=True,
        extra_body={"structured_outputs": {"json": schema, **COMPACT}},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize(
    ("route", "extra", "param"),
    [
        ("completions", {"guided_json": {"type": "bogus"}}, "guided_json"),
        ("completions", {"guided_regex": "(unclosed"}, "guided_regex"),
        ("completions", {"guided_grammar": "root ::= nowhere"}, "guided_grammar"),
        ("chat", {"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
        ("chat", {"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs.regex"),
        ("chat", {"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
        (
            "completions",
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "response_format",
        ),
        (
            "chat",
            {"response_format": {"type": "json_schema", "json_schema": {}}},
            "response_format",
        ),
        ("chat", {"response_format": {"type": "yaml"}}, "response_format"),
        ("completions", {"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
        # A named backend would be silently replaced by the engine's: refused, not ignored.
        ("chat", {"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
        ("completions", {"guided_decoding_backend": "guidance"}, "guided_decoding_backend"),
        (
            "completions",
            {"guided_json": {"type": "string"}, "guided_whitespace_pattern": " *"},
            "guided_whitespace_pattern",
        ),
    ],
)
def test_bad_constraints_are_a_400_naming_the_field(client, http_metrics, route, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        if route == "completions":
            _complete(client, extra_body=extra)
        else:
            _chat(client, extra_body=extra)
    assert info.value.body["param"] == param, info.value.body
    assert _complete(client, max_tokens=2).choices[0].finish_reason == "length"  # still serving
    assert http_metrics() == 0


@pytest.fixture
def http_metrics(server):
    import httpx

    from tests.live_server import API_KEY

    def kv_usage():
        server.wait_idle()
        with httpx.Client(
            base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}
        ) as http:
            return _value(_metrics(http), "jaxpaged:kv_cache_usage_perc")

    return kv_usage


def _nested(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    ("route", "extra", "param", "needle"),
    [
        # Past the grammar nesting limit (64) but within the body check's (100 levels).
        ("completions", {"guided_json": _nested(40)}, "guided_json", "nested too deeply"),
        # The body's own nesting bound (100 JSON levels, request_checks) comes first: a schema
        # nested deeper than ~49 levels never reaches the grammar's 64 (test_admission.py).
        (
            "completions",
            {"guided_json": _nested(440)},
            "guided_json.properties.a",
            "deeper than 100 levels",
        ),
        ("completions", {"guided_grammar": 'root ::= root "a"'}, "guided_grammar", "no complete"),
        ("chat", {"guided_regex": r"[^\s\S]"}, "guided_regex", "no complete text"),
        ("chat", {"guided_json": {"$ref": "file:///etc/passwd"}}, "guided_json", "external $ref"),
        (
            "chat",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": {"type": "integer", "multipleOf": 3}},
                }
            },
            "response_format",
            "multipleOf",
        ),
    ],
)
def test_hostile_constraints_are_a_400_when_added(
    client, http_metrics, route, extra, param, needle
):
    # Before: accepted with 200, then "abort" (or any JSON, or minutes of compilation).
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as info:
        if route == "completions":
            _complete(client, extra_body=extra)
        else:
            _chat(client, extra_body=extra)
    assert time.monotonic() - started < 10
    assert info.value.body["param"] == param, info.value.body
    assert needle in info.value.body["message"]
    assert http_metrics() == 0


def test_a_compiling_grammar_never_holds_up_other_requests(client):
    # ~1 s of xgrammar compilation on the core's workers; before, the step that first sampled
    # the request waited for it, and every other request with it.
    choices = [f"w{i}" for i in range(20_000)]
    done = {}

    def constrained():
        response = _complete(client, max_tokens=8, extra_body={"guided_choice": choices})
        done["constrained"] = (time.monotonic(), response.choices[0].text)

    thread = threading.Thread(target=constrained)
    thread.start()
    time.sleep(0.05)
    plain_done = []
    while thread.is_alive() and len(plain_done) < 3:
        _complete(client, max_tokens=4)
        plain_done.append(time.monotonic())
    thread.join(60)
    assert done["constrained"][1] in choices
    assert len(plain_done) >= 3 and plain_done[2] < done["constrained"][0]


def test_metrics_report_the_grammar_cache(client, server):
    import httpx

    from tests.live_server import API_KEY

    _complete(client, extra_body={"guided_regex": "[0-9]{3}"})
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        cached = _value(_metrics(http), "jaxpaged:grammar_cache_bytes")
    assert 0 < cached <= 512 << 20  # structured_outputs_config.grammar_cache_mb's default
