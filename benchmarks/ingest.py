"""How fast the API processes admit a burst of streaming completions into the engine core.

At rate ``inf`` the served run starts with 1000 simultaneous HTTP requests, and the
engine runs small batches until they have reached its waiting queue. This script measures that
ingestion alone, on the CPU: an engine core that never steps (``IngestOnlyCore``, stories260k),
``--api-server-count`` API processes as ``jaxpaged serve`` runs them
(``multi_api_server.run_api_server`` on one shared socket), and ``--num-prompts`` requests shaped
as ``jaxpaged bench serve`` sends them (``jaxpaged.benchmarks.serving_load.send_request``: streaming,
``include_usage``, ``ignore_eos``, temperature 0, ``max_tokens`` 128; a prompt of
``--prompt-len`` random token ids with the engine at ``--skip-tokenizer-init``, as on the H200,
or ``--text`` prompts of about as many tokens with the tokenizer loaded).

The load comes from ``--client-processes`` processes of raw asyncio sockets (one connection
per request, opened at send time as httpx does for a burst; the request bytes are built before
the start), each reading only the response headers, so the client costs little next to the
server; ``--client httpx`` sends instead as ``jaxpaged bench serve`` does (an
``httpx.AsyncClient`` streaming POST with ``json=body`` per request). The clock starts when the
clients are released; the core records when each request is added (``CLOCK_MONOTONIC`` is
shared by the processes). Printed per round (``--rounds``): the time until the core holds all
N requests, the admission rate, when the first add and the response headers came, the requests
each API process admitted and the CPU time it spent per request (``/proc``; on a machine with
fewer cores than busy processes the wall time includes waiting for a CPU, the CPU time does
not). Then every connection is closed: the API processes abort the requests, and the script
checks that the core is idle again (no unfinished request, block pool invariants) and that
``/metrics`` counts N aborts (it raises otherwise).

``--profile 1`` runs each API process's burst under cProfile (enabled by SIGUSR1 just before the
clients start, dumped on SIGUSR2 once the core holds all N) and prints the top functions.

    python -m benchmarks.ingest --num-prompts 1000 --rounds 5
    python -m benchmarks.ingest --num-prompts 1000 --api-server-count 2 --client-processes 2
    python -m benchmarks.ingest --num-prompts 1000 --text
    python -m benchmarks.ingest --num-prompts 250 --client httpx
    python -m benchmarks.ingest --num-prompts 1000 --profile 1 --rounds 1

On the 2-core CPU machine (client, API processes and core share the 2 cores), 128-id
prompts, raw client, medians of 3-5 rounds: one API process admitted 1000 requests in 1.35 s
(740 req/s, ~1000 CPU us/request) before the admission path was trimmed (one-pass token-id
checks, the prompt union's order, ``check_supported`` over the fields set) and in 0.92 s
(1090 req/s, ~600 CPU us/request) after; 250 in 0.30 s; text prompts of ~125 tokens 1.13 s
(660-940 CPU us/request, tokenization included); two API processes 0.79 s (~500-700 CPU
us/request each, the 2 cores saturated). With ``--client httpx`` the first request reaches the
core only after 0.5-0.6 s for 250 requests from one client process (2-3 s for 1000): the
client's own ramp-up, not the server's. During a 1000-request burst (0.6-0.8 CPU s), the API
process's garbage collections took 0.2-0.35 s (``gc.callbacks``, CPython's 700 threshold;
a 50000 threshold was not a clear win in paired runs on this noisy machine).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import multiprocessing
import os
import pstats
import signal
import socket
import tempfile
import time

import numpy as np

from jaxpaged.engine_core.core import EngineCore

CORE_CLASS = "benchmarks.ingest:IngestOnlyCore"
MODEL = "stories"


class IngestOnlyCore(EngineCore):
    """An engine core that admits requests and never steps; records when each was added."""

    UTILITY_METHODS = (*EngineCore.UTILITY_METHODS, "add_times")

    def __init__(self, engine, **kwargs):
        super().__init__(engine, **kwargs)
        self._added: list[tuple[float, int]] = []

    def has_work(self) -> bool:
        return False  # the loop then only admits, aborts and answers utilities

    def add_request(self, *args, **kwargs):
        error = super().add_request(*args, **kwargs)
        client_index = args[5] if len(args) > 5 else kwargs.get("client_index", 0)
        self._added.append((time.monotonic(), client_index if error is None else -1))
        return error

    def add_times(self) -> list[tuple[float, int]]:
        """``(monotonic time, client index)`` of every add since the last call (index -1: the
        add was refused); clears them."""
        added, self._added = self._added, []
        return added


def _api_process(profile_path: str | None, *args, **kwargs) -> None:
    """``run_api_server`` in a spawned process, profiled between SIGUSR1 and SIGUSR2."""
    from jaxpaged.entrypoints.openai.api_server import build_app
    from jaxpaged.entrypoints.openai.multi_api_server import run_api_server

    if profile_path is not None:
        profiler = cProfile.Profile()
        signal.signal(signal.SIGUSR1, lambda *_: profiler.enable())

        def dump(*_):
            profiler.disable()
            profiler.dump_stats(profile_path)

        signal.signal(signal.SIGUSR2, dump)
    run_api_server(*args, build_app=build_app, **kwargs)


def _request_bytes(port: int, body: dict) -> bytes:
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    return head.encode() + payload


def _client_process(port: int, bodies: list[dict], use_httpx: bool, start, release, results):
    """Send ``bodies`` at once when ``start`` is set; hold the connections until ``release``;
    put ``(status, header arrival time)`` per request on ``results``. Raw sockets (the request
    bytes built before the start), or ``use_httpx``: one ``httpx.AsyncClient`` streaming POST
    with ``json=body`` per request, as ``jaxpaged bench serve``'s ``StreamingClient`` sends."""
    import httpx

    requests = [_request_bytes(port, body) for body in bodies]

    async def raw(request: bytes, released: asyncio.Event):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        arrival = time.monotonic()
        await released.wait()
        writer.close()
        return int(head.split(b" ", 2)[1]), arrival

    async def with_httpx(http, body: dict, released: asyncio.Event):
        async with http.stream("POST", "/v1/completions", json=body) as response:
            arrival = time.monotonic()
            await released.wait()  # leaving unread closes the connection
        return response.status_code, arrival

    async def main():
        released = asyncio.Event()
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", timeout=httpx.Timeout(None), limits=limits
        ) as http:
            if use_httpx:
                tasks = [asyncio.create_task(with_httpx(http, b, released)) for b in bodies]
            else:
                tasks = [asyncio.create_task(raw(r, released)) for r in requests]
            await asyncio.get_running_loop().run_in_executor(None, release.wait)
            released.set()
            return await asyncio.gather(*tasks, return_exceptions=True)

    start.wait()
    outcomes = asyncio.run(main())
    results.put([o if isinstance(o, tuple) else (repr(o), None) for o in outcomes])


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _bodies(args, rng: np.random.Generator, tokenizer) -> list[dict]:
    common = {
        "model": MODEL,
        "max_tokens": args.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if args.text:  # a story's words, cut to about prompt_len tokens, numbered
        story = "Once upon a time, there was a little girl named Lily. She liked to play. " * 40
        ids = tokenizer.encode(story, add_special_tokens=False)[: args.prompt_len - 8]
        text = tokenizer.decode(ids)
        return [common | {"prompt": f"{i}. {text}"} for i in range(args.num_prompts)]
    return [
        common | {"prompt": rng.integers(0, args.vocab_size, size=args.prompt_len).tolist()}
        for _ in range(args.num_prompts)
    ]


async def _poll(client, count: int, timeout: float) -> list[tuple[float, int]]:
    """The core's add times until it holds ``count`` requests."""
    added: list[tuple[float, int]] = []
    deadline = time.monotonic() + timeout
    while len(added) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the core admitted {len(added)} of {count} requests (refused with a 4xx?)"
            )
        await asyncio.sleep(0.01)
        added += await client.call_utility("add_times")
    return added


def _aborts(port: int) -> float:
    """``request_success_total`` with ``finished_reason="abort"``, over every API process."""
    import httpx

    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("jaxpaged:request_success_total{") and 'reason="abort"' in line
    )


async def _run(args, core, sock, processes, metrics_dir) -> None:
    from jaxpaged.engine_core.core_client import EngineCoreClient
    from jaxpaged.engine_core.core_messages import Kind

    port = sock.getsockname()[1]
    count = args.api_server_count
    # The script is the core's last client: it reads the add times and checks idleness.
    client = EngineCoreClient.connect(
        input_address=core.input_address,
        output_address=core.output_addresses[count],
        info=core.info,
        client_index=count,
    )
    await client.start()
    tokenizer = None
    if args.text:
        from transformers import AutoTokenizer

        from jaxpaged.config import default_model_path

        tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    requests = _bodies(args, np.random.default_rng(0), tokenizer)
    n = args.num_prompts
    print(
        f"{n} requests, {count} API process(es), {args.client_processes} {args.client} client "
        "process(es), "
        f"{'text' if args.text else 'token-id'} prompts of ~{args.prompt_len} tokens"
    )
    walls = []
    for round_index in range(args.rounds):
        walls.append(
            await _burst(args, client, port, requests, processes, args.profile and not round_index)
        )
    walls.sort()
    print(
        f"median of {args.rounds} rounds: all {n} admitted in {walls[len(walls) // 2]:.3f} s, "
        f"{n / walls[len(walls) // 2]:.0f} requests/s"
    )
    client.core.send(Kind.SHUTDOWN, None)
    await client.shutdown()


async def _burst(args, client, port, requests, processes, profile: bool) -> float:
    """One burst of ``requests`` (module docstring); prints it and returns its wall time."""
    aborted_before = _aborts(port)
    spawn = multiprocessing.get_context("spawn")
    start, release, results = spawn.Event(), spawn.Event(), spawn.Queue()
    clients = [
        spawn.Process(
            target=_client_process,
            args=(
                port,
                requests[i :: args.client_processes],
                args.client == "httpx",
                start,
                release,
                results,
            ),  # fmt: skip
            daemon=True,  # gone with the script, also when it fails
        )
        for i in range(args.client_processes)
    ]
    for process in clients:
        process.start()
    await asyncio.sleep(2.0)  # the client processes are up and waiting
    if profile:
        for process in processes:
            os.kill(process.pid, signal.SIGUSR1)
    cpu_before = [_cpu_seconds(p.pid) for p in processes]
    t0 = time.monotonic()
    start.set()
    added = await _poll(client, len(requests), timeout=60)
    cpu = [_cpu_seconds(p.pid) - c for p, c in zip(processes, cpu_before, strict=True)]
    if profile:
        for process in processes:
            os.kill(process.pid, signal.SIGUSR2)
    release.set()
    outcomes = [o for _ in clients for o in await asyncio.to_thread(results.get)]
    for process in clients:
        process.join()
    refused = sum(1 for _, index in added if index < 0)
    statuses = sorted({str(status) for status, _ in outcomes})
    headers = sorted(t - t0 for _, t in outcomes if t is not None)
    times = sorted(t - t0 for t, _ in added)
    n = len(times)
    per_process = []
    for index, seconds in enumerate(cpu):
        admitted = sum(1 for _, i in added if i == index)
        per_process.append(f"{admitted} req {seconds / max(admitted, 1) * 1e6:.0f} CPU us/req")
    print(
        f"  all in {times[-1]:.3f} s = {n / times[-1]:.0f} req/s (first add "
        f"{times[0] * 1e3:.0f} ms, half {times[n // 2] * 1e3:.0f} ms; "
        f"{n / (times[-1] - times[0]):.0f}/s from the first); headers median "
        f"{headers[len(headers) // 2] * 1e3:.0f} ms, last {headers[-1] * 1e3:.0f} ms; "
        f"API processes: {', '.join(per_process)}; statuses {statuses}, refused {refused}"
    )
    # Every connection is closed: the API processes abort, the core ends idle.
    deadline = time.monotonic() + 60
    while (await client.get_stats())["num_unfinished_requests"]:
        if time.monotonic() > deadline:
            raise RuntimeError("requests leaked: the core still holds some after disconnect")
        await asyncio.sleep(0.05)
    stats = await client.call_utility("check_idle")
    await asyncio.sleep(0.5)  # the API processes' abort counters reach the metrics directory
    aborts = _aborts(port) - aborted_before
    if aborts != n:
        raise RuntimeError(f"the API processes counted {aborts:.0f} aborts of {n} requests")
    print(
        f"    after disconnect: core idle ({stats['num_free_blocks']} free blocks), "
        f"{aborts:.0f} aborts counted by the API processes"
    )
    return times[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--api-server-count", type=int, default=1)
    parser.add_argument("--client-processes", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=500)
    parser.add_argument(
        "--client", choices=["raw", "httpx"], default="raw",
        help="raw asyncio sockets, or httpx as jaxpaged bench serve sends",
    )  # fmt: skip
    parser.add_argument("--text", action="store_true", help="text prompts (tokenizer loaded)")
    parser.add_argument("--profile", type=int, default=0, help="1: cProfile the API processes")
    parser.add_argument("--rounds", type=int, default=3, help="bursts, one after the other")
    parser.add_argument("--top", type=int, default=30, help="functions printed per profile")
    args = parser.parse_args()

    from jaxpaged.config import EngineArgs
    from jaxpaged.engine_core.core_process import start_core_process
    from jaxpaged.entrypoints.env import prometheus_multiproc_dir
    from jaxpaged.entrypoints.openai.multi_api_server import bind_server_socket
    from jaxpaged.entrypoints.openai.serve_config import ServeConfig

    engine_args = EngineArgs(
        dtype="float32",
        max_model_len=args.prompt_len + args.max_tokens + 16,
        max_num_seqs=8,
        max_num_batched_tokens=args.prompt_len + args.max_tokens + 16,
        skip_tokenizer_init=not args.text,
    )
    model_config = engine_args.create_engine_config().model_config
    profile_dir = tempfile.mkdtemp(prefix="ingest-profile-")
    with prometheus_multiproc_dir() as metrics_dir:
        sock = bind_server_socket("127.0.0.1", 0)
        core = start_core_process(
            engine_args, num_clients=args.api_server_count + 1, core_class=CORE_CLASS
        )
        spawn = multiprocessing.get_context("spawn")
        processes = []
        for index in range(args.api_server_count):
            profile = os.path.join(profile_dir, f"api-{index}.prof") if args.profile else None
            processes.append(
                spawn.Process(
                    target=_api_process,
                    args=(profile, index, sock),
                    kwargs=dict(
                        model=model_config.model,
                        tokenizer_path=model_config.tokenizer if args.text else None,
                        input_address=core.input_address,
                        output_address=core.output_addresses[index],
                        info=core.info,
                        metrics_dir=metrics_dir,
                        config=ServeConfig(
                            served_model_names=[MODEL],
                            api_server_count=args.api_server_count,
                            uvicorn_log_level="warning",
                        ),
                        parent_pid=os.getpid(),
                    ),
                )
            )
            processes[-1].start()
        try:
            _wait_healthy(sock.getsockname()[1])
            _settle()
            asyncio.run(_run(args, core, sock, processes, metrics_dir))
        finally:
            for process in processes:
                process.terminate()
            for process in [*processes, core.process]:
                process.join(15)
                if process.is_alive():
                    process.kill()
            sock.close()
    if args.profile:
        for index in range(args.api_server_count):
            print(f"\n--- API process {index}: top {args.top} by own time ---")
            stats = pstats.Stats(os.path.join(profile_dir, f"api-{index}.prof"))
            stats.sort_stats("tottime").print_stats(args.top)
            print(f"--- API process {index}: top {args.top} by cumulative time ---")
            stats.sort_stats("cumulative").print_stats(args.top)


def _wait_healthy(port: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as probe:
                probe.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                if probe.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the API processes did not start")


def _settle() -> None:
    time.sleep(3.0)  # /health answered by one API process; give the others their start-up


if __name__ == "__main__":
    main()
