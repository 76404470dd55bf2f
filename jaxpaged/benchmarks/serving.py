"""Online serving benchmark against an OpenAI-compatible server (vLLM's ``benchmark_serving.py``).

Sends ``--num-prompts`` streaming requests at ``--request-rate`` (Poisson arrivals, or all at
once for ``inf``; ``--burstiness`` is the gamma shape of the gaps) with at most
``--max-concurrency`` in flight, then prints vLLM's result block. Per request: TTFT is the time
to the first streamed chunk, ITL every gap between chunks, TPOT ``(latency - TTFT) /
(output_tokens - 1)``, E2EL the whole request; output tokens come from the server's usage.

The streams are read by ``sse_client.StreamingClient`` (httpx), which keeps each ``data:``
line's raw bytes and the arrival time of the read that brought it; the JSON is decoded after the
run (``decode_result``). Events that arrive in one read share one arrival time (an ITL of 0).
The event loop is uvloop's when installed. ``--num-client-processes N`` splits the requests over
N processes for loads one process cannot read (docs/benchmarks.md, "Serving through the engine-core
process"). Sending and reading: ``serving_load.py``; this module parses the flags, runs the load
and writes vLLM's result.

Datasets: ``random`` sends token-id prompts (no tokenizer needed), lengths drawn around
``--random-input-len`` / ``--random-output-len`` by ``--random-range-ratio``;
``sharegpt`` reads a ShareGPT-format JSON (``[{"conversations": [{"from": "human", "value":
...}, {"from": "gpt", "value": ...}]}]``) and counts tokens with the server's ``/tokenize``
(``serving_dataset.py``).

    jaxpaged serve --max-model-len 512 &
    jaxpaged bench serve --dataset-name random --random-input-len 64 \\
        --random-output-len 32 --num-prompts 200 --request-rate 20 --ignore-eos
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import time
from collections.abc import Sequence
from datetime import datetime

import httpx
import numpy as np

from jaxpaged.benchmarks.serving_dataset import (
    SampleRequest,
    sample_random_requests,
    sample_sharegpt_requests,
)
from jaxpaged.benchmarks.serving_load import (
    LoadSpec,
    RequestResult,
    arrival_offsets,
    run_load,
    run_load_processes,
    run_loop,
)

try:
    from tqdm.asyncio import tqdm
except ImportError:  # tqdm is a dependency of jaxpaged, but keep the script standalone
    tqdm = None


# ---------------------------------------------------------------------------------- results
def calculate_metrics(
    results: Sequence[RequestResult],
    duration: float,
    percentiles: Sequence[float],
) -> dict:
    """vLLM's result dictionary (times in ms)."""
    done = [r for r in results if r.success]
    ttfts = [r.ttft for r in done]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    itls = [gap for r in done for gap in r.itl]
    e2els = [r.latency for r in done]
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.output_tokens for r in done)
    metrics = {
        "duration": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        ms = np.asarray(values or [0.0]) * 1000.0
        metrics[f"mean_{name}_ms"] = float(np.mean(ms))
        metrics[f"median_{name}_ms"] = float(np.median(ms))
        metrics[f"std_{name}_ms"] = float(np.std(ms))
        for p in percentiles:
            metrics[f"p{_pct(p)}_{name}_ms"] = float(np.percentile(ms, p))
    metrics["input_lens"] = [r.prompt_len for r in results]
    metrics["output_lens"] = [r.output_tokens for r in results]
    metrics["ttfts"] = [r.ttft for r in results]
    metrics["itls"] = [r.itl for r in results]
    metrics["generated_texts"] = [r.generated_text for r in results]
    metrics["errors"] = [r.error for r in results]
    return metrics


def _pct(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


_SECTIONS = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


def format_result(
    metrics: dict, percentile_metrics: Sequence[str], percentiles: Sequence[float]
) -> str:
    """vLLM's printed block: a label column of 40 characters, then the value."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]
    lines.append("{:<40} {:<10}".format("Successful requests:", metrics["completed"]))
    lines.append("{:<40} {:<10}".format("Failed requests:", metrics["failed"]))
    lines.append("{:<40} {:<10.2f}".format("Benchmark duration (s):", metrics["duration"]))
    lines.append("{:<40} {:<10}".format("Total input tokens:", metrics["total_input_tokens"]))
    lines.append("{:<40} {:<10}".format("Total generated tokens:", metrics["total_output_tokens"]))
    lines.append(
        "{:<40} {:<10.2f}".format("Request throughput (req/s):", metrics["request_throughput"])
    )
    lines.append(
        "{:<40} {:<10.2f}".format("Output token throughput (tok/s):", metrics["output_throughput"])
    )
    lines.append(
        "{:<40} {:<10.2f}".format(
            "Total Token throughput (tok/s):", metrics["total_token_throughput"]
        )
    )
    for name in percentile_metrics:
        title, short = _SECTIONS[name]
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        lines.append("{:<40} {:<10.2f}".format(f"Mean {short} (ms):", metrics[f"mean_{name}_ms"]))
        lines.append(
            "{:<40} {:<10.2f}".format(f"Median {short} (ms):", metrics[f"median_{name}_ms"])
        )
        for p in percentiles:
            key = f"p{_pct(p)}_{name}_ms"
            lines.append("{:<40} {:<10.2f}".format(f"P{_pct(p)} {short} (ms):", metrics[key]))
    lines.append("=" * 50)
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- main
async def benchmark(args: argparse.Namespace) -> dict:
    """Run the whole benchmark; returns vLLM's result dictionary (plus run settings)."""
    percentile_metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    unknown = set(percentile_metrics) - set(_SECTIONS)
    if unknown:
        raise ValueError(f"--percentile-metrics: unknown {sorted(unknown)}; use {list(_SECTIONS)}")
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    if args.num_client_processes < 1:
        raise ValueError(f"--num-client-processes must be >= 1, got {args.num_client_processes}")
    if args.max_concurrency and args.num_client_processes > args.max_concurrency:
        raise ValueError(
            f"--num-client-processes ({args.num_client_processes}) must be <= "
            f"--max-concurrency ({args.max_concurrency}): each process gets a share of it"
        )
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    chat = args.backend == "openai-chat" or args.endpoint.endswith("/chat/completions")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=httpx.Timeout(None), limits=limits
    ) as http:  # the set-up requests; the benchmark's streams go through StreamingClient
        model = args.served_model_name or args.model
        if model is None:
            models = (await http.get("/v1/models")).raise_for_status().json()
            model = models["data"][0]["id"]
        requests = await _load_requests(args, http, model)
        if chat:
            requests = [await _as_text(http, model, r) for r in requests]

    spec = LoadSpec(base_url, headers, args.endpoint, chat, model, args)
    print("Starting initial single prompt test run...")
    warmup, _ = await run_load(spec, requests[:1], [0.0], None, time.perf_counter())
    if not warmup[0].success:
        raise RuntimeError(f"the warm-up request failed: {warmup[0].error}")
    print("Initial test run completed. Starting main benchmark run...")
    print(f"Traffic request rate: {args.request_rate}, burstiness: {args.burstiness}")
    print(f"Maximum request concurrency: {args.max_concurrency}")
    offsets = arrival_offsets(len(requests), args.request_rate, args.burstiness, args.seed)
    if args.num_client_processes > 1:
        results, start, end = await asyncio.to_thread(
            run_load_processes, spec, requests, offsets, args.max_concurrency,
            args.num_client_processes,
        )  # fmt: skip
    else:
        bar = None if args.disable_tqdm or tqdm is None else tqdm(total=len(requests))
        start = time.perf_counter()
        results, end = await run_load(spec, requests, offsets, args.max_concurrency, start, bar)
        if bar is not None:
            bar.close()
    duration = end - start

    metrics = calculate_metrics(results, duration, percentiles)
    print(format_result(metrics, percentile_metrics, percentiles))
    metrics.update(
        date=datetime.now().strftime("%Y%m%d-%H%M%S"),
        backend=args.backend,
        model_id=model,
        num_prompts=len(requests),
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
    )
    if args.save_result:
        name = args.result_filename or (
            f"{args.backend}-{args.request_rate}qps-{model.replace('/', '_')}-{metrics['date']}.json"
        )
        path = f"{args.result_dir.rstrip('/')}/{name}" if args.result_dir else name
        with open(path, "w", encoding="utf-8") as f:
            json.dump(metrics, f)
    return metrics


async def _load_requests(args, http: httpx.AsyncClient, model: str) -> list[SampleRequest]:
    if args.dataset_name == "random":
        return sample_random_requests(
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.random_prefix_len,
            args.random_vocab_size,
            np.random.default_rng(args.seed),
        )
    if args.dataset_path is None:
        raise ValueError("--dataset-name sharegpt needs --dataset-path")
    return await sample_sharegpt_requests(
        args.dataset_path,
        args.num_prompts,
        args.sharegpt_output_len,
        http,
        model,
        random.Random(args.seed),
    )


async def _as_text(http: httpx.AsyncClient, model: str, request: SampleRequest) -> SampleRequest:
    """Chat needs text: token-id prompts are decoded by the server's ``/detokenize``."""
    if isinstance(request.prompt, str):
        return request
    response = await http.post("/detokenize", json={"model": model, "tokens": request.prompt})
    text = response.raise_for_status().json()["prompt"]
    return dataclasses.replace(request, prompt=text)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument(
        "--backend", default="openai", choices=["vllm", "openai", "openai-chat"],
        help="request format: completions (vllm, openai) or chat (openai-chat)",
    )  # fmt: skip
    parser.add_argument("--base-url", default=None, help="server URL; overrides --host/--port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", default="/v1/completions")
    parser.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    parser.add_argument("--model", default=None, help="model name (default: the server's first)")
    parser.add_argument("--served-model-name", default=None, help="`model` sent in requests")
    parser.add_argument("--dataset-name", default="random", choices=["random", "sharegpt"])
    parser.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--sharegpt-output-len", type=int, default=None)
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument("--random-prefix-len", type=int, default=0)
    parser.add_argument(
        "--random-vocab-size", type=int, default=500,
        help="random prompt ids are drawn from [0, N); keep N <= the model's vocabulary",
    )  # fmt: skip
    parser.add_argument(
        "--request-rate", type=float, default=float("inf"),
        help="requests per second (Poisson arrivals); inf sends all at once",
    )  # fmt: skip
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    parser.add_argument("--metric-percentiles", default="99")
    parser.add_argument("--save-result", action="store_true")
    parser.add_argument("--result-dir", default=None)
    parser.add_argument("--result-filename", default=None)
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument(
        "--num-client-processes", type=int, default=1,
        help="split the requests over N client processes (same send schedule, metrics over all "
        "requests; --max-concurrency is divided among them); for loads one process cannot read",
    )  # fmt: skip
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    if args.request_rate <= 0 or args.burstiness <= 0:
        print("--request-rate and --burstiness must be positive", file=sys.stderr)
        return 2
    run_loop(benchmark(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
