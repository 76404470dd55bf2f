"""The real Nginx (Debian's package) with deploy/nginx.conf in front of three ``jaxpaged serve``
replicas of the embedded model on loopback.

Three replicas start as processes through ``scripts/launch_replicas.py``'s ``ReplicaSet``; Nginx
runs the rendered config from a temporary directory. 200 concurrent streaming completions all
finish, and each replica's own ``/metrics`` (``--metrics-prefix vllm``) shows it served some.
Then one replica is SIGKILLed under load: every request Nginx had not sent to it succeeds (Nginx's
access log names each request's upstreams, by X-Request-Id), and once the replica is started
again it serves again.

Start-up on 2 CPU cores dominates: replicas share a JAX persistent compilation cache, and replica
0 compiles the step shapes while the others are still importing.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from scripts.launch_replicas import ReplicaSet, plan_replicas, render_nginx_config

NGINX = shutil.which("nginx") or next(
    (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
)
pytestmark = pytest.mark.skipif(
    NGINX is None, reason="the nginx binary is absent (Debian: apt-get install nginx-light)"
)

SERVE_ARGS = [
    "--max-model-len", "64",
    "--max-num-seqs", "2",
    "--max-num-batched-tokens", "16",
    "--metrics-prefix", "vllm",
    "--uvicorn-log-level", "warning",
]  # fmt: skip
MAX_TOKENS = 4
PROMPTS = ("Once upon a time", "The cat", "Lily and Ben went to the park", "One day")


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


async def _stream(
    client: httpx.AsyncClient, url: str, request_id: str, index: int, echo: bool
) -> bool:
    """One streaming completion; True when it ends with ``data: [DONE]`` after its usage chunk
    counts MAX_TOKENS completion tokens (and, with ``echo``, Nginx sent our X-Request-Id back).
    Tokens are counted from usage, not chunks: a stream merges steps its reader fell behind on."""
    body = {
        "model": "stories260k",
        "prompt": PROMPTS[index % len(PROMPTS)],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        async with client.stream(
            "POST", f"{url}/v1/completions", json=body, headers={"X-Request-Id": request_id}
        ) as response:
            if response.status_code != 200:
                return False
            if echo and response.headers.get("x-request-id") != request_id:
                return False
            tokens, done = 0, False
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    usage = json.loads(line.removeprefix("data: ")).get("usage")
                    if usage:
                        tokens = usage["completion_tokens"]
            return done and tokens == MAX_TOKENS
    except httpx.HTTPError:
        return False


async def _burst(url: str, prefix: str, n: int, *, concurrency=None, during=None, via_nginx=True):
    """``n`` streams ``<prefix>-<i>``, at most ``concurrency`` at once (default all), started in
    index order; ``during(tasks, started)`` runs alongside (``started``: ids sent so far).
    Returns request id -> success."""
    concurrency = concurrency or n
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    gate = asyncio.Semaphore(concurrency)
    started: list[str] = []

    async def one(client, i):
        async with gate:
            started.append(f"{prefix}-{i}")
            return await _stream(client, url, f"{prefix}-{i}", i, via_nginx)

    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        tasks = {f"{prefix}-{i}": asyncio.create_task(one(client, i)) for i in range(n)}
        if during is not None:
            await during(tasks, started)
        return {rid: await task for rid, task in tasks.items()}


def _served(url: str) -> float:
    """Requests a replica finished (``vllm:request_success_total``, all reasons)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:request_success":
            return sum(s.value for s in family.samples if s.name.endswith("_total"))
    raise AssertionError("vllm:request_success is missing from /metrics")


def _upstreams(access_log, request_ids, timeout: float = 10.0) -> dict[str, list[str]]:
    """X-Request-Id -> the upstream addresses Nginx tried, in order, for every id in
    ``request_ids``. Nginx writes a request's line in its log phase, which can come after the
    client has read the last byte, so the log is read again until every id is there (or
    ``timeout`` seconds pass; the missing ids are then named)."""
    deadline = time.monotonic() + timeout
    while True:
        tried = {}
        for line in access_log.read_text().splitlines():
            match = re.search(r"rid=(\S+) upstream=(.+?) upstream_status=", line)
            if match:
                tried[match.group(1)] = [a.strip() for a in match.group(2).split(",")]
        missing = sorted(set(request_ids) - set(tried))
        if not missing:
            return tried
        if time.monotonic() > deadline:
            raise AssertionError(f"Nginx's access log has no line for {missing[:5]}")
        time.sleep(0.1)


@pytest.fixture
def cluster(tmp_path):
    ports = _free_ports(4)
    specs = plan_replicas(3, ports=ports[1:])
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla-cache"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    replicas = ReplicaSet(specs, SERVE_ARGS, env=env, log_dir=tmp_path / "logs")
    run_dir = tmp_path / "nginx"
    run_dir.mkdir()
    config = run_dir / "nginx.conf"
    listen = f"127.0.0.1:{ports[0]}"
    config.write_text(
        render_nginx_config(specs, listen=listen, run_dir=run_dir, worker_processes="1")
    )
    nginx = None
    try:
        replicas.start(0)
        replicas.wait_healthy([0], timeout=120)
        replicas.start(1)
        replicas.start(2)
        # Replica 0 compiles the two step shapes (prefill and decode; max_num_seqs 2 keeps it to
        # two) into the shared cache while 1 and 2 import.
        warm = asyncio.run(_burst(specs[0].url, "warm", 4, via_nginx=False))
        assert all(warm.values())
        nginx = subprocess.Popen(
            [
                NGINX,
                "-p",
                str(run_dir),
                "-c",
                str(config),
                "-e",
                str(run_dir / "error.log"),
                "-g",
                "daemon off;",
            ]  # fmt: skip
        )
        replicas.wait_healthy(timeout=120)
        url = f"http://{listen}"
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/nginx-health").status_code != 200:
            if time.monotonic() > deadline:
                raise TimeoutError("nginx did not answer")
            time.sleep(0.1)
        yield url, specs, replicas, run_dir / "access.log"
    finally:
        if nginx is not None:
            nginx.terminate()
            nginx.wait(10)
        replicas.stop(grace=5)


def test_nginx_spreads_streams_over_replicas_and_routes_around_a_dead_one(cluster):
    url, specs, replicas, access_log = cluster

    # 1. 200 concurrent streams through Nginx: all complete, every replica took some.
    before = [_served(spec.url) for spec in specs]
    results = asyncio.run(_burst(url, "load", 200))
    assert sum(results.values()) == 200, [rid for rid, ok in results.items() if not ok][:5]
    served = [_served(spec.url) - b for spec, b in zip(specs, before, strict=True)]
    assert all(n > 0 for n in served), served
    assert sum(served) == 200

    # 2. Kill replica 1 under load (30 streams open at a time) and start it again at once.
    victim = specs[1]
    victim_address = f"{victim.host}:{victim.port}"
    sent_before_kill: list[str] = []

    async def kill_midway(tasks, started):
        deadline = time.monotonic() + 60
        while sum(t.done() for t in tasks.values()) < 30 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        sent_before_kill.extend(started)
        replicas.kill(1)
        replicas.start(1)

    results = asyncio.run(_burst(url, "kill", 150, concurrency=30, during=kill_midway))
    tried = _upstreams(access_log, results)
    failed = sorted(rid for rid, ok in results.items() if not ok)
    # A request fails only if Nginx had handed it to the killed replica before it died ...
    assert set(failed) <= set(sent_before_kill), failed
    assert all(tried[rid][-1] == victim_address for rid in failed), {r: tried[r] for r in failed}
    assert all(ok for rid, ok in results.items() if tried[rid][-1] != victim_address)
    # ... and every request sent after the kill was routed around it and succeeded.
    after_kill = [rid for rid in results if rid not in set(sent_before_kill)]
    assert len(after_kill) >= 60 and all(results[rid] for rid in after_kill)

    # 3. Back up, it serves again (Nginx retries it after fail_timeout).
    replicas.wait_healthy([1], timeout=120)
    for _ in range(6):
        results = asyncio.run(_burst(url, f"back{_}", 12))
        assert all(results.values())
        if _served(victim.url) > 0:
            break
    assert _served(victim.url) > 0
