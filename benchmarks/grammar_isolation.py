"""Grammar isolation on a real engine: each hostile constraint's verdict and time to it, and the
latency of plain requests while it compiles, against idle.

The engine is driven as the engine core drives it (``add_request(..., wait_for_grammar=False)``,
``admit_grammars()`` between steps), one plain request at a time (``--input-len`` random prompt
tokens, ``--output-len`` tokens). Also reported: the grammar backend's start-up (import, tokenizer,
first compilation: on a worker, while the engine starts) and the first constrained request.

H100 / H200, Llama-3-8B shape with a 128k-token vocabulary::

    python benchmarks/grammar_isolation.py --model benchmarks/configs/llama-3-8b \\
        --load-format dummy --synthetic-vocab --dtype bfloat16 --max-model-len 2048 \\
        --max-num-seqs 64 --out grammar_isolation.json

CPU smoke test: ``python benchmarks/grammar_isolation.py --dtype float32 --max-model-len 256``
(stories260k).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from benchmarks.structured_outputs import _commit, synthetic_tokenizer  # noqa: E402
from jaxpaged.entrypoints.cli import (  # noqa: E402
    add_engine_args,
    engine_args_from,
    set_jax_memory_fraction,
)


def _nested(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def hostile_cases() -> list[tuple[str, dict]]:
    """Constraints that once stalled or crashed the engine, and large legitimate ones."""
    wide = {f"field_{i}": {"type": "string", "maxLength": 20} for i in range(600)}
    return [
        ("json nested 440 levels", dict(json=_nested(440))),
        ("json nested 30 levels", dict(json=_nested(30))),
        ("json 30 KB schema", dict(json={"type": "object", "properties": wide})),
        ("json enum of 100,000", dict(json={"enum": [f"item{i:06d}" for i in range(100_000)]})),
        ("choice of 2,000", dict(choice=[f"item{i}" for i in range(2000)])),
        ("choice of 20,000", dict(choice=[f"item{i}" for i in range(20_000)])),
        ("regex a{1000000}", dict(regex="a{1000000}")),
        ('grammar root ::= root "a"', dict(grammar='root ::= root "a"')),
        ("json external $ref", dict(json={"$ref": "http://example.com/s.json"})),
        ("json multipleOf", dict(json={"type": "integer", "multipleOf": 3})),
    ]


class Driver:
    """One plain request at a time, stepping as the engine core does."""

    def __init__(self, engine, prompt_ids: list[int], output_len: int):
        from jaxpaged import SamplingParams

        self.engine = engine
        self.prompt = {"prompt_token_ids": prompt_ids}
        self.params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        self.verdicts: dict[str, tuple[float, Exception | None]] = {}
        self._count = 0

    def _admit(self) -> None:
        for request_id, error in self.engine.admit_grammars():
            self.verdicts[request_id] = (time.perf_counter(), error)

    def plain(self) -> float:
        self._count += 1
        request_id = f"plain-{self._count}"
        started = time.perf_counter()
        self.engine.add_request(request_id, self.prompt, self.params, wait_for_grammar=False)
        while True:
            self._admit()
            if self.engine.get_num_unfinished_requests() <= self.engine.num_waiting_for_grammar:
                time.sleep(0.001)
                continue
            for out in self.engine.step():
                if out.request_id == request_id and out.finished:
                    return time.perf_counter() - started

    def constrained(self, request_id: str, fields: dict) -> None:
        from jaxpaged import SamplingParams, StructuredOutputsParams

        started = time.perf_counter()
        try:
            params = SamplingParams(
                max_tokens=4, structured_outputs=StructuredOutputsParams(**fields)
            )
            self.engine.add_request(request_id, self.prompt, params, wait_for_grammar=False)
        except ValueError as error:
            self.verdicts[request_id] = (time.perf_counter(), error)
        self.verdicts.setdefault(f"{request_id}:start", (started, None))


def run(engine, driver: Driver) -> list[dict]:
    rows = []
    for i, (name, fields) in enumerate(hostile_cases()):
        request_id = f"hostile-{i}"
        driver.constrained(request_id, fields)
        during = []
        while request_id not in driver.verdicts:
            during.append(driver.plain())
        ended, error = driver.verdicts[request_id]
        while engine.has_unfinished_requests():  # an accepted one runs its 4 tokens
            engine.step()
        rows.append(
            {
                "constraint": name,
                "verdict": "accepted" if error is None else f"400: {str(error)[:90]}",
                "seconds_to_verdict": ended - driver.verdicts[f"{request_id}:start"][0],
                "plain_requests_during": len(during),
                "plain_p50_ms_during": 1000 * statistics.median(during) if during else None,
            }
        )
        while engine.structured_output.num_compiling:  # an abandoned one runs on: let it end
            time.sleep(0.05)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input-len", type=int, default=128, help="plain prompt tokens")
    parser.add_argument("--output-len", type=int, default=16, help="plain output tokens")
    parser.add_argument(
        "--synthetic-vocab",
        action="store_true",
        help="grammar tokenizer: random byte-level tokens, as many as the model's vocab_size",
    )
    parser.add_argument("--out", type=str, default=None, help="write the results as JSON")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    import jax
    import numpy as np

    from jaxpaged import LLM, SamplingParams, StructuredOutputsParams

    set_jax_memory_fraction(args.gpu_memory_utilization)
    with tempfile.TemporaryDirectory() as tmp:
        if args.synthetic_vocab:
            with open(pathlib.Path(args.model) / "config.json") as f:
                vocab_size = json.load(f)["vocab_size"]
            args.tokenizer = synthetic_tokenizer(vocab_size, tmp)
            args.skip_tokenizer_init = True  # prompts are ids; the grammar loads its own
        started = time.perf_counter()
        llm = LLM(**vars(engine_args_from(args)))
        engine_seconds = time.perf_counter() - started
        engine = llm.llm_engine
        backend_seconds = engine.structured_output.warm_up.result()
        ready = time.perf_counter() - started
        rng = np.random.default_rng(0)
        prompt_ids = rng.integers(0, engine.vocab_size, args.input_len).tolist()
        first = time.perf_counter()
        so = StructuredOutputsParams(json={"type": "object", "properties": {"a": {}}})
        engine.add_request("first", {"prompt_token_ids": prompt_ids}, SamplingParams(
            max_tokens=2, structured_outputs=so))  # fmt: skip
        first_seconds = time.perf_counter() - first
        while engine.has_unfinished_requests():
            engine.step()
        driver = Driver(engine, prompt_ids, args.output_len)
        driver.constrained("warm", dict(regex="[a-z]{4}"))  # beside a plain one: its buckets
        for _ in range(3):  # compile the plain request's buckets
            driver.plain()
        while engine.has_unfinished_requests():
            engine.step()
        idle = [driver.plain() for _ in range(9)]
        rows = run(engine, driver)
        backend = engine.structured_output.backend.name
    idle_ms = 1000 * statistics.median(idle)
    print(f"engine built in {engine_seconds:.1f} s; grammar backend {backend} started in "
          f"{backend_seconds:.1f} s on a worker (ready {ready:.1f} s after the start); first "
          f"constrained request admitted in {first_seconds:.2f} s")  # fmt: skip
    print(f"plain request ({args.input_len} + {args.output_len} tokens), idle p50 {idle_ms:.1f} ms")
    print("| constraint | verdict | s to verdict | plain requests during | plain p50 ms during |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        during = "-" if r["plain_p50_ms_during"] is None else f"{r['plain_p50_ms_during']:.1f}"
        print(f"| {r['constraint']} | {r['verdict']} | {r['seconds_to_verdict']:.2f} | "
              f"{r['plain_requests_during']} | {during} |")  # fmt: skip
    if args.out:
        result = {
            "rows": rows,
            "idle_p50_ms": idle_ms,
            "backend": backend,
            "backend_start_s": backend_seconds,
            "first_constrained_admitted_s": first_seconds,
            "device": str(jax.devices()[0].device_kind),
            "commit": _commit(),
        }
        pathlib.Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
