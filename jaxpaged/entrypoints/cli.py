"""The ``jaxpaged`` command: ``jaxpaged generate "Once upon a time"``, ``jaxpaged serve``,
``jaxpaged bench throughput|latency|serve|matrix`` (vLLM's ``vllm bench``), ``jaxpaged convert``.

Every ``EngineArgs`` field is a flag (``--max-model-len``, ``--block-size``, ...), as in vLLM.
The flags are defined in ``cli_args.py``; environment variables are read and set in ``env.py``.
This module is the top of the entry points: it imports the server and the benchmarks, and
nothing in the package imports it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
import time

from jaxpaged.entrypoints.cli_args import add_engine_args, add_serve_args, engine_args_from
from jaxpaged.entrypoints.convert import add_convert_parser, run_convert
from jaxpaged.entrypoints.env import set_jax_memory_fraction

# `jaxpaged bench KIND` -> (the module whose main(argv, prog=...) runs it, its one-line help).
BENCHMARKS = {
    "throughput": ("jaxpaged.benchmarks.throughput", "offline throughput of LLM.generate"),
    "latency": ("jaxpaged.benchmarks.latency", "latency of one batch, end to end"),
    "serve": ("jaxpaged.benchmarks.serving", "online serving: load a running server over HTTP"),
    "matrix": (
        "jaxpaged.benchmarks.matrix",
        "every kernel/code-path option on small engines: compiles? matches the reference? timings",
    ),
}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxpaged", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from one or more prompts")
    gen.add_argument("prompts", nargs="+", help="prompt texts; each becomes one request")
    gen.add_argument(
        "--max-tokens",
        type=int,
        default=128,
        help="most tokens to generate per prompt, >= 1 (default: 128)",
    )
    gen.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature, >= 0; 0 means greedy (default: 0)",
    )
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (default: 1)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k best tokens; 0 = off")
    gen.add_argument("--min-p", type=float, default=0.0, help="min-p floor in [0, 1]; 0 = off")
    gen.add_argument(
        "--sampling-seed",
        type=int,
        default=None,
        help="per-request sampling seed (default: derived from --seed)",
    )
    gen.add_argument(
        "--stop-token-ids", type=int, nargs="*", default=None, help="token ids that end generation"
    )
    gen.add_argument("--ignore-eos", action="store_true", help="generate past the EOS token")
    add_engine_args(gen)
    serve = sub.add_parser(
        "serve", help="start the OpenAI-compatible HTTP server (vLLM's `vllm serve`)"
    )
    add_serve_args(serve)
    bench = sub.add_parser(
        "bench",
        help="run a benchmark (vLLM's `vllm bench`); `jaxpaged bench KIND --help` lists its flags",
        description="Run a benchmark; `jaxpaged bench KIND --help` lists the flags of KIND.",
    )
    kinds = bench.add_subparsers(dest="bench_kind", required=True, metavar="KIND")
    for kind, (_, help_text) in BENCHMARKS.items():
        kinds.add_parser(kind, help=help_text, add_help=False)
    add_convert_parser(sub)
    return parser


def _bench(kind: str, argv: list[str]) -> int:
    """Run benchmark ``kind`` on its own flags ``argv`` (parsed by its module, whose usage
    line reads ``jaxpaged bench KIND``)."""
    module = importlib.import_module(BENCHMARKS[kind][0])
    prog = f"jaxpaged bench {kind}"
    try:
        return module.main(argv, prog=prog)
    except ValueError as error:  # bad engine arguments or workload (a prompt too long, ...)
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2


def _serve(args: argparse.Namespace) -> int:
    from jaxpaged.entrypoints.openai.api_server import serve

    return serve(args)


def _generate(args: argparse.Namespace) -> int:
    from jaxpaged.entrypoints.llm import LLM
    from jaxpaged.sampling_params import SamplingParams
    from jaxpaged.worker.distributed import is_driver

    engine_args = engine_args_from(args)
    set_jax_memory_fraction(engine_args.gpu_memory_utilization)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        stop_token_ids=args.stop_token_ids,
        ignore_eos=args.ignore_eos,
    )
    llm = LLM(**dataclasses.asdict(engine_args))
    start = time.perf_counter()
    outputs = llm.generate(args.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    if not is_driver():  # multi-host: every process ran the same engine; rank 0 reports
        return 0
    num_tokens = 0
    for output in outputs:
        completion = output.outputs[0]
        num_tokens += len(completion.token_ids)
        print(f"{output.prompt}{completion.text}\n", flush=True)
    print(
        f"[{num_tokens} tokens in {elapsed:.2f} s: {num_tokens / elapsed:.1f} tokens/s]",
        file=sys.stderr,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCHMARKS:
        # The benchmark parses its own flags (its --help included).
        return _bench(argv[1], argv[2:])
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "convert":
            return run_convert(args)
    except ValueError as error:
        print(f"jaxpaged: error: {error}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
