"""The server's routes, errors, disconnects, admission limit, metrics and engine death."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.live_server import API_KEY, MODEL_NAME, start_server

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http_client:
        yield http_client


@pytest.fixture
def slow_steps(server):
    """Make each engine step last at least ``delay`` seconds, so that step counts measure
    reaction times well above the server's own latency."""
    yield lambda delay: server.call("set_step_delay", delay)
    server.call("set_step_delay", 0.0)


def _complete(http, **body):
    return http.post(
        "/v1/completions", json={"model": MODEL_NAME, "prompt": "Once upon a time", **body}
    )


def test_models_version_health_tokenize_detokenize(http, server, stories_llm):
    models = http.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL_NAME, "alias"]
    assert all(m["object"] == "model" and m["max_model_len"] == 128 for m in models["data"])
    import jaxpaged

    assert http.get("/version").json() == {"version": jaxpaged.__version__}
    assert http.get("/health").status_code == 200

    tokenizer = stories_llm.get_tokenizer()
    ids = tokenizer.encode("Once upon a time")
    tokenized = http.post("/tokenize", json={"prompt": "Once upon a time"}).json()
    assert tokenized == {"count": len(ids), "max_model_len": 128, "tokens": ids, "token_strs": None}
    chat = http.post(
        "/tokenize",
        json={"messages": [{"role": "user", "content": "hi"}], "return_token_strs": True},
    ).json()
    assert chat["tokens"] == tokenizer.encode("user: hi\nassistant:", add_special_tokens=False)
    assert chat["token_strs"] == tokenizer.convert_ids_to_tokens(chat["tokens"])
    detokenized = http.post("/detokenize", json={"tokens": ids}).json()
    assert detokenized == {"prompt": tokenizer.decode(ids)}
    outside = http.post("/detokenize", json={"tokens": [1, len(tokenizer)]})
    _error(outside, 400, param="tokens", match="outside the vocabulary")
    # The alias is served too.
    assert _complete(http, model="alias", max_tokens=2).status_code == 200


def _error(response, status, param=None, match=""):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    assert error["param"] == param
    assert match in error["message"]
    return error


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(http, server):
    malformed = http.post(
        "/v1/completions",
        content=b'{"model": "stories", "prompt": ',
        headers={"Content-Type": "application/json"},
    )
    assert _error(malformed, 400, match="not valid JSON")["type"] == "BadRequestError"
    _error(_complete(http, max_tokens="many"), 400, "max_tokens", "valid integer")
    _error(
        _complete(http, max_tokens=-1), 400, "max_tokens", "max_tokens must be at least 1, got -1"
    )
    _error(_complete(http, temperature=-0.5), 400, "temperature", "non-negative")
    _error(_complete(http, prompt=["text", [1, 2]]), 400, "prompt", "list of token ids")
    # vLLM's messages (its tests match them).
    _error(_complete(http, prompt=[]), 400, "prompt", "The decoder prompt cannot be empty")
    either = "Either prompt or prompt_embeds must be provided and non-empty."
    _error(_complete(http, prompt=""), 400, "prompt", either)
    _error(_complete(http, prompt=None, prompt_embeds=[]), 400, "prompt", either)
    _error(_complete(http, prompt=[1, 99999]), 400, "prompt", "outside the vocabulary")
    _error(
        _complete(http, stream_options={"include_usage": True}),
        400,
        "stream_options",
        "stream is true",
    )
    _error(_complete(http, suffix="!"), 400, "suffix", "not supported")
    long_prompt = list(range(3, 3 + 120))
    too_long = _error(_complete(http, prompt=long_prompt, max_tokens=16), 400, "prompt")
    assert too_long["message"].startswith("This model's maximum context length is 128 tokens")
    assert "136 tokens (120 in the prompt, 16 in the completion)" in too_long["message"]
    no_room = _error(
        _complete(http, prompt=list(range(3, 3 + 128)), max_tokens=None), 400, "prompt"
    )
    assert no_room["message"].startswith("This model's maximum context length is 128 tokens")
    assert "128 input tokens" in no_room["message"]
    chat_no_messages = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": []})
    _error(chat_no_messages, 400, "messages")
    unknown = _error(
        _complete(http, model="gpt-4"), 404, "model", "The model `gpt-4` does not exist."
    )
    assert unknown["type"] == "NotFoundError"
    assert http.get("/v1/nothing-here").status_code == 404

    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}, headers=headers)
        assert _error(response, 401)["type"] == "AuthenticationError"
        assert httpx.get(f"{server.url}/v1/models", headers=headers).status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200  # only /v1 needs the key
    assert httpx.get(f"{server.url}/metrics").status_code == 200

    ok = _complete(http, max_tokens=3, temperature=0)
    assert ok.status_code == 200
    assert ok.json()["usage"]["completion_tokens"] == 3
    stats = server.wait_idle()
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"]


def test_ids_beyond_64_bits_are_a_400_naming_the_field_and_leave_nothing_behind(http, server):
    """JSON allows any integer, and no engine-core message can carry 2**70 (msgpack): such
    ids were a 500 that left the request counted as outstanding in the client."""
    huge = 2**70
    before = server.engine.core.num_outstanding
    _error(
        _complete(http, prompt=[1, huge]), 400, "prompt", f"token id {huge} is out of vocabulary"
    )
    _error(_complete(http, prompt=[[1], [2, -huge]]), 400, "prompt", "outside the vocabulary")
    _error(_complete(http, stop_token_ids=[huge]), 400, "stop_token_ids", "vocabulary size")
    _error(_complete(http, logit_bias={str(huge): 1}), 400, "logit_bias", "vocabulary size")
    _error(_complete(http, logprobs=huge), 400, "logprobs", "below 2**63")
    _error(_complete(http, prompt_logprobs=2**40), 400, "prompt_logprobs", "max_logprobs")
    assert server.engine.core.num_outstanding == before
    assert _complete(http, prompt=[1, 2], max_tokens=2).status_code == 200


def test_unsupported_sampling_field_is_a_400_naming_it_unless_neutral(server):
    from jaxpaged.entrypoints.openai.errors import BadRequestError
    from jaxpaged.entrypoints.openai.serving_engine import OpenAIServing

    serving = OpenAIServing(server.engine, server.engine.tokenizer, [MODEL_NAME], 128)
    serving._sampling_fields.discard("presence_penalty")  # as if the engine lacked it
    with pytest.raises(BadRequestError, match="presence_penalty is not supported") as info:
        serving.sampling_params({"presence_penalty": 0.5})
    assert info.value.param == "presence_penalty"
    assert serving.sampling_params({"presence_penalty": 0.0, "max_tokens": 4}).max_tokens == 4


def _metrics(http) -> dict[tuple[str, tuple], float]:
    samples = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            labels = tuple(sorted(sample.labels.items()))
            samples[(sample.name, labels)] = sample.value
    return samples


def _value(samples, name, **labels):
    key = (name, tuple(sorted({"model_name": MODEL_NAME, "engine": "0", **labels}.items())))
    return samples[key]


def test_metrics_parse_and_move_across_a_request(http, server, stories_llm):
    before = _metrics(http)
    prompt = "Once upon a time"
    response = _complete(http, prompt=prompt, max_tokens=5, temperature=0)
    assert response.status_code == 200
    server.wait_idle()
    after = _metrics(http)
    num_prompt = len(stories_llm.get_tokenizer().encode(prompt))

    def delta(name, **labels):
        return _value(after, name, **labels) - _value(before, name, **labels)

    assert delta("jaxpaged:prompt_tokens_total") == num_prompt
    assert delta("jaxpaged:generation_tokens_total") == 5
    assert delta("jaxpaged:request_success_total", finished_reason="length") == 1
    assert delta("jaxpaged:request_success_total", finished_reason="stop") == 0
    assert delta("jaxpaged:time_to_first_token_seconds_count") == 1
    assert delta("jaxpaged:inter_token_latency_seconds_count") == 4
    assert delta("jaxpaged:time_per_output_token_seconds_count") == 4
    assert delta("jaxpaged:e2e_request_latency_seconds_count") == 1
    assert delta("jaxpaged:request_queue_time_seconds_count") == 1
    assert delta("jaxpaged:e2e_request_latency_seconds_sum") > 0
    assert delta("jaxpaged:prefix_cache_queries_total") == num_prompt
    assert delta("jaxpaged:num_preemptions_total") == 0
    # Buckets are vLLM's.
    assert _value(after, "jaxpaged:time_to_first_token_seconds_bucket", le="2560.0") >= 1
    assert _value(after, "jaxpaged:e2e_request_latency_seconds_bucket", le="7680.0") >= 1
    for gauge in ("num_requests_running", "num_requests_waiting", "num_requests_swapped"):
        assert _value(after, f"jaxpaged:{gauge}") == 0
    assert _value(after, "jaxpaged:kv_cache_usage_perc") == 0
    assert _value(after, "jaxpaged:gpu_cache_usage_perc") == 0


def test_disconnect_mid_stream_aborts_within_two_steps_and_frees_blocks(http, server, slow_steps):
    slow_steps(0.05)
    aborted_before = _value(
        _metrics(http), "jaxpaged:request_success_total", finished_reason="abort"
    )
    body = {
        "model": MODEL_NAME,
        "prompt": "Once upon a time",
        "max_tokens": 100,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as one_off:
        with one_off.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            chunks = 0
            while chunks < 3:
                chunks += next(lines).startswith("data: ")
            stats = server.stats()
            assert stats["num_unfinished_requests"] == 1
            assert stats["num_free_blocks"] < stats["num_gpu_blocks"]
            steps_at_close = stats["num_steps"]
    stats = server.wait_idle()  # the core saw the abort
    assert stats["num_steps"] - steps_at_close <= 2
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"]
    after = _metrics(http)
    assert _value(after, "jaxpaged:request_success_total", finished_reason="abort") == (
        aborted_before + 1
    )
    # No step ran after the abort, yet the gauges show the idle engine (core ``stats`` message).
    assert _value(after, "jaxpaged:num_requests_running") == 0
    assert _value(after, "jaxpaged:kv_cache_usage_perc") == 0


def test_disconnect_while_waiting_for_a_whole_response_aborts(server, slow_steps):
    slow_steps(0.05)
    engine = server.engine
    body = {"model": MODEL_NAME, "prompt": "The cat", "max_tokens": 100, "ignore_eos": True}

    async def leave_early():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH) as one_off:
            request = asyncio.ensure_future(one_off.post("/v1/completions", json=body))
            while engine.num_steps < start + 3:
                await asyncio.sleep(0.01)
            request.cancel()  # closes the connection
            with contextlib.suppress(asyncio.CancelledError):
                await request

    start = engine.num_steps
    asyncio.run(leave_early())
    steps_at_close = server.stats()["num_steps"]
    stats = server.wait_idle()
    assert stats["num_steps"] - steps_at_close <= 2
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"]


@pytest.fixture
def queue_bound_of_one(server):
    server.call("set_max_num_queued_requests", 1)
    yield
    server.call("set_max_num_queued_requests", None)


def test_full_waiting_queue_answers_429_and_others_are_unaffected(
    server, slow_steps, queue_bound_of_one
):
    slow_steps(0.02)
    max_num_seqs = 8  # SMALL_ENGINE
    body = {"model": MODEL_NAME, "max_tokens": 60, "ignore_eos": True, "stream": True}

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as http_client:

            async def hold(i):
                request = http_client.build_request(
                    "POST", "/v1/completions", json=body | {"prompt": f"Story {i}"}
                )
                response = await http_client.send(request, stream=True)
                assert response.status_code == 200
                return response

            # max_num_seqs requests fill the batch, one more waits: the queue is full.
            held = [await hold(i) for i in range(max_num_seqs + 1)]
            deadline = time.monotonic() + 30
            while True:
                stats = await asyncio.to_thread(server.stats)
                if stats["num_requests_running"] == max_num_seqs:
                    if stats["num_requests_waiting"] >= 1:
                        break
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            rejected = await http_client.post("/v1/completions", json=body | {"prompt": "Late"})
            for response in held:
                await response.aclose()
            return rejected

    rejected = asyncio.run(scenario())
    error = _error(rejected, 429, match="max_num_queued_requests is 1")
    assert error["type"] == "RateLimitError"
    stats = server.wait_idle()
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"]


def test_engine_death_fails_in_flight_requests_and_health_and_new_requests_with_503():
    """The core's step raises once a whole response and a stream (chat sends its role chunk
    before any step) are both in flight: the core reports its death and exits."""
    running = start_server(chat_template="{{ 'x' }}")
    running.call("die_when_unfinished", 2, "device lost")
    completion = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 4}
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "stream": True}

    async def both():
        async with httpx.AsyncClient(base_url=running.url, timeout=60) as http_client:
            return await asyncio.gather(
                http_client.post("/v1/completions", json=completion),
                http_client.post("/v1/chat/completions", json=chat),
            )

    try:
        whole, stream = asyncio.run(both())
        assert _error(whole, 503, match="device lost")["type"] == "ServiceUnavailableError"
        assert stream.status_code == 200
        events = [line for line in stream.text.splitlines() if line]
        assert '"role":"assistant"' in events[0]  # vLLM's compact JSON
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == 503 and "device lost" in error["message"]
        with httpx.Client(base_url=running.url, timeout=60) as http_client:
            health = _error(http_client.get("/health"), 503, match="device lost")
            assert health["type"] == "ServiceUnavailableError"
            _error(http_client.post("/v1/completions", json=completion), 503, match="has died")
    finally:
        running.stop()
