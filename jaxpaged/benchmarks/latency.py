"""Latency of one batch, end to end: jaxpaged's counterpart of vLLM's
``benchmarks/benchmark_latency.py``.

Each iteration generates ``--output-len`` tokens for ``--batch-size`` prompts of
``--input-len`` random token ids; prints vLLM's ``Avg latency: X seconds`` and percentiles, and
the time per output token (TPOT: from a request's first token to its last, over the tokens in
between). Example (batch-1 decode on the H200)::

    jaxpaged bench latency --model benchmarks/configs/llama-3-8b \\
        --load-format dummy --skip-tokenizer-init --dtype bfloat16 --max-model-len 2048 \\
        --input-len 128 --output-len 128 --batch-size 1
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from jaxpaged.benchmarks.dataset import random_requests
from jaxpaged.benchmarks.throughput import parse_and_build
from jaxpaged.entrypoints.cli_args import add_engine_args

PERCENTILES = (10, 25, 50, 75, 90, 99)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per iteration")
    parser.add_argument("--n", type=int, default=1, help="outputs per prompt; only 1 here")
    parser.add_argument("--num-iters-warmup", type=int, default=10, help="untimed iterations")
    parser.add_argument("--num-iters", type=int, default=30, help="timed iterations")
    parser.add_argument("--output-json", type=str, default=None, help="write results as JSON")
    add_engine_args(parser)
    return parser


def run_latency(
    llm,
    *,
    batch_size: int,
    input_len: int,
    output_len: int,
    num_iters_warmup: int,
    num_iters: int,
    seed: int = 0,
) -> dict:
    """Latencies (seconds) of ``num_iters`` batches and their time per output token.

    Raises:
        ValueError: a batch size, length or iteration count below 1.
    """
    from jaxpaged.sampling_params import SamplingParams

    if num_iters < 1:
        raise ValueError(f"num_iters must be at least 1, got {num_iters}")
    vocab_size = llm.llm_engine.vocab_size
    requests = random_requests(batch_size, input_len, output_len, vocab_size, seed=seed)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = SamplingParams(n=1, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=output_len)

    def one_iteration() -> tuple[float, list[float]]:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        latency = time.perf_counter() - start
        tpots = []
        for output in outputs:
            metrics = output.metrics
            num_tokens = len(output.outputs[0].token_ids)
            if num_tokens > 1:
                decode = metrics["finished_time"] - metrics["first_token_time"]
                tpots.append(decode / (num_tokens - 1))
        return latency, tpots

    for _ in range(num_iters_warmup):
        one_iteration()
    latencies, tpots = [], []
    for _ in range(num_iters):
        latency, iteration_tpots = one_iteration()
        latencies.append(latency)
        tpots.extend(iteration_tpots)
    latencies_arr = np.asarray(latencies)
    return {
        "avg_latency": float(latencies_arr.mean()),
        "latencies": latencies,
        "percentiles": {str(p): float(np.percentile(latencies_arr, p)) for p in PERCENTILES},
        "avg_tpot_seconds": float(np.mean(tpots)) if tpots else float("nan"),
        "batch_size": batch_size,
        "input_len": input_len,
        "output_len": output_len,
    }


def result_lines(result: dict) -> list[str]:
    """vLLM's lines, then the time per output token."""
    lines = [f"Avg latency: {result['avg_latency']} seconds"]
    for p in PERCENTILES:
        lines.append(f"{p}% percentile latency: {result['percentiles'][str(p)]} seconds")
    lines.append(f"Avg time per output token: {1000 * result['avg_tpot_seconds']:.3f} ms")
    return lines


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args, llm = parse_and_build(build_parser(prog), argv)
    result = run_latency(
        llm,
        batch_size=args.batch_size,
        input_len=args.input_len,
        output_len=args.output_len,
        num_iters_warmup=args.num_iters_warmup,
        num_iters=args.num_iters,
        seed=args.seed,
    )
    for line in result_lines(result):
        print(line, flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
