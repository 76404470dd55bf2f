"""Structured outputs' cost: throughput with every request under a JSON schema vs none, and
batch-1 TPOT with and without (targets: >= 0.9x throughput, <= +10% TPOT).

One engine serves all four runs (same card, same compiled buckets). Prompts are random token
ids; every request runs to its output length (``ignore_eos``), and the default schema needs
far more than 128 tokens to complete (an array of at least 64 records), so constrained requests
make as many tokens as unconstrained ones. Dummy weights give garbage logits; the grammar still
constrains every sampled token, so the mask work is the real one.

The grammar needs a tokenizer of the model's vocabulary size. A config-only model directory has
none: ``--synthetic-vocab`` builds a byte-level tokenizer of ``vocab_size`` random tokens (in a
temporary directory) so that xgrammar walks a vocabulary as large as Llama-3's.

H200 / H100, Llama-3-8B shape (the command of docs/benchmarks.md)::

    python benchmarks/structured_outputs.py --model benchmarks/configs/llama-3-8b \\
        --load-format dummy --synthetic-vocab --dtype bfloat16 --max-model-len 2048 \\
        --max-num-seqs 1024 --max-num-batched-tokens 16384 --async-scheduling \\
        --num-prompts 1000 --input-len 128 --output-len 128 --out structured.json

CPU smoke test: ``--num-prompts 8 --input-len 8 --output-len 8 --tpot-requests 1`` on the
default stories260k.

``--host-only`` measures just the host's part, no model: per step, the time to fill the bitmask
rows of ``--batch-sizes`` matchers and to advance them by one token each (a random allowed one),
for each grammar backend installed, on a synthetic vocabulary of ``--vocab-size`` tokens. The
engine fills the rows between a step's forward and its sampling (async scheduling) or before the
step (sync), so this is what a step can hide behind the device (async) or adds to it (sync)::

    python benchmarks/structured_outputs.py --host-only --vocab-size 128256 \
        --batch-sizes 1,64,256,512 --steps 20
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from jaxpaged.benchmarks.dataset import make_requests  # noqa: E402
from jaxpaged.benchmarks.throughput import run_throughput  # noqa: E402
from jaxpaged.entrypoints.cli import (  # noqa: E402
    add_engine_args,
    engine_args_from,
    set_jax_memory_fraction,
)

RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string", "maxLength": 16},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
        "score": {"type": "number"},
    },
    "required": ["id", "name", "tags", "score"],
}
DEFAULT_SCHEMA = {
    "type": "object",
    "properties": {"records": {"type": "array", "items": RECORD, "minItems": 64}},
    "required": ["records"],
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens (random)")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens")
    parser.add_argument("--num-prompts", type=int, default=1000, help="throughput requests")
    parser.add_argument(
        "--tpot-requests", type=int, default=5, help="batch-1 requests per TPOT figure"
    )
    parser.add_argument(
        "--json-schema", type=str, default=None, help="schema file; default: 64+ records"
    )
    parser.add_argument(
        "--synthetic-vocab",
        action="store_true",
        help="grammar tokenizer: random byte-level tokens, as many as the model's vocab_size",
    )
    parser.add_argument("--out", type=str, default=None, help="write the results as JSON")
    parser.add_argument(
        "--host-only", action="store_true", help="time the host's mask work only (no model)"
    )
    parser.add_argument("--vocab-size", type=int, default=128256, help="--host-only vocabulary")
    parser.add_argument(
        "--batch-sizes", type=str, default="1,64,256,512", help="--host-only matchers per step"
    )
    parser.add_argument("--steps", type=int, default=20, help="--host-only steps per figure")
    add_engine_args(parser)
    return parser


def synthetic_tokenizer(vocab_size: int, directory: str) -> str:
    """A byte-level BPE tokenizer of ``vocab_size`` tokens (256 bytes, then random 2-8 byte
    strings of JSON-ish characters) saved in ``directory``."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    chars = 'abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ":,{}[]._-'
    mapping = _bytes_to_unicode()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    rng = random.Random(0)
    while len(vocab) < vocab_size - 1:
        word = "".join(rng.choice(chars) for _ in range(rng.randint(2, 8)))
        token = "".join(mapping[b] for b in word.encode())
        vocab.setdefault(token, len(vocab))
    vocab["<|eos|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>")
    fast.save_pretrained(directory)
    return directory


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the ByteLevel alphabet)."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def batch1_tpot(engine, requests, structured_outputs) -> float:
    """Mean seconds per output token after the first, one request at a time."""
    from jaxpaged.sampling_params import SamplingParams

    per_token = []
    for i, request in enumerate(requests):
        params = SamplingParams(
            temperature=1.0,
            ignore_eos=True,
            max_tokens=request.output_len,
            structured_outputs=structured_outputs,
        )
        engine.add_request(f"tpot-{i}", {"prompt_token_ids": request.prompt_token_ids}, params)
        first = None
        while engine.has_unfinished_requests():
            engine.step()
            if first is None:
                first = time.perf_counter()
        per_token.append((time.perf_counter() - first) / max(request.output_len - 1, 1))
    return sum(per_token) / len(per_token)


def _commit() -> str | None:
    """The repository's HEAD commit (None outside a git checkout)."""
    import subprocess

    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=pathlib.Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def host_mask_cost(schema, vocab_size: int, batch_sizes: list[int], steps: int) -> list[dict]:
    """Median milliseconds per step to fill ``B`` bitmask rows and to accept one token in each
    of ``B`` matchers (the grammar's allowed tokens drawn at random, seed 0), per backend.

    Returns:
        Rows ``{"backend", "batch_size", "fill_ms", "accept_ms", "compile_s"}``; a backend
        whose package does not import is left out.
    """
    import numpy as np
    from transformers import AutoTokenizer

    from jaxpaged.sampling_params import StructuredOutputsParams
    from jaxpaged.structured_output.backend import XGrammarBackend
    from jaxpaged.structured_output.backend_guidance import GuidanceBackend
    from jaxpaged.structured_output.bitmask import ALL_ALLOWED, allowed_tokens, num_words

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = AutoTokenizer.from_pretrained(synthetic_tokenizer(vocab_size, tmp))
        params = StructuredOutputsParams(json=schema)
        for cls in (XGrammarBackend, GuidanceBackend):
            try:
                backend = cls(
                    lambda: tokenizer, vocab_size=vocab_size, stop_token_ids=[vocab_size - 1]
                )
            except ValueError as error:  # the package is not installed
                print(f"{cls.name}: skipped ({error})", file=sys.stderr)
                continue
            start = time.perf_counter()
            compiled = backend.compile(backend.check(params))
            compile_s = time.perf_counter() - start
            rng = np.random.default_rng(0)
            for batch in batch_sizes:
                matchers = [backend.matcher(compiled) for _ in range(batch)]
                bitmask = np.full((batch, num_words(vocab_size)), ALL_ALLOWED, np.int32)
                fill, accept = [], []
                for _ in range(steps):
                    start = time.perf_counter()
                    backend.fill_bitmask(matchers, bitmask, list(range(batch)))
                    fill.append(time.perf_counter() - start)
                    tokens = [
                        int(rng.choice(np.flatnonzero(allowed_tokens(row, vocab_size))))
                        for row in bitmask
                    ]
                    start = time.perf_counter()
                    if not all(backend.accept_tokens(matchers, tokens)):
                        raise RuntimeError(f"{cls.name} rejected a token its own mask allowed")
                    accept.append(time.perf_counter() - start)
                rows.append({
                    "backend": cls.name, "batch_size": batch, "compile_s": compile_s,
                    "fill_ms": 1000 * float(np.median(fill)),
                    "accept_ms": 1000 * float(np.median(accept)),
                })  # fmt: skip
    return rows


def main_host_only(args) -> int:
    import os

    rows = host_mask_cost(
        _schema(args), args.vocab_size, [int(b) for b in args.batch_sizes.split(",")], args.steps
    )
    print(f"host mask work per step, vocab {args.vocab_size}, {os.cpu_count()} CPUs")
    print("| backend | B | fill ms/step | accept ms/step | µs per row |\n|---|---:|---:|---:|---:|")
    for r in rows:
        per_row = 1000 * (r["fill_ms"] + r["accept_ms"]) / r["batch_size"]
        print(f"| {r['backend']} | {r['batch_size']} | {r['fill_ms']:.2f} | {r['accept_ms']:.2f} "
              f"| {per_row:.1f} |")  # fmt: skip
    if args.out:
        result = {"rows": rows, "vocab_size": args.vocab_size, "cpus": os.cpu_count(),
                  "commit": _commit()}  # fmt: skip
        pathlib.Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


def _schema(args) -> dict:
    if args.json_schema:
        return json.loads(pathlib.Path(args.json_schema).read_text())
    return DEFAULT_SCHEMA


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.host_only:
        return main_host_only(args)
    import jax

    from jaxpaged import LLM, StructuredOutputsParams

    set_jax_memory_fraction(args.gpu_memory_utilization)
    schema = _schema(args)
    with tempfile.TemporaryDirectory() as tmp:
        if args.synthetic_vocab:
            with open(pathlib.Path(args.model) / "config.json") as f:
                vocab_size = json.load(f)["vocab_size"]
            args.tokenizer = synthetic_tokenizer(vocab_size, tmp)
            args.skip_tokenizer_init = True  # prompts are ids; the grammar loads its own
        engine_args = engine_args_from(args)
        llm = LLM(**vars(engine_args))
        engine = llm.llm_engine
        so = StructuredOutputsParams(json=schema)
        requests = make_requests(
            "random",
            num_prompts=args.num_prompts,
            input_len=args.input_len,
            output_len=args.output_len,
            vocab_size=engine.vocab_size,
            seed=args.seed,
        )
        plain = run_throughput(llm, requests, structured_outputs=None)
        # Grammar steps use executables that start-up does not compile (the split halves, or
        # the whole step with a bitmask): a first untimed pass compiles every bucket it meets.
        run_throughput(llm, requests, structured_outputs=so)
        constrained = run_throughput(llm, requests, structured_outputs=so)
        tpot_requests = requests[: args.tpot_requests]
        for warm in (None, so):  # warm-up: batch-1 buckets of both variants
            batch1_tpot(engine, tpot_requests[:1], warm)
        tpot_plain = batch1_tpot(engine, tpot_requests, None)
        tpot_constrained = batch1_tpot(engine, tpot_requests, so)
        backend = engine.structured_output.backend.name
    result = {
        "backend": backend,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "output_tok_s_unconstrained": plain["output_tokens_per_second"],
        "output_tok_s_json_schema": constrained["output_tokens_per_second"],
        "throughput_ratio": constrained["output_tokens_per_second"]
        / plain["output_tokens_per_second"],
        "tpot_ms_unconstrained": 1000 * tpot_plain,
        "tpot_ms_json_schema": 1000 * tpot_constrained,
        "tpot_growth": tpot_constrained / tpot_plain - 1,
        # Where the difference goes: steps taken, time per step, and the device's idle share
        # (an upper bound, from each step's dispatch and finish) of each timed run.
        "runs": {
            name: {
                key: run[key]
                for key in ("num_steps", "elapsed_time", "device_idle_fraction", "device_span")
            }
            for name, run in (("unconstrained", plain), ("json_schema", constrained))
        },
        "async_scheduling": bool(args.async_scheduling),
        "commit": _commit(),
        "device": str(jax.devices()[0].device_kind),
        "schema": schema,
    }
    print("| run | output tok/s | batch-1 TPOT ms |\n|---|---|---|")
    print(
        f"| unconstrained | {result['output_tok_s_unconstrained']:.1f} | "
        f"{result['tpot_ms_unconstrained']:.2f} |"
    )
    print(
        f"| JSON schema ({backend}) | {result['output_tok_s_json_schema']:.1f} | "
        f"{result['tpot_ms_json_schema']:.2f} |"
    )
    print(
        f"throughput ratio {result['throughput_ratio']:.3f} (target >= 0.9); "
        f"TPOT growth {100 * result['tpot_growth']:+.1f}% (target <= +10%)"
    )
    for name, run in result["runs"].items():
        print(
            f"{name}: {run['num_steps']} steps, "
            f"{1000 * run['elapsed_time'] / max(run['num_steps'], 1):.2f} ms/step, "
            f"device idle <= {100 * run['device_idle_fraction']:.1f}%"
        )
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
