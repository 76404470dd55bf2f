"""A client's chat template is a program the server runs: hostile ones are a fast 400, and the
server keeps serving with its KV cache back to empty."""

from __future__ import annotations

import time

import httpx
import pytest

from jaxpaged.entrypoints.openai.template_sandbox import TemplateLimitError, TemplateSandbox
from tests.live_server import API_KEY, MODEL_NAME

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MESSAGES = [{"role": "user", "content": "Tell me a story"}]
# Each was minutes of CPU, a 500 or a memory blow-up when rendered by transformers in process.
HOSTILE = {
    "nested loops": "{% for i in range(99999) %}{% for j in range(99999) %}{% for k in "
    "range(99999) %}{% endfor %}{% endfor %}{% endfor %}",
    "huge range": "{% for i in range(100000000) %}{% endfor %}",
    "string multiplication": "{{ 'x' * 10**10 }}",
    "string doubling": "{% set s = namespace(v='ab') %}{% for i in range(64) %}"
    "{% set s.v = s.v ~ s.v %}{% endfor %}{{ s.v }}",
    "wide format": "{{ '{:>2000000000}'.format(1) }}",
    "class escape": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "globals escape": "{{ cycler.__init__.__globals__.os.system('true') }}",
    "mutation": "{% set _ = messages.append(1) %}",
}


@pytest.fixture(scope="module")
def sandbox():
    box = TemplateSandbox(timeout_s=1.0)  # short: the hostile cases wait it out
    yield box
    box.close()


def test_a_plain_template_renders_like_transformers(sandbox, stories_llm):
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'] | upper }}: {{ m.content | tojson }}"
        "\n{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    )
    tokenizer = stories_llm.get_tokenizer()
    context = {
        "bos_token": tokenizer.bos_token,
        "messages": MESSAGES,
        "add_generation_prompt": True,
    }
    expected = tokenizer.apply_chat_template(
        MESSAGES, chat_template=template, add_generation_prompt=True, tokenize=False
    )
    assert sandbox.render(template, context) == expected


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_templates_fail_fast_naming_the_limit(sandbox, name):
    start = time.monotonic()
    with pytest.raises(TemplateLimitError, match="chat template"):
        sandbox.render(HOSTILE[name], {"messages": MESSAGES})
    assert time.monotonic() - start < 5.0
    assert (
        sandbox.render("{{ messages[0].content }}", {"messages": MESSAGES})
        == MESSAGES[0]["content"]
    )


def test_raise_exception_and_syntax_errors_carry_their_message(sandbox):
    with pytest.raises(TemplateLimitError, match="roles must alternate"):
        sandbox.render("{{ raise_exception('roles must alternate') }}", {})
    with pytest.raises(TemplateLimitError, match="TemplateSyntaxError"):
        sandbox.render("{% for %}", {})


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        yield client


@pytest.mark.parametrize("name", ["nested loops", "huge range", "string multiplication"])
def test_a_hostile_request_template_is_a_fast_400_and_the_server_keeps_serving(http, server, name):
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2, "chat_template": ""}
    body["chat_template"] = HOSTILE[name]
    start = time.monotonic()
    response = http.post("/v1/chat/completions", json=body)
    assert time.monotonic() - start < 6.0
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "chat_template"
    tokenize = {"model": MODEL_NAME, "messages": MESSAGES, "chat_template": HOSTILE[name]}
    assert http.post("/tokenize", json=tokenize).status_code == 400
    ok = http.post(
        "/v1/chat/completions", json=body | {"chat_template": "{{ messages[0].content }}"}
    )
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] > 0
    stats = server.wait_idle()
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"]


def test_a_request_template_gets_the_tokenizers_special_tokens_and_continues_a_message(http):
    body = {
        "model": MODEL_NAME,
        "messages": [*MESSAGES, {"role": "assistant", "content": "Once there was"}],
        "max_tokens": 1,
        "add_generation_prompt": False,
        "continue_final_message": True,
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}\n{% endfor %}",
    }
    rendered = http.post(
        "/tokenize",
        json={k: v for k, v in body.items() if k != "max_tokens"} | {"return_token_strs": True},
    ).json()
    # The BOS the template writes, then the text, cut right after the final message.
    assert rendered["tokens"][0] == 1 and rendered["token_strs"][-1].endswith("was")
    assert http.post("/v1/chat/completions", json=body).status_code == 200


def test_a_request_template_sees_tools_and_parsed_tool_call_arguments(http, stories_llm):
    from tests.entrypoints.openai.tool_template import TOOL_CHAT_TEMPLATE, WEATHER_TOOL

    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    body = {
        "model": MODEL_NAME,
        "messages": messages,
        "tools": [WEATHER_TOOL],
        "chat_template": TOOL_CHAT_TEMPLATE,
    }
    tokens = http.post("/tokenize", json=body).json()["tokens"]
    # transformers in process, the arguments parsed to a dict (what vLLM hands templates).
    parsed_call = {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    parsed = [messages[0], {**messages[1], "tool_calls": [parsed_call]}, messages[2]]
    tokenizer = stories_llm.get_tokenizer()
    expected = tokenizer.apply_chat_template(
        parsed,
        chat_template=TOOL_CHAT_TEMPLATE,
        tools=[WEATHER_TOOL],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert "tools: get_weather" in expected and '{"city": "Paris"}' in expected
    assert tokens == tokenizer.encode(expected, add_special_tokens=False)


def test_a_rendered_text_too_long_for_the_context_is_refused_before_tokenizing(http, server):
    """Just under the sandbox's output cap (16 M characters): rendered fast, then it was
    tokenized in full (18 s of CPU, 5.7 GB). Now its length alone refuses it."""
    template = '{{ range(99999)|join("x"*160) }}'
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2, "chat_template": template}
    start = time.monotonic()
    response = http.post("/v1/chat/completions", json=body)
    assert time.monotonic() - start < 6.0
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and "characters" in error["message"], error
    stats = server.wait_idle()
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"]


def test_a_completion_prompt_too_long_for_the_context_is_refused_before_tokenizing(http):
    body = {"model": MODEL_NAME, "prompt": "x" * 4_000_000, "max_tokens": 2}
    start = time.monotonic()
    response = http.post("/v1/completions", json=body)
    assert time.monotonic() - start < 6.0
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt" and "characters" in error["message"]
    # Truncation asks for the whole text to be tokenized: not refused by its length.
    short = {"model": MODEL_NAME, "prompt": "Once upon a time " * 40, "max_tokens": 2,
             "truncate_prompt_tokens": 16}  # fmt: skip
    assert http.post("/v1/completions", json=short).status_code == 200


def test_a_worker_that_ran_out_of_memory_or_holds_too_much_is_replaced():
    """Python keeps a worker's freed small objects: one template left 1.5 GB resident in it.
    A worker is replaced after a MemoryError, and after any render leaving it above
    ``recycle_rss_bytes``; a plain render keeps its worker."""
    import os

    box = TemplateSandbox(num_workers=1, timeout_s=10.0, memory_bytes=512 * 2**20)
    try:
        assert box.render("{{ 1 }}", {}) == "1"
        (first,) = box.worker_pids()
        assert box.render("{{ 2 }}", {}) == "2" and box.worker_pids() == [first]
        with pytest.raises(TemplateLimitError, match="ran out of memory"):
            box.render("{{ 'x' * 1000000000 }}", {})
        assert box.worker_pids() == []  # stopped: the next render starts a fresh one
        with pytest.raises(ProcessLookupError):
            os.kill(first, 0)
        assert box.render("{{ 3 }}", {}) == "3" and box.worker_pids() != [first]
    finally:
        box.close()
    tiny = TemplateSandbox(num_workers=1, recycle_rss_bytes=1)  # every worker is "too big"
    try:
        assert tiny.render("{{ 4 }}", {}) == "4" and tiny.worker_pids() == []
    finally:
        tiny.close()


def test_a_full_render_queue_refuses_at_once():
    import asyncio

    box = TemplateSandbox(num_workers=1, max_queued=1, timeout_s=0.5)
    box.render("{{ 1 }}", {})

    async def run():
        loop_template = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
        renders = [box.render_async(loop_template + "{% endfor %}", {}) for _ in range(4)]
        return await asyncio.gather(*renders, return_exceptions=True)

    try:
        start = time.monotonic()
        results = asyncio.run(run())
        names = sorted(type(r).__name__ for r in results)
        assert names == ["TemplateLimitError"] * 2 + ["TemplateQueueFullError"] * 2
        assert box.num_admitted == 0 and time.monotonic() - start < 5.0
    finally:
        box.close()
