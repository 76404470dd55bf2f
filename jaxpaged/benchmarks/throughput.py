"""Offline throughput: jaxpaged's counterpart of vLLM's ``benchmarks/benchmark_throughput.py``.

All requests are queued at once and run to completion; the result line is vLLM's::

    Throughput: X requests/s, Y total tokens/s, Z output tokens/s

Prompts are token ids (``--dataset-name random`` with ``--input-len/--output-len``, or
``sharegpt-synthetic``, see ``jaxpaged/benchmarks/dataset.py``), so a config-only model directory
with ``--load-format dummy --skip-tokenizer-init`` is enough. Every ``EngineArgs`` field is a flag.

Example (the H200 runs of docs/benchmarks.md)::

    jaxpaged bench throughput --model benchmarks/configs/llama-3-8b \\
        --load-format dummy --skip-tokenizer-init --dtype bfloat16 --max-model-len 2048 \\
        --max-num-seqs 1024 --max-num-batched-tokens 16384 \\
        --dataset-name random --input-len 128 --output-len 128 --num-prompts 1000
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from jaxpaged.benchmarks.dataset import DATASET_NAMES, BenchmarkRequest, make_requests
from jaxpaged.entrypoints.cli_args import add_engine_args, engine_args_from
from jaxpaged.entrypoints.env import set_jax_memory_fraction
from jaxpaged.worker.step_timeline import StepTimeline

# Fragmentation is sampled every this many engine steps.
_FRAGMENTATION_EVERY = 8


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dataset-name",
        choices=DATASET_NAMES,
        default="random",
        help="random: fixed --input-len/--output-len; sharegpt-synthetic: ShareGPT-like lengths",
    )
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens (random)")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens (random)")
    parser.add_argument("--num-prompts", type=int, default=1000, help="requests to run")
    parser.add_argument("--n", type=int, default=1, help="outputs per prompt; only 1 here")
    parser.add_argument("--output-json", type=str, default=None, help="write results as JSON")
    parser.add_argument(
        "--no-warmup", action="store_true", help="skip the short warm-up run before timing"
    )
    add_engine_args(parser)
    return parser


def build_llm(args: argparse.Namespace):
    """The ``LLM`` of the parsed engine flags (JAX's memory pool sized from them first)."""
    engine_args = engine_args_from(args)
    set_jax_memory_fraction(engine_args.gpu_memory_utilization)
    from jaxpaged.entrypoints.llm import LLM

    llm = LLM(**vars(engine_args))
    llm.llm_engine.wait_for_executables()  # a warm start loads buckets in the background
    return llm


def parse_and_build(parser: argparse.ArgumentParser, argv: list[str] | None):
    """``(args, llm)`` for a benchmark's ``main``: parse ``argv``, refuse ``--n`` other than 1
    (these benchmarks time one sequence per request), build the ``LLM`` and print its KV-cache
    report. A bad flag exits through ``parser.error`` (status 2)."""
    args = parser.parse_args(argv)
    if args.n != 1:
        parser.error(f"--n {args.n}: this benchmark supports only n=1")
    llm = build_llm(args)
    print(llm.llm_engine.kv_cache_report(), flush=True)
    return args, llm


def run_requests(
    engine, requests: list[BenchmarkRequest], *, tag: str, structured_outputs=None
) -> dict:
    """Queue every request, step the engine until all finish; timing, tokens, fragmentation.
    ``structured_outputs``: a ``StructuredOutputsParams`` every request carries (None: none)."""
    from jaxpaged.sampling_params import SamplingParams

    stored_sum = held_sum = 0
    worst_waste = 0.0
    num_output_tokens = 0
    start = time.perf_counter()
    for i, request in enumerate(requests):
        # vLLM's benchmark sampling: random sampling, every request runs to its output length.
        params = SamplingParams(
            n=1,
            temperature=1.0,
            top_p=1.0,
            ignore_eos=True,
            max_tokens=request.output_len,
            structured_outputs=structured_outputs,
        )
        engine.add_request(
            f"{tag}-{i}", {"prompt_token_ids": request.prompt_token_ids}, params, final_only=True
        )
    num_calls = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            num_output_tokens += len(output.outputs[0].token_ids)
        num_calls += 1
        if num_calls % _FRAGMENTATION_EVERY == 0:
            stored, held = engine.kv_cache_manager.slots_stored_vs_held()
            stored_sum += stored
            held_sum += held
            if held:
                worst_waste = max(worst_waste, 1 - stored / held)
    elapsed = time.perf_counter() - start
    return {
        "elapsed_time": elapsed,
        "num_output_tokens": num_output_tokens,
        "num_steps": num_calls,
        "fragmentation": 1 - stored_sum / held_sum if held_sum else 0.0,
        "fragmentation_worst": worst_waste,
    }


def run_throughput(
    llm, requests: list[BenchmarkRequest], *, warmup: bool = True, structured_outputs=None
) -> dict:
    """Time ``requests`` on ``llm``'s engine (after a short warm-up run); with
    ``structured_outputs`` every request carries that constraint (it must not be able to
    complete within the output length, so that every request makes its tokens)."""
    engine = llm.llm_engine
    if warmup:
        warm = [BenchmarkRequest(r.prompt_token_ids[:16], 4) for r in requests[:8]]
        run_requests(engine, warm, tag="warmup", structured_outputs=structured_outputs)
    result: dict = {}
    # A timed run must not read prefixes that an earlier run (the warm-up, or the same
    # workload run synchronously first) left in the prefix cache: vLLM's prompts are fresh.
    engine.reset_prefix_cache()
    hits_before = engine.scheduler.prefix_cache_hits
    # Each step's dispatch and finish times give the device's idle fraction (an upper bound).
    runner = engine.worker.model_runner
    scheduled_before, bucket_before = runner.num_scheduled_tokens, runner.num_bucket_tokens
    timeline = StepTimeline()
    engine.worker.set_step_timeline(timeline)
    try:
        run = run_requests(engine, requests, tag="timed", structured_outputs=structured_outputs)
    finally:
        engine.worker.set_step_timeline(None)
        timeline.close()
    idle, span, num_device_steps = timeline.idle_fraction()
    bucket_tokens = runner.num_bucket_tokens - bucket_before
    padding = 1 - (runner.num_scheduled_tokens - scheduled_before) / max(bucket_tokens, 1)
    num_prompt_tokens = sum(r.prompt_len for r in requests)
    expected_output = sum(r.output_len for r in requests)
    if run["num_output_tokens"] != expected_output:
        raise RuntimeError(
            f"generated {run['num_output_tokens']} tokens, expected {expected_output}"
        )
    elapsed = run["elapsed_time"]
    total_tokens = num_prompt_tokens + run["num_output_tokens"]
    result.update(
        {
            "elapsed_time": elapsed,
            "num_requests": len(requests),
            "total_num_tokens": total_tokens,
            "total_num_prompt_tokens": num_prompt_tokens,
            "total_num_output_tokens": run["num_output_tokens"],
            "requests_per_second": len(requests) / elapsed,
            "tokens_per_second": total_tokens / elapsed,
            "output_tokens_per_second": run["num_output_tokens"] / elapsed,
            "num_steps": run["num_steps"],
            "fragmentation": run["fragmentation"],
            "fragmentation_worst": run["fragmentation_worst"],
            "device_idle_fraction": idle,
            "prefix_cache_hit_tokens": engine.scheduler.prefix_cache_hits - hits_before,
            "bucket_padding_fraction": padding,
            "device_span": span,
            "num_device_steps": num_device_steps,
        }
    )
    return result


def result_lines(result: dict) -> list[str]:
    """vLLM's result lines, then jaxpaged's extra figures."""
    elapsed = result["elapsed_time"]
    lines = [
        f"Throughput: {result['requests_per_second']:.2f} requests/s, "
        f"{result['tokens_per_second']:.2f} total tokens/s, "
        f"{result['output_tokens_per_second']:.2f} output tokens/s",
        f"Total num prompt tokens:  {result['total_num_prompt_tokens']}",
        f"Total num output tokens:  {result['total_num_output_tokens']}",
        f"Elapsed: {elapsed:.2f} s over {result['num_steps']} steps "
        f"({1000 * elapsed / max(result['num_steps'], 1):.2f} ms/step)",
        f"KV internal fragmentation: {100 * result['fragmentation']:.2f}% of held slots "
        f"(worst sample {100 * result['fragmentation_worst']:.2f}%)",
        f"Bucket padding: {100 * result['bucket_padding_fraction']:.1f}% of step tokens",
        f"Device idle (upper bound): {100 * result['device_idle_fraction']:.1f}% of "
        f"{result['device_span']:.2f} s over {result['num_device_steps']} dispatched steps",
    ]
    return lines


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args, llm = parse_and_build(build_parser(prog), argv)
    engine = llm.llm_engine
    print(f"Compiled step buckets in {engine.worker.compile_seconds:.1f} s", flush=True)
    requests = make_requests(
        args.dataset_name,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        vocab_size=engine.vocab_size,
        seed=args.seed,
    )
    result = run_throughput(llm, requests, warmup=not args.no_warmup)
    for line in result_lines(result):
        print(line, flush=True)
    if args.output_json:
        result["kv_cache"] = engine.kv_cache_report()
        result["args"] = {k: v for k, v in vars(args).items()}
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
