"""The ``jaxpaged`` command: ``jaxpaged generate "Once upon a time"``, ``jaxpaged serve``,
``jaxpaged bench throughput|latency|serve`` (vLLM's ``vllm bench``).

Every ``EngineArgs`` field is a flag (``--max-model-len``, ``--block-size``, ...), as in vLLM.
This is the only module that reads ``os.environ`` (``JAXPAGED_API_KEY`` for ``serve``) or sets
it for child processes (``XLA_PYTHON_CLIENT_MEM_FRACTION``, ``PROMETHEUS_MULTIPROC_DIR``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import sys
import tempfile
import time
import types
import typing

from jaxpaged.config import EngineArgs
from jaxpaged.engine.dp_balancer import DP_ROUTING_CHOICES
from jaxpaged.entrypoints.convert import add_convert_parser, run_convert
from jaxpaged.metrics import DEFAULT_METRICS_PREFIX, METRICS_PREFIX_CHOICES

# vLLM's short aliases of engine flags.
_SHORT_FLAGS = {"quantization": ("-q",)}


def add_engine_args(parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> None:
    """Add one ``--flag`` per ``EngineArgs`` field, with the field's help text and default."""
    group = parser.add_argument_group("engine arguments")
    hints = typing.get_type_hints(EngineArgs)
    for field in dataclasses.fields(EngineArgs):
        if field.name in skip:
            continue
        flags = ["--" + field.name.replace("_", "-"), *_SHORT_FLAGS.get(field.name, ())]
        base = _base_type(hints[field.name])
        help_text = f"{field.metadata.get('help', '')} (default: {field.default})"
        if base is bool:
            group.add_argument(
                *flags, action=argparse.BooleanOptionalAction, default=field.default,
                help=help_text,
            )  # fmt: skip
        else:
            group.add_argument(*flags, type=base, default=field.default, help=help_text)


def set_jax_memory_fraction(gpu_memory_utilization: float) -> None:
    """Size JAX's GPU memory pool to ``gpu_memory_utilization`` of the card.

    JAX preallocates ``XLA_PYTHON_CLIENT_MEM_FRACTION`` of the card (75% by default) when its
    GPU backend starts, and the engine's KV cache can only use memory inside that pool, so an
    entry point sets it before the first JAX operation. A value the user exported is kept.
    Library users set the variable themselves before using jax.
    """
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{gpu_memory_utilization:.4f}")


@contextlib.contextmanager
def prometheus_multiproc_dir():
    """A fresh directory exported as ``PROMETHEUS_MULTIPROC_DIR`` for the block (removed, and
    the variable restored, after it): prometheus_client's multiprocess mode for the API
    processes of ``--api-server-count`` (children read it when they import prometheus_client,
    so it is set before they start)."""
    path = tempfile.mkdtemp(prefix="jaxpaged-prometheus-")
    previous = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    try:
        yield path
    finally:
        if previous is None:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = previous
        shutil.rmtree(path, ignore_errors=True)


def engine_args_from(namespace: argparse.Namespace) -> EngineArgs:
    values = {
        f.name: getattr(namespace, f.name)
        for f in dataclasses.fields(EngineArgs)
        if hasattr(namespace, f.name)
    }
    return EngineArgs(**values)


def _base_type(hint) -> type:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0]
    return hint


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
    _add_serve_parser(sub)
    bench = sub.add_parser(
        "bench",
        help="run a benchmark (vLLM's `vllm bench`); `jaxpaged bench KIND --help` lists its flags",
        add_help=False,
    )
    bench.add_argument("bench_kind", choices=sorted(BENCHMARKS), help="which benchmark")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="the benchmark's own flags")
    add_convert_parser(sub)
    return parser


# `jaxpaged bench KIND` -> the module whose main() runs it (scripts/benchmark_*.py wrap them).
BENCHMARKS = {
    "throughput": "jaxpaged.benchmarks.throughput",
    "latency": "jaxpaged.benchmarks.latency",
    "serve": "jaxpaged.benchmarks.serving",
}


def _bench(args: argparse.Namespace) -> int:
    import importlib

    return importlib.import_module(BENCHMARKS[args.bench_kind]).main(args.bench_args)


def _add_serve_parser(sub) -> None:
    serve = sub.add_parser(
        "serve", help="start the OpenAI-compatible HTTP server (vLLM's `vllm serve`)"
    )
    serve.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="local HF model directory; omitted: the embedded stories260k (same as --model)",
    )
    serve.add_argument(
        "--host", default=None, help="address to listen on (default: all interfaces)"
    )
    serve.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    serve.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) clients send as `model`; the first is echoed in responses and "
        "labels the metrics (default: MODEL, or stories260k for the embedded model)",
    )
    serve.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on /v1/* (default: env JAXPAGED_API_KEY, "
        "else no key)",
    )
    serve.add_argument(
        "--chat-template",
        default=None,
        help="chat template file path or inline Jinja, replacing the tokenizer's",
    )
    serve.add_argument(
        "--max-num-queued-requests",
        type=int,
        default=None,
        help="most requests that may wait for a batch slot; more get HTTP 429 "
        "(default: unbounded, as vLLM)",
    )
    serve.add_argument(
        "--metrics-prefix",
        default=DEFAULT_METRICS_PREFIX,
        choices=METRICS_PREFIX_CHOICES,
        help="/metrics name prefix: jaxpaged:<name>, or vllm:<name> for gateways, autoscalers "
        "and dashboards built for vLLM (default: jaxpaged)",
    )
    serve.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="engine cores, each with its own KV cache and scheduler on its own device group of "
        "--tensor-parallel-size devices, behind this one API server (default: 1)",
    )
    serve.add_argument(
        "--api-server-count",
        "-asc",
        type=int,
        default=1,
        help="API server processes (HTTP, tokenization, detokenization, streaming) in front of "
        "the one engine core, sharing one listening port; more keep up with a fast GPU; "
        ">= 1, and 1 with --data-parallel-size > 1 (default: 1)",
    )
    serve.add_argument(
        "--dp-routing",
        default="least_loaded",
        choices=DP_ROUTING_CHOICES,
        help="how the API server picks an engine core: least_loaded (fewest outstanding "
        "requests) or prefix (the hash of the prompt's first full KV block, so requests that "
        "share a prefix share a prefix cache) (default: least_loaded)",
    )
    serve.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        help="LoRA adapters served at start-up (with --enable-lora): name=path, or JSON "
        '{"name": ..., "path": ..., "base_model_name": ...}; clients select one by `model`',
    )
    for flag, help_text in _SERVE_SWITCHES.items():
        serve.add_argument(flag, action="store_true", help=help_text)
    serve.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level (default: info)",
    )
    add_engine_args(serve)


# vLLM's on/off serving flags (all off by default) -> their help; each is a build_app keyword.
_SERVE_SWITCHES = {
    "--return-tokens-as-token-ids": "write logprob tokens as 'token_id:<id>' unless a request "
    "sets return_tokens_as_token_ids (for tokens JSON cannot carry)",
    "--enable-prompt-tokens-details": "add usage.prompt_tokens_details.cached_tokens (prompt "
    "tokens read from the prefix cache) to responses",
    "--enable-tokenizer-info-endpoint": "serve GET /tokenizer_info (the tokenizer's "
    "configuration and chat template; off because it reveals the template)",
    "--enable-server-load-tracking": "count generation requests in flight for GET /load "
    "(otherwise it reports 0)",
}


def serve_options(args: argparse.Namespace, environ=os.environ) -> dict:
    """``run_server`` keywords from parsed ``serve`` flags (``environ`` supplies the key).

    Raises:
        ValueError: MODEL and --model disagree, a bad --max-num-queued-requests,
            --data-parallel-size or --api-server-count, or bad --lora-modules
            (``check_lora_modules``).
    """
    from jaxpaged.config import DEFAULT_MODEL_NAME
    from jaxpaged.entrypoints.openai.api_server import check_api_server_count
    from jaxpaged.entrypoints.openai.serving_models import check_lora_modules, parse_lora_modules

    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(
            f"MODEL ({args.model_tag!r}) and --model ({args.model!r}) disagree; give one"
        )
    args.model = args.model_tag or args.model
    if args.max_num_queued_requests is not None and args.max_num_queued_requests < 0:
        raise ValueError(
            f"--max-num-queued-requests must be >= 0, got {args.max_num_queued_requests}"
        )
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be at least 1, got {args.data_parallel_size}")
    check_api_server_count(args.api_server_count, args.data_parallel_size)
    engine_args = engine_args_from(args)
    served_model_names = args.served_model_name or [args.model or DEFAULT_MODEL_NAME]
    lora_modules = parse_lora_modules(args.lora_modules)
    # Before the engine core loads the model, not after.
    check_lora_modules(
        lora_modules, engine_args.enable_lora, served_model_names, engine_args.max_lora_rank
    )
    return dict(
        engine_args=engine_args,
        host=args.host,
        port=args.port,
        served_model_names=served_model_names,
        api_key=args.api_key or environ.get("JAXPAGED_API_KEY") or None,
        chat_template=args.chat_template,
        max_num_queued_requests=args.max_num_queued_requests,
        metrics_prefix=args.metrics_prefix,
        data_parallel_size=args.data_parallel_size,
        dp_routing=args.dp_routing,
        uvicorn_log_level=args.uvicorn_log_level,
        lora_modules=lora_modules,
        api_server_count=args.api_server_count,
        **{
            flag.removeprefix("--").replace("-", "_"): getattr(
                args, flag.removeprefix("--").replace("-", "_")
            )
            for flag in _SERVE_SWITCHES
        },
    )


def _serve(args: argparse.Namespace) -> int:
    from jaxpaged.entrypoints.openai.api_server import run_server

    options = serve_options(args)
    # The engine core (a child process) inherits the variable; this process never uses JAX.
    set_jax_memory_fraction(options["engine_args"].gpu_memory_utilization)
    if options["api_server_count"] == 1:
        return run_server(**options)
    with prometheus_multiproc_dir() as metrics_dir:
        return run_server(**options, multiprocess_metrics_dir=metrics_dir)


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
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "bench":
            return _bench(args)
        if args.command == "convert":
            return run_convert(args)
    except ValueError as error:
        print(f"jaxpaged: error: {error}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
