"""The API process against a real engine-core process: core death, floods of streams, clients
that leave mid-stream, and an event loop that big prompts do not stall."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from tests.live_server import API_KEY, MODEL_NAME, start_server

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _stream_body(max_tokens: int, prompt="Once upon a time") -> dict:
    return {
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True,
    }  # fmt: skip


def test_killing_the_core_mid_stream_ends_streams_with_errors_and_health_503():
    """Streams (chat sends its role chunk before any step) and a whole response are open when
    the core is killed; its steps are paused, so no model step runs and nothing compiles."""
    running = start_server(chat_template="{{ 'x' }}")
    running.call("pause_steps")
    pid = running.engine.info["pid"]
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "stream": True}

    async def scenario():
        async with httpx.AsyncClient(base_url=running.url, timeout=60) as http:

            async def stream(i):
                events = []
                async with http.stream("POST", "/v1/chat/completions", json=chat) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if line:
                            events.append(line)
                            opened.release()
                return events, time.monotonic()

            async def whole():
                response = await http.post(
                    "/v1/completions", json=_stream_body(8) | {"stream": False}
                )
                return response, time.monotonic()

            opened = asyncio.Semaphore(0)
            streams = [asyncio.create_task(stream(i)) for i in range(3)]
            whole_task = asyncio.create_task(whole())
            for _ in streams:
                await asyncio.wait_for(opened.acquire(), 30)
            await asyncio.sleep(0.2)  # the whole response is in the core too
            os.kill(pid, signal.SIGKILL)
            kill_time = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*streams, whole_task), 10)
            return kill_time, results

    try:
        kill_time, results = asyncio.run(scenario())
        (response, whole_end) = results[-1]
        assert whole_end - kill_time < 3.0
        assert response.status_code == 503 and "exited with code" in response.text
        for events, ended in results[:-1]:
            assert ended - kill_time < 3.0  # no hang: every stream ends within seconds
            assert '"role":"assistant"' in events[0]  # vLLM's compact JSON
            assert events[-1] == "data: [DONE]"
            error = json.loads(events[-2].removeprefix("data: "))["error"]
            assert error["code"] == 503 and "exited with code" in error["message"]
        with httpx.Client(base_url=running.url, timeout=10) as http:
            health = http.get("/health")
            assert health.status_code == 503 and "has died" in health.text
            late = http.post("/v1/completions", json=_stream_body(4) | {"stream": False})
            assert late.status_code == 503 and "has died" in late.text
    finally:
        running.stop()


class _SilentProcess:
    """A core process that lives but says nothing (as one stopped with SIGSTOP)."""

    exitcode = None

    def __init__(self):
        self.killed = False

    def is_alive(self) -> bool:
        return not self.killed

    def kill(self) -> None:
        self.killed = True


def test_a_core_that_stops_answering_is_declared_dead_and_killed():
    from jaxpaged.engine_core.core_client import (
        CoreConnection,
        EngineCoreClient,
        EngineDeadError,
        RequestStream,
    )

    async def scenario():
        process = _SilentProcess()
        connection = CoreConnection(0, process, input_socket=None, info={})
        client = EngineCoreClient(
            connection,
            context=None,
            output_socket=None,
            ipc_dir="/nonexistent",
            tokenizer=None,
            heartbeat_timeout_s=0.3,
        )
        stream = RequestStream("r", client)
        client._requests["r"] = (None, stream)
        client.loop = asyncio.get_running_loop()
        watch = asyncio.create_task(client._watch())
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="did not answer for 0.3 s"):
            await asyncio.wait_for(anext(stream), 5)
        waited = time.monotonic() - start
        await asyncio.wait_for(watch, 1)
        assert client.is_dead and process.killed
        with pytest.raises(EngineDeadError):
            await client.add_request("late", {"prompt_token_ids": [1]}, None)
        return waited

    waited = asyncio.run(scenario())
    assert 0.3 <= waited < 1.5


def test_256_concurrent_streams_half_leaving_early_all_end_and_leak_no_block(server):
    """Every stream that stays gets all its tokens; every stream that leaves is aborted in the
    core; afterwards the core holds no request and no block."""

    async def scenario():
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=0)
        async with httpx.AsyncClient(
            base_url=server.url, headers=AUTH, timeout=120, limits=limits
        ) as http:

            async def one(i):
                leave = i % 2 == 1
                text, finish = "", None
                body = _stream_body(3, f"Story {i % 7}")
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        (choice,) = json.loads(line.removeprefix("data: "))["choices"]
                        text += choice["text"]
                        finish = choice["finish_reason"] or finish
                        if leave:
                            return None  # closes the connection mid-stream
                return text, finish

            return await asyncio.gather(*(one(i) for i in range(256)))

    results = asyncio.run(scenario())
    stayed = [r for r in results if r is not None]
    assert len(stayed) == 128
    assert all(finish == "length" and text for text, finish in stayed)
    stats = server.wait_idle()  # the core saw every abort; invariants hold
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"]
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0


def test_tokenizing_a_multi_megabyte_prompt_does_not_stall_health(server):
    """A prompt far too long for the context is a 400 before it is tokenized; one that asks to
    be truncated (``truncate_prompt_tokens``) is tokenized in full, in a worker thread, while
    /health keeps answering."""
    prompt = "Once upon a time there was a cat. " * 100_000  # 3.4 MB
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4}

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as http:
            start = time.monotonic()
            refused = await http.post("/v1/completions", json=body)
            refused_after = time.monotonic() - start
            truncating = body | {"truncate_prompt_tokens": 16}
            big = asyncio.create_task(http.post("/v1/completions", json=truncating))
            latencies = []
            start = time.monotonic()
            while not big.done():
                before = time.monotonic()
                assert (await http.get("/health")).status_code == 200
                latencies.append((before - start, time.monotonic() - before))
                await asyncio.sleep(0.02)
            return refused, refused_after, (await big), time.monotonic() - start, latencies

    refused, refused_after, response, took, latencies = asyncio.run(scenario())
    assert refused.status_code == 400 and "characters" in refused.text, refused.text
    assert refused_after < min(1.0, took / 4)  # not tokenized
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 16
    # Before the tokenizer ran in a thread, /health waited for the whole tokenization.
    assert took > 1.0 and len(latencies) >= 10
    worst = max(latency for _, latency in latencies)
    assert worst < min(1.0, took / 4), [(round(t, 2), round(lat, 3)) for t, lat in latencies]


def test_a_lagging_consumer_gets_the_newest_cumulative_output_then_the_error():
    """Outputs are cumulative: steps a consumer missed arrive merged into the newest one (no
    queue grows at saturation); an error that follows is raised after that output."""
    from jaxpaged.engine_core.core_client import RequestStream
    from jaxpaged.outputs import CompletionOutput, RequestOutput

    def output(num_tokens: int, finished: bool = False) -> RequestOutput:
        completion = CompletionOutput(
            index=0, text="x" * num_tokens, token_ids=list(range(num_tokens)),
            cumulative_logprob=None, logprobs=None, finish_reason=None,
        )  # fmt: skip
        return RequestOutput(
            request_id="r", prompt=None, prompt_token_ids=[1], outputs=[completion],
            finished=finished,
        )  # fmt: skip

    async def scenario():
        stream = RequestStream("r", client=None)
        for n in (1, 2, 3):
            stream._put(output(n))
        first = await asyncio.wait_for(anext(stream), 1)
        stream._put(output(4))
        stream._put(RuntimeError("core died"))
        second = await asyncio.wait_for(anext(stream), 1)
        with pytest.raises(RuntimeError, match="core died"):
            await asyncio.wait_for(anext(stream), 1)
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        late = RequestStream("r", client=None)
        waiter = asyncio.create_task(anext(late))
        await asyncio.sleep(0.01)
        assert not waiter.done()  # nothing put yet: the consumer waits
        late._put(output(5, finished=True))
        last = await asyncio.wait_for(waiter, 1)
        return first, second, last, late

    first, second, last, late = asyncio.run(scenario())
    assert first.outputs[0].token_ids == [0, 1, 2]
    assert second.outputs[0].token_ids == [0, 1, 2, 3]
    assert last.finished and late.finished


def test_the_core_process_freezes_its_start_up_heap(server):
    """The engine the core built is in CPython's permanent generation (``freeze_gc_heap``), so
    a full collection in the serving loop does not walk it: a tiny engine is thousands of
    objects."""
    assert server.call("gc_freeze_count") > 10_000
