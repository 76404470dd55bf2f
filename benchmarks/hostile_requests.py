"""Plain requests' latency beside hostile chat templates, and the memory left after them.

``PYTHONPATH=. python benchmarks/hostile_requests.py --out hostile.json`` (any machine: the
hostile part is CPU work in the API process's template workers; ``--model`` and the engine
flags pick what serves the plain requests, the embedded stories260k by default).

Phases, on one ``jaxpaged serve``-equivalent server (engine core in its own process, uvicorn
in a thread of this one):

1. idle: ``--requests`` plain completions one after another (a ``--prompt-chars``-character
   prompt, truncated to fit the context, ``--max-tokens`` tokens);
2. hostile: ``--hostile`` clients each sending, back to back, chat requests whose own template
   runs nested ``range(100000)`` loops (each burns its 2 s budget in a template worker), and a
   memory bomb every ``--bomb-every`` requests; meanwhile the same plain completions again;
3. after: the hostile clients stop; the resident memory of the API process and of the template
   workers is read again.

Prints one table (p50 / p95 / max latency of the plain requests per phase, the ratio to idle,
the hostile requests' status counts, resident memory before and after) and writes it as JSON.
Before the template queue was separate (twelve such templates), a plain 5,000-character
completion took 13-15 s; the aim is within 2x of idle.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import statistics
import threading
import time

NESTED = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
BOMB = "{% set l = ('xy,' * 60000000).split(',') %}{{ l | length }}"


def _rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        return None


def _start(args):
    import uvicorn
    from transformers import AutoTokenizer

    from jaxpaged.config import EngineArgs, default_model_path
    from jaxpaged.engine_core.core_client import EngineCoreClient
    from jaxpaged.entrypoints.openai.api_server import build_app
    from jaxpaged.entrypoints.openai.serve_config import ServeConfig

    model = args.model or default_model_path()
    engine_args = EngineArgs(
        model=model, dtype=args.dtype, max_model_len=args.max_model_len,
        load_format=args.load_format,
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(model)
    client = EngineCoreClient.spawn(engine_args, tokenizer=tokenizer)
    config = ServeConfig(
        served_model_names=["m"],
        chat_template="{% for m in messages %}{{ m.content }}\n{% endfor %}",
        uvicorn_log_level="warning",
    )
    app = build_app(client, config, model=model, tokenizer=tokenizer)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, app, f"http://127.0.0.1:{port}"


async def _plain(http, args) -> float:
    body = {
        "model": "m", "prompt": "Once upon a time " * (args.prompt_chars // 17),
        "max_tokens": args.max_tokens, "truncate_prompt_tokens": args.max_model_len // 2,
        "temperature": 0,
    }  # fmt: skip
    start = time.perf_counter()
    response = await http.post("/v1/completions", json=body)
    response.raise_for_status()
    return time.perf_counter() - start


async def _hostile_client(http, args, stop: asyncio.Event, statuses: collections.Counter):
    sent = 0
    while not stop.is_set():
        sent += 1
        template = BOMB if args.bomb_every and sent % args.bomb_every == 0 else NESTED
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1, "chat_template": template}  # fmt: skip
        response = await http.post("/v1/chat/completions", json=body)
        statuses[response.status_code] += 1
        if response.status_code == 503:  # full queue: back off as Retry-After says
            await asyncio.sleep(float(response.headers.get("Retry-After", "1")))


def _summary(latencies: list[float]) -> dict:
    ordered = sorted(latencies)
    return {
        "p50_s": statistics.median(ordered),
        "p95_s": ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))],
        "max_s": ordered[-1],
    }


async def _run(args, app, url) -> dict:
    import httpx

    sandbox = app.state.chat.template_sandbox
    limits = httpx.Limits(max_connections=args.hostile + 8)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        for _ in range(3):  # warm-up: compile, tokenizer
            await _plain(http, args)
        sandbox.render("{{ 1 }}", {})
        memory_before = {"api": _rss_mb(os.getpid()),
                         "workers": [_rss_mb(p) for p in sandbox.worker_pids()]}  # fmt: skip
        idle = [await _plain(http, args) for _ in range(args.requests)]
        stop, statuses = asyncio.Event(), collections.Counter()
        clients = [
            asyncio.create_task(_hostile_client(http, args, stop, statuses))
            for _ in range(args.hostile)
        ]
        await asyncio.sleep(1.0)  # the workers and the queue are full
        busy = [await _plain(http, args) for _ in range(args.requests)]
        stop.set()
        await asyncio.gather(*clients)
        memory_after = {"api": _rss_mb(os.getpid()),
                        "workers": [_rss_mb(p) for p in sandbox.worker_pids()]}  # fmt: skip
    idle_s, busy_s = _summary(idle), _summary(busy)
    return {
        "idle": idle_s,
        "beside_hostile": busy_s,
        "p50_ratio": busy_s["p50_s"] / idle_s["p50_s"],
        "p95_ratio": busy_s["p95_s"] / idle_s["p95_s"],
        "hostile_statuses": dict(statuses),
        "rss_mb_before": memory_before,
        "rss_mb_after": memory_after,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: stories260k)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--requests", type=int, default=20, help="plain requests per phase")
    parser.add_argument("--prompt-chars", type=int, default=5000)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--hostile", type=int, default=12, help="hostile template clients")
    parser.add_argument("--bomb-every", type=int, default=6, help="0: no memory bombs")
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args()
    server, app, url = _start(args)
    try:
        result = asyncio.run(_run(args, app, url))
    finally:
        server.should_exit = True
    result["args"] = vars(args)
    for phase in ("idle", "beside_hostile"):
        row = result[phase]
        print(f"{phase:15s} p50 {row['p50_s'] * 1e3:8.1f} ms  p95 {row['p95_s'] * 1e3:8.1f} ms  "
              f"max {row['max_s'] * 1e3:8.1f} ms")  # fmt: skip
    print(f"ratio to idle   p50 {result['p50_ratio']:.2f}x  p95 {result['p95_ratio']:.2f}x "
          f"(aim: <= 2x)")  # fmt: skip
    print(f"hostile answers {result['hostile_statuses']}")
    print(f"resident MB     before {result['rss_mb_before']}  after {result['rss_mb_after']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
