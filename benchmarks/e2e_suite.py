"""The end-to-end suite of docs/benchmarks.md in one process: one engine (compiled once) runs the
offline throughput workloads (fixed 128/128 and ShareGPT-like) and the batch-1 latency, then
prints a summary. Before the workloads it generates one token of one request and records the
seconds from the process's start to that token (``start_to_first_token_s``: imports, weights,
compiling every step bucket, the first step) and the engine's start-up phases.

    python benchmarks/e2e_suite.py --model benchmarks/configs/llama-3-8b \\
        --load-format dummy --skip-tokenizer-init --dtype bfloat16 --max-model-len 2048 \\
        --max-num-seqs 1024 --max-num-batched-tokens 16384 --output-dir results/

``benchmarks/lib/e2e_report.py`` turns its JSON (and the HF baseline's) into the tables and the
plot of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import platform
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from jaxpaged.benchmarks import latency as benchmark_latency  # noqa: E402
from jaxpaged.benchmarks import throughput as benchmark_throughput  # noqa: E402
from jaxpaged.benchmarks.dataset import make_requests  # noqa: E402
from jaxpaged.entrypoints.cli_args import add_engine_args  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=1000, help="requests per workload")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens (fixed)")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens (fixed)")
    parser.add_argument("--latency-input-len", type=int, default=128, help="batch-1 prompt")
    parser.add_argument("--latency-output-len", type=int, default=128, help="batch-1 output")
    parser.add_argument("--latency-warmup", type=int, default=2, help="untimed iterations")
    parser.add_argument("--latency-iters", type=int, default=5, help="timed iterations")
    parser.add_argument(
        "--workloads",
        nargs="+",
        default=["random", "sharegpt-synthetic", "latency"],
        choices=["random", "sharegpt-synthetic", "latency"],
        help="what to run, in order",
    )
    parser.add_argument("--output-dir", default=".", help="where suite.json goes")
    parser.add_argument(
        "--compare-sync",
        nargs="*",
        default=[],
        metavar="WORKLOAD",
        help="with --async-scheduling, also run these throughput workloads synchronously first",
    )
    add_engine_args(parser)
    return parser


def _environment() -> dict:
    import jax

    import jaxpaged

    device = jax.devices()[0]
    return {
        "jax": jax.__version__,
        "jaxpaged": jaxpaged.__version__,
        "python": platform.python_version(),
        "backend": jax.default_backend(),
        "device_kind": device.device_kind,
    }


def first_token(llm, suite: dict) -> None:
    """One request of one token; records the seconds from this process's start to its token
    (``start_to_first_token_s``, None without ``/proc``) and the engine's start-up phases."""
    from jaxpaged.engine.startup import process_start_time
    from jaxpaged.sampling_params import SamplingParams

    prompt = {"prompt_token_ids": list(range(10, 26))}
    llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    started = process_start_time()
    suite["start_to_first_token_s"] = None if started is None else time.time() - started
    suite["startup_phases"] = llm.llm_engine.startup.as_dict()
    if started is not None:
        print(f"Process start to first token {suite['start_to_first_token_s']:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    out_dir = pathlib.Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    suite: dict = {"args": vars(args)}

    def save() -> None:
        (out_dir / "suite.json").write_text(json.dumps(suite, indent=2))

    start = time.perf_counter()
    llm = benchmark_throughput.build_llm(args)
    engine = llm.llm_engine
    suite["environment"] = _environment()
    suite["startup_seconds"] = time.perf_counter() - start
    suite["compile_seconds"] = engine.worker.compile_seconds
    suite["num_buckets"] = len(engine.worker.model_runner.all_bucket_keys())
    suite["kv_cache"] = {
        "report": engine.kv_cache_report(),
        "num_blocks": engine.num_blocks,
        "block_size": engine.config.cache_config.block_size,
        "bytes": engine.num_blocks * engine.worker.kv_cache_spec.bytes_per_block,
        "budget": dataclasses.asdict(budget) if (budget := engine.worker.memory_budget) else None,
    }
    print(engine.kv_cache_report(), flush=True)
    print(
        f"Start-up {suite['startup_seconds']:.1f} s, of which compiling "
        f"{suite['num_buckets']} step buckets {engine.worker.compile_seconds:.1f} s",
        flush=True,
    )
    save()
    first_token(llm, suite)
    save()

    for workload in args.workloads:
        print(f"=== {workload} ===", flush=True)
        if workload == "latency":
            result = benchmark_latency.run_latency(
                llm,
                batch_size=1,
                input_len=args.latency_input_len,
                output_len=args.latency_output_len,
                num_iters_warmup=args.latency_warmup,
                num_iters=args.latency_iters,
                seed=args.seed,
            )
            lines = benchmark_latency.result_lines(result)
        else:
            requests = make_requests(
                workload,
                num_prompts=args.num_prompts,
                input_len=args.input_len,
                output_len=args.output_len,
                vocab_size=engine.vocab_size,
                seed=args.seed,
            )
            if workload in args.compare_sync and engine.async_scheduling:
                engine.async_scheduling = False
                sync = benchmark_throughput.run_throughput(llm, requests)
                engine.async_scheduling = True
                suite[f"{workload}-sync"] = sync
                for line in benchmark_throughput.result_lines(sync):
                    print(f"[sync] {line}", flush=True)
            result = benchmark_throughput.run_throughput(llm, requests)
            lines = benchmark_throughput.result_lines(result)
        for line in lines:
            print(line, flush=True)
        suite[workload] = result
        save()
    print(engine.fragmentation_report(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
