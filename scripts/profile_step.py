"""Profile the engine's steps on the device: time a workload, then trace a window of its steps
with the JAX profiler and report where each step's device time goes (``scripts/trace_summary``).

Example (batch-1 decode of the Llama-3-8B shape on the H200)::

    python scripts/profile_step.py --model benchmarks/configs/llama-3-8b --load-format dummy \\
        --skip-tokenizer-init --dtype bfloat16 --max-model-len 2048 --async-scheduling \\
        --workload latency --trace-dir trace/

``--workload latency`` runs one request (``--input-len``/``--output-len``) and reports its time
per output token; ``random`` and ``sharegpt-synthetic`` run ``--num-prompts`` requests as
``jaxpaged bench throughput`` does and report its result line. The traced pass repeats the
workload (fresh prefix cache) and records engine steps ``--trace-start`` to
``--trace-start + --trace-steps``. XLA flags (e.g. command buffers) come from ``XLA_FLAGS`` as
usual. ``--seq-bucket-gap``/``--token-bucket-gap`` override the step buckets' spacing
(``jaxpaged.worker.model_runner``), to measure padding against compilation.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from jaxpaged.benchmarks import latency as benchmark_latency  # noqa: E402
from jaxpaged.benchmarks import throughput as benchmark_throughput  # noqa: E402
from jaxpaged.benchmarks.dataset import make_requests  # noqa: E402
from jaxpaged.entrypoints.cli_args import add_engine_args  # noqa: E402
from scripts import trace_summary  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workload", choices=["latency", "random", "sharegpt-synthetic"], default="latency"
    )
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens")
    parser.add_argument("--num-prompts", type=int, default=1000, help="requests (throughput)")
    parser.add_argument("--latency-iters", type=int, default=5, help="timed latency iterations")
    parser.add_argument("--trace-dir", default=None, help="trace here (no trace if unset)")
    parser.add_argument("--trace-start", type=int, default=0, help="first traced engine step")
    parser.add_argument("--trace-steps", type=int, default=64, help="engine steps traced")
    parser.add_argument("--seq-bucket-gap", type=int, default=None, help="sequence bucket gap")
    parser.add_argument("--token-bucket-gap", type=int, default=None, help="token bucket gap")
    parser.add_argument("--output-json", default=None, help="write timings and step groups")
    add_engine_args(parser)
    return parser


def traced_pass(engine, prompts: list[list[int]], output_lens: list[int], *, trace_dir: str,
                start: int, num_steps: int) -> pathlib.Path:
    """Run the requests to completion, tracing engine steps ``[start, start + num_steps)``;
    returns the trace file this pass wrote.

    Raises:
        ValueError: ``start`` below 0 or ``num_steps`` below 1.
        RuntimeError: the run ended before step ``start`` (nothing was traced).
    """
    import jax

    from jaxpaged.sampling_params import SamplingParams

    if start < 0 or num_steps < 1:
        raise ValueError(f"trace_start must be >= 0 and trace_steps >= 1, got {start}, {num_steps}")
    before = set(pathlib.Path(trace_dir).rglob("*.trace.json.gz"))
    engine.reset_prefix_cache()
    for i, (prompt, output_len) in enumerate(zip(prompts, output_lens, strict=True)):
        params = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=output_len)
        engine.add_request(f"traced-{i}", {"prompt_token_ids": prompt}, params, final_only=True)
    pathlib.Path(trace_dir).mkdir(parents=True, exist_ok=True)
    step = 0
    tracing = False
    try:
        while engine.has_unfinished_requests():
            if step == start:
                # No Python tracer: it would slow the host side this pass is meant to show.
                options = jax.profiler.ProfileOptions()
                options.python_tracer_level = 0
                jax.profiler.start_trace(
                    trace_dir, create_perfetto_trace=True, profiler_options=options
                )
                tracing = True
            engine.step()
            step += 1
            if tracing and step == start + num_steps:
                jax.effects_barrier()
                jax.profiler.stop_trace()
                tracing = False
    finally:
        if tracing:
            jax.profiler.stop_trace()
    if step <= start:
        raise RuntimeError(
            f"the run had {step} engine steps, so --trace-start {start} was never reached"
        )
    written = set(pathlib.Path(trace_dir).rglob("*.trace.json.gz")) - before
    if not written:
        raise RuntimeError(f"the profiler wrote no *.trace.json.gz under {trace_dir}")
    return max(written, key=lambda p: p.stat().st_mtime)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.trace_start < 0 or args.trace_steps < 1:
        parser.error(f"--trace-start must be >= 0 and --trace-steps >= 1, got "
                     f"{args.trace_start} and {args.trace_steps}")
    from jaxpaged.worker import model_runner

    if args.seq_bucket_gap:
        model_runner.SEQ_BUCKET_GAP = args.seq_bucket_gap
    if args.token_bucket_gap:
        model_runner.TOKEN_BUCKET_GAP = args.token_bucket_gap
    start = time.perf_counter()
    llm = benchmark_throughput.build_llm(args)
    engine = llm.llm_engine
    result: dict = {
        "startup_seconds": time.perf_counter() - start,
        "compile_seconds": engine.worker.compile_seconds,
        "num_buckets": len(engine.worker.model_runner.all_bucket_keys()),
    }
    print(engine.kv_cache_report(), flush=True)
    print(f"start-up {result['startup_seconds']:.1f} s, compiling {result['num_buckets']} "
          f"buckets {result['compile_seconds']:.1f} s", flush=True)
    if args.workload == "latency":
        timing = benchmark_latency.run_latency(
            llm, batch_size=1, input_len=args.input_len, output_len=args.output_len,
            num_iters_warmup=1, num_iters=args.latency_iters, seed=args.seed,
        )
        lines = benchmark_latency.result_lines(timing)[-1:]
        requests = make_requests("random", num_prompts=1, input_len=args.input_len,
                                 output_len=args.output_len, vocab_size=engine.vocab_size,
                                 seed=args.seed + 1)
    else:
        requests = make_requests(args.workload, num_prompts=args.num_prompts,
                                 input_len=args.input_len, output_len=args.output_len,
                                 vocab_size=engine.vocab_size, seed=args.seed)
        timing = benchmark_throughput.run_throughput(llm, requests)
        lines = benchmark_throughput.result_lines(timing)
    result["timing"] = timing
    for line in lines:
        print(line, flush=True)
    if args.trace_dir:
        trace = traced_pass(
            engine, [r.prompt_token_ids for r in requests], [r.output_len for r in requests],
            trace_dir=args.trace_dir, start=args.trace_start, num_steps=args.trace_steps,
        )
        events = trace_summary.load_events(trace)
        steps = trace_summary.gpu_steps(events)
        print(trace_summary.format_report(steps), flush=True)
        if not steps:
            print("\n".join(trace_summary.describe_lines(events)), flush=True)
        result["trace"] = str(trace)
        result["step_groups"] = trace_summary.group_steps(steps)
        result["idle_between_steps"] = trace_summary.idle_between_steps(steps)
    if args.output_json:
        pathlib.Path(args.output_json).write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
