"""The ``jaxpaged`` command: ``jaxpaged generate "Once upon a time"``.

Every ``EngineArgs`` field is a flag (``--max-model-len``, ``--block-size``, ...), as in vLLM.
This is the only module that reads ``os.environ``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import types
import typing

from jaxpaged.config import EngineArgs


def add_engine_args(parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> None:
    """Add one ``--flag`` per ``EngineArgs`` field, with the field's help text and default."""
    group = parser.add_argument_group("engine arguments")
    hints = typing.get_type_hints(EngineArgs)
    for field in dataclasses.fields(EngineArgs):
        if field.name in skip:
            continue
        flag = "--" + field.name.replace("_", "-")
        base = _base_type(hints[field.name])
        help_text = f"{field.metadata.get('help', '')} (default: {field.default})"
        if base is bool:
            group.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=field.default, help=help_text
            )
        else:
            group.add_argument(flag, type=base, default=field.default, help=help_text)


def set_jax_memory_fraction(gpu_memory_utilization: float) -> None:
    """Size JAX's GPU memory pool to ``gpu_memory_utilization`` of the card.

    JAX preallocates ``XLA_PYTHON_CLIENT_MEM_FRACTION`` of the card (75% by default) when its
    GPU backend starts, and the engine's KV cache can only use memory inside that pool, so an
    entry point sets it before the first JAX operation. A value the user exported is kept.
    Library users set the variable themselves before using jax.
    """
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{gpu_memory_utilization:.4f}")


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
    return parser


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
    except ValueError as error:
        print(f"jaxpaged: error: {error}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
