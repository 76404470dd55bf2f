"""jaxpaged/benchmarks/serving.py (with serving_dataset.py and serving_load.py) against the live
test server: counts, datasets, result block."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest

from jaxpaged.benchmarks.serving_dataset import sample_random_requests
from jaxpaged.benchmarks.serving_load import (
    RawResult,
    RequestResult,
    arrival_offsets,
    decode_result,
)
from tests.live_server import API_KEY


@pytest.fixture(scope="module")
def bench():
    from jaxpaged.benchmarks import serving

    return serving


def test_random_requests_follow_lengths_and_ratio():
    rng = np.random.default_rng(0)
    exact = sample_random_requests(5, 10, 4, 0.0, 3, 50, rng)
    assert [r.prompt_len for r in exact] == [13] * 5
    assert all(len(r.prompt) == 13 and max(r.prompt) < 50 for r in exact)
    assert len({tuple(r.prompt[:3]) for r in exact}) == 1  # the shared prefix
    assert [r.expected_output_len for r in exact] == [4] * 5
    spread = sample_random_requests(200, 100, 10, 0.5, 0, 50, rng)
    lens = [r.prompt_len for r in spread]
    assert min(lens) >= 50 and max(lens) <= 150 and len(set(lens)) > 20


def test_random_benchmark_counts_every_token_and_prints_vllm_block(bench, server, capsys, tmp_path):
    args = bench.build_parser().parse_args(
        [
            "--base-url", server.url, "--api-key", API_KEY, "--dataset-name", "random",
            "--num-prompts", "8", "--random-input-len", "8", "--random-output-len", "4",
            "--ignore-eos", "--max-concurrency", "4", "--disable-tqdm",
            "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json",
        ]
    )  # fmt: skip
    metrics = asyncio.run(bench.benchmark(args))
    assert metrics["completed"] == 8 and metrics["failed"] == 0
    assert metrics["total_input_tokens"] == 64
    assert metrics["total_output_tokens"] == 32
    # 4 tokens: at most 4 chunks, 3 gaps (a stream merges the steps its reader fell behind on)
    assert all(len(itl) <= 3 for itl in metrics["itls"])
    assert 0 < metrics["median_ttft_ms"] <= metrics["median_e2el_ms"]
    out = capsys.readouterr().out
    for label in (
        "Successful requests:                     8",
        "Total input tokens:                      64",
        "Total generated tokens:                  32",
        "Request throughput (req/s):",
        "Output token throughput (tok/s):",
        "Total Token throughput (tok/s):",
        "Mean TTFT (ms):",
        "Median TPOT (ms):",
        "P99 ITL (ms):",
        "Mean E2EL (ms):",
    ):
        assert label in out
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["completed"] == 8 and saved["request_rate"] == float("inf")


def test_sharegpt_chat_benchmark_with_poisson_arrivals(bench, server, tmp_path):
    story = "Once upon a time there was a little girl named Lily who liked to play outside."
    data = [
        {
            "conversations": [
                {"from": "human", "value": f"{story} {i}"},
                {"from": "gpt", "value": story},
            ]
        }
        for i in range(6)
    ] + [{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": story}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    args = bench.build_parser().parse_args(
        [
            "--base-url", server.url, "--api-key", API_KEY, "--backend", "openai-chat",
            "--endpoint", "/v1/chat/completions", "--dataset-name", "sharegpt",
            "--dataset-path", str(path), "--num-prompts", "5", "--sharegpt-output-len", "3",
            "--request-rate", "50", "--burstiness", "0.5", "--ignore-eos", "--disable-tqdm",
        ]
    )  # fmt: skip
    metrics = asyncio.run(bench.benchmark(args))
    assert metrics["completed"] == 5
    assert metrics["total_output_tokens"] == 15
    assert min(metrics["input_lens"]) > 4  # "Hi" is filtered out (< 4 tokens)


# A recorded completions stream (the events `jaxpaged serve` sends), written in chunked frames
# that split an event, a frame header and a line ending across TCP writes, with pauses, and
# two events inside one frame.
_EVENTS = [
    {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": t}]}
    for t in ("Once", " upon", " a", " time", "")
] + [{"id": "c", "object": "text_completion", "choices": [], "usage": {"completion_tokens": 5}}]
_SSE = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in _EVENTS) + b"data: [DONE]\n\n"
_FRAMES = [_SSE[:40], _SSE[40:260], _SSE[260:]]


async def _recorded_server(close_after_response: bool):
    """A loopback HTTP/1.1 server: /ok streams _SSE chunked, /bad answers 400 with a body;
    ``close_after_response``: each response says ``connection: close`` and the server closes."""

    close = b"connection: close\r\n" if close_after_response else b""

    async def handle(reader, writer):
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            if head.startswith(b"POST /bad"):
                body = b'{"error": {"message": "max_tokens is too large"}}'
                writer.write(
                    b"HTTP/1.1 400 Bad Request\r\n%scontent-length: %d\r\n\r\n" % (close, len(body))
                )
                writer.write(body)
            else:
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n%s"
                    b"transfer-encoding: chunked\r\n\r\n" % close
                )
                wire = b"".join(b"%x\r\n%s\r\n" % (len(f), f) for f in _FRAMES) + b"0\r\n\r\n"
                for cut in (3, 50, 51, 140, 300, len(wire)):  # cut inside headers and lines
                    writer.write(wire[:cut])
                    wire = wire[cut:]
                    await writer.drain()
                    await asyncio.sleep(0.01)
            await writer.drain()
            if close_after_response:
                break
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def _old_path(url: str, chat: bool = False) -> RequestResult:
    """The reference: the benchmark's former path, httpx's aiter_lines and a JSON decode per
    event, timing each event as it is decoded."""
    import httpx

    async def run():
        result = RequestResult()
        start = last = time.perf_counter()
        async with httpx.AsyncClient() as http, http.stream("POST", url, json={}) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("choices"):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.generated_text += chunk["choices"][0]["text"]
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
        result.latency = time.perf_counter() - start
        return result

    return asyncio.run(run())


@pytest.mark.parametrize("close_after_response", [False, True])
def test_raw_stream_path_matches_the_line_by_line_path(close_after_response):
    from jaxpaged.benchmarks.sse_client import StreamingClient

    async def run():
        server = await _recorded_server(close_after_response)
        port = server.sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        client = StreamingClient(url, {"Authorization": "Bearer k"})
        raws = []
        for path in ("/ok", "/ok", "/bad", "/ok"):  # reuses (or reopens) the connection
            raw = RawResult(prompt_len=3, start=time.perf_counter())
            raw.response = await client.post_stream(path, {"prompt": [1, 2, 3]})
            raws.append(raw)
        old = await asyncio.to_thread(_old_path, url + "/ok")
        await client.aclose()
        server.close()
        await server.wait_closed()
        return raws, old

    raws, old = asyncio.run(run())
    bad = decode_result(raws[2], chat=False)
    assert not bad.success and bad.error.startswith("HTTP 400: ") and "too large" in bad.error
    for raw in raws[:2] + raws[3:]:
        new = decode_result(raw, chat=False)
        assert new.success and new.prompt_len == 3
        assert new.generated_text == old.generated_text == "Once upon a time"
        assert new.output_tokens == old.output_tokens == 5
        assert len(new.itl) == len(old.itl) == 4  # five content events, the usage one excluded
        assert 0 < new.ttft < new.ttft + sum(new.itl) <= new.latency
        assert sum(new.itl) >= 0.009  # a 10 ms pause between writes shows in a gap


def test_client_processes_split_the_requests_and_merge_in_order(bench, server):
    args = bench.build_parser().parse_args(
        [
            "--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "6",
            "--random-input-len", "6", "--random-output-len", "3", "--random-range-ratio", "0.5",
            "--ignore-eos", "--request-rate", "100", "--num-client-processes", "2",
            "--max-concurrency", "3", "--disable-tqdm",
        ]
    )  # fmt: skip
    metrics = asyncio.run(bench.benchmark(args))
    expected = sample_random_requests(6, 6, 3, 0.5, 0, 500, np.random.default_rng(0))
    assert metrics["completed"] == 6 and metrics["failed"] == 0
    assert metrics["input_lens"] == [r.prompt_len for r in expected]  # request order kept
    assert metrics["output_lens"] == [r.expected_output_len for r in expected]
    assert all(
        len(itl) <= n - 1 for itl, n in zip(metrics["itls"], metrics["output_lens"], strict=True)
    )
    assert metrics["duration"] >= arrival_offsets(6, 100, 1.0, 0)[-1]
    args.max_concurrency = 1
    with pytest.raises(ValueError, match="--num-client-processes"):
        asyncio.run(bench.benchmark(args))
