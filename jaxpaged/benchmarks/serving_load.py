"""The load of ``jaxpaged bench serve``: when each request is sent, sending and reading the streams
(in one process or several), and each request's measures from its stream.

Requests leave at their ``arrival_offsets`` (Poisson, or gamma gaps of shape ``burstiness``)
with at most ``max_concurrency`` in flight. The streams are read by ``sse_client.StreamingClient``
(httpx), which keeps each ``data:`` line's raw bytes and the arrival time of the read that
brought it; the JSON is decoded after the run (``decode_result``): TTFT is the time to the first
streamed chunk, ITL every gap between chunks, E2EL the whole request, output tokens from the
server's usage. Events that arrive in one read share one arrival time (an ITL of 0).
``run_load_processes`` splits the requests over processes for loads one process cannot read.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import multiprocessing
import time
from collections.abc import Sequence

import httpx
import numpy as np

from jaxpaged.benchmarks.serving_dataset import SampleRequest
from jaxpaged.benchmarks.sse_client import StreamedResponse, StreamingClient


@dataclasses.dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    generated_text: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    error: str = ""


def arrival_offsets(num: int, request_rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Send times of ``num`` requests in seconds after the start, float64 ``[num]``: gaps drawn
    from a gamma with shape k = ``burstiness`` and scale 1/(rate k), so the mean gap is 1/rate
    (k = 1 is Poisson, k < 1 burstier; vLLM's --burstiness); rate inf: all at 0."""
    if request_rate == float("inf"):
        return np.zeros(num)
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if num else np.zeros(0)


@dataclasses.dataclass
class LoadSpec:
    """What every request of a run shares (picklable, for the client processes)."""

    base_url: str
    headers: dict[str, str]
    endpoint: str
    chat: bool
    model: str
    args: argparse.Namespace


async def run_load(
    spec: LoadSpec,
    requests: Sequence[SampleRequest],
    offsets: Sequence[float],
    max_concurrency: int | None,
    start: float,
    bar=None,
) -> tuple[list[RequestResult], float]:
    """Send ``requests[i]`` at ``perf_counter()`` time ``start + offsets[i]`` with at most
    ``max_concurrency`` in flight; returns the decoded results (decoded once the last stream
    ended) and the ``perf_counter()`` time the last one ended."""
    client = StreamingClient(spec.base_url, spec.headers)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def limited(request: SampleRequest) -> RawResult:
        async with semaphore or contextlib.nullcontext():
            raw = await send_request(
                client, spec.endpoint, spec.chat, spec.model, request, spec.args
            )
        if bar is not None:
            bar.update(1)
        return raw

    tasks = []
    for request, offset in zip(requests, offsets, strict=True):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(limited(request)))
    raws = await asyncio.gather(*tasks)
    end = time.perf_counter()
    await client.aclose()
    return [decode_result(raw, spec.chat) for raw in raws], end


def _client_process(connection, spec: LoadSpec, requests, offsets, max_concurrency) -> None:
    """One of ``--num-client-processes``: says ready, waits for the start time, runs its share
    and sends back ``(results, end)``."""
    connection.send("ready")
    start = connection.recv()
    connection.send(run_loop(run_load(spec, requests, offsets, max_concurrency, start)))
    connection.close()


def run_load_processes(
    spec: LoadSpec,
    requests: Sequence[SampleRequest],
    offsets: Sequence[float],
    max_concurrency: int | None,
    num_processes: int,
) -> tuple[list[RequestResult], float, float]:
    """``run_load`` split over ``num_processes`` spawned processes: request i goes to process
    i mod N with its own send time, so the whole schedule is the one a single process would
    keep; ``max_concurrency`` is divided among them (the first ``max_concurrency mod N`` get
    one more). All start at one ``perf_counter()`` time (a system-wide monotonic clock on
    Linux) once every process is ready. Returns the results in request order, start and end."""
    context = multiprocessing.get_context("spawn")
    workers = []
    for i in range(num_processes):
        limit = None
        if max_concurrency:
            limit = max_concurrency // num_processes + (i < max_concurrency % num_processes)
        parent, child = context.Pipe()
        share = (list(requests[i::num_processes]), list(offsets[i::num_processes]), limit)
        process = context.Process(target=_client_process, args=(child, spec, *share))
        process.start()
        child.close()
        workers.append((parent, process))
    for i, (parent, _) in enumerate(workers):
        try:
            parent.recv()
        except EOFError:
            raise RuntimeError(f"client process {i} failed to start") from None
    start = time.perf_counter() + 0.05
    for parent, _ in workers:
        parent.send(start)
    results: list[RequestResult | None] = [None] * len(requests)
    end = start
    for i, (parent, process) in enumerate(workers):
        try:
            share, share_end = parent.recv()
        except EOFError:
            raise RuntimeError(f"client process {i} exited without its results") from None
        results[i::num_processes] = share
        end = max(end, share_end)
        process.join()
    return results, start, end


def run_loop(coroutine):
    """``uvloop.run`` when uvloop is installed (it is a dependency; fewer µs per event), else
    ``asyncio.run``."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


@dataclasses.dataclass
class RawResult:
    """A request as received, before decoding: its start (``perf_counter`` seconds) and the
    response, or the error that stopped it."""

    prompt_len: int
    start: float
    response: StreamedResponse | None = None
    error: str = ""


async def send_request(
    client: StreamingClient,
    endpoint: str,
    chat: bool,
    model: str,
    request: SampleRequest,
    args: argparse.Namespace,
) -> RawResult:
    """Stream one request; its events stay undecoded (``decode_result`` reads them after the
    run, so the JSON decoding costs the client no time while the load runs)."""
    body = {
        "model": model,
        "max_tokens": request.expected_output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": args.ignore_eos,
    }
    if args.top_p is not None:
        body["top_p"] = args.top_p
    if args.top_k is not None:
        body["top_k"] = args.top_k
    if chat:
        body["messages"] = [{"role": "user", "content": request.prompt}]
        body["max_completion_tokens"] = body.pop("max_tokens")
    else:
        body["prompt"] = request.prompt
    raw = RawResult(request.prompt_len, time.perf_counter())
    try:
        raw.response = await client.post_stream(endpoint, body)
    except (httpx.HTTPError, OSError, ValueError) as error:
        raw.error = f"{type(error).__name__}: {error}"
    return raw


def decode_result(raw: RawResult, chat: bool) -> RequestResult:
    """vLLM's per-request measures from a streamed response: TTFT is the arrival of the first
    event with ``choices``, ITL each later such event's gap to the one before, E2EL the time to
    ``[DONE]``; output tokens from the final usage event (else one per event)."""
    result = RequestResult(prompt_len=raw.prompt_len)
    response = raw.response
    if response is None:
        result.error = raw.error
        return result
    if response.status != 200:
        result.error = f"HTTP {response.status}: {response.body.decode(errors='replace')}"
        return result
    last = raw.start
    num_chunks = 0
    texts = []
    try:
        for arrival, payload in response.events:
            chunk = json.loads(payload)
            if "error" in chunk:
                result.error = chunk["error"].get("message", str(chunk["error"]))
                return result
            if chunk.get("choices"):
                choice = chunk["choices"][0]
                text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                if num_chunks == 0:
                    result.ttft = arrival - raw.start
                else:
                    result.itl.append(arrival - last)
                last = arrival
                num_chunks += 1
                texts.append(text or "")
            if chunk.get("usage"):
                result.output_tokens = chunk["usage"]["completion_tokens"]
    except json.JSONDecodeError as error:
        result.error = f"JSONDecodeError: {error}"
        return result
    result.generated_text = "".join(texts)
    result.latency = response.end - raw.start
    if not result.output_tokens:
        result.output_tokens = num_chunks  # no usage: about one token per chunk
    result.success = True
    return result
