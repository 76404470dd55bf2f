"""Each request's life in the engine core under load: arrival -> add -> first scheduled step ->
first token out, with the device step that was running when it arrived.

Starts the engine-core process as ``jaxpaged serve`` does (``start_core_process``) with
``TracingEngineCore`` (``jaxpaged/engine_core/request_trace.py``), and plays the API process itself:
``--num-prompts`` requests of ``--input-len`` random token ids and ``--output-len`` tokens
(``ignore_eos``, greedy), sent at ``--request-rate`` per second (Poisson, seeded) or by
``--max-concurrency`` closed-loop clients (``--seed`` seeds the prompts and arrivals), over the core's own wire (no HTTP: what it measures
is the core). ``--warmup-prompts`` of the same shapes run first, untraced (every step shape
compiled). Then it fetches the core's trace and prints, per variant:

- per-segment percentiles of the core's time (``api_to_core``: the client's send to the core
  loop taking the message; ``add``; ``to_schedule``: added to the start of the core step that
  scheduled it; ``to_first_token``: from there to the first token leaving the core;
  ``core_ttft``: received to first token sent), and the client's TTFT (send -> first output
  received) and TPOT (per request, (last - first output) / (tokens - 1));
- ``lag`` counts: scheduled step - the device step running at arrival (2: the request waited
  for step N + 2; 1: it joined N + 1); device step times and the device's idle fraction;
- the slowest requests' lives.

``--load NAME:n=...,in=...,out=...,rate=...,concurrency=...`` (repeatable) traces several loads
one after the other on the same core process. ``--compare`` runs the core twice, with late scheduling (the default core) and without
(``EagerTracingEngineCore``: step N + 1 scheduled as soon as N is launched). ``--out`` writes
everything (every request's life included) as JSON.

    # H200, the 20 req/s case of benchmarks/results/server-split (Llama-3-8B shape, dummy weights)
    python -m scripts.trace_request_life --model benchmarks/configs/llama-3-8b \\
        --load-format dummy --skip-tokenizer-init --dtype bfloat16 --max-model-len 2048 \\
        --max-num-seqs 512 --max-num-batched-tokens 4096 --async-scheduling \\
        --num-prompts 400 --request-rate 20 --input-len 512 --output-len 128 --compare \\
        --out /tmp/trace.json
    # CPU (embedded stories260k), steps made 50 ms long on a simulated device
    python -m scripts.trace_request_life --async-scheduling --dtype float32 \\
        --max-model-len 128 --max-num-seqs 8 --max-num-batched-tokens 64 --no-enforce-eager \\
        --num-prompts 40 --request-rate 20 --input-len 32 --output-len 16 --compare \\
        --simulated-device
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time

import numpy as np
import zmq

from jaxpaged import SamplingParams
from jaxpaged.engine.deltas import delta_finished
from jaxpaged.engine_core.core_messages import (
    Kind,
    decode,
    decode_output,
    encode,
    params_to_wire,
)
from jaxpaged.engine_core.core_process import start_core_process
from jaxpaged.engine_core.request_trace import format_lives, request_lives, summarize
from jaxpaged.entrypoints.cli import add_engine_args, engine_args_from, set_jax_memory_fraction

CORES = {
    "late": "jaxpaged.engine_core.request_trace:TracingEngineCore",
    "eager": "jaxpaged.engine_core.request_trace:EagerTracingEngineCore",
}
# --simulated-device: the same, on a device that takes 50 ms a step (tests/engine_core/slow_device.py)
SIMULATED_CORES = {
    "late": "tests.engine_core.slow_device:SimulatedTracingEngineCore",
    "eager": "tests.engine_core.slow_device:SimulatedEagerTracingEngineCore",
}


class CoreSession:
    """One engine-core process and this script's sockets to it (one client)."""

    def __init__(self, engine_args, core_class: str):
        self.started = start_core_process(engine_args, core_class=core_class)
        self.context = zmq.Context()
        self.input = self.context.socket(zmq.PUSH)
        self.input.connect(self.started.input_address)
        self.output = self.context.socket(zmq.PULL)
        self.output.bind(self.started.output_addresses[0])
        self.info = self.started.info
        self.call_id = 0

    def add(self, request_id: str, ids: list[int], params: dict) -> float:
        sent = time.monotonic()
        self.input.send(encode(Kind.ADD, [request_id, ids, params, sent, None, 0]))
        return sent

    def receive(self, timeout_s: float):
        """The next ``(kind, payload)`` within ``timeout_s`` (None: none came)."""
        if not self.output.poll(max(0, int(1000 * timeout_s))):
            return None
        kind, payload = decode(self.output.recv())
        if kind is Kind.DEAD:
            raise RuntimeError(f"the engine core died: {payload}")
        if kind is Kind.ACKS:
            for request_id, error in payload:
                if error is not None:
                    raise RuntimeError(f"request {request_id} refused: {error}")
        return kind, payload

    def utility(self, name: str, timeout_s: float = 120.0):
        self.call_id += 1
        self.input.send(encode(Kind.UTILITY, [0, self.call_id, name, []]))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            message = self.receive(deadline - time.monotonic())
            if message and message[0] is Kind.UTILITY and message[1][0] == self.call_id:
                _, result, error = message[1]
                if error:
                    raise RuntimeError(error)
                return result
        raise TimeoutError(name)

    def close(self) -> None:
        self.input.send(encode(Kind.SHUTDOWN, None))
        self.started.process.join(30)
        self.input.close(linger=0)
        self.output.close(linger=0)
        self.context.term()
        self.started.status_pipe.close()
        shutil.rmtree(self.started.ipc_dir, ignore_errors=True)


def run_load(
    session: CoreSession,
    prompts: list[list[int]],
    output_len: int,
    rate: float,
    concurrency: int,
    seed: int,
    tag: str,
) -> dict:
    """Send the requests (Poisson at ``rate``/s, or ``concurrency`` closed-loop clients when
    ``rate`` is 0), read outputs until all finish; the client's times."""
    params = params_to_wire(SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1 / rate, len(prompts)) if rate else None
    start = time.monotonic()
    send_at = list(np.cumsum(gaps) + start) if gaps is not None else None
    sent, first, last, tokens = {}, {}, {}, {}
    unfinished: set[str] = set()
    next_index = 0
    while next_index < len(prompts) or unfinished:
        now = time.monotonic()
        while next_index < len(prompts):
            if send_at is not None and send_at[next_index] > now:
                break
            if send_at is None and len(unfinished) >= concurrency:
                break
            request_id = f"{tag}-{next_index}"
            sent[request_id] = session.add(request_id, prompts[next_index], params)
            unfinished.add(request_id)
            next_index += 1
        wait = 1.0
        if send_at is not None and next_index < len(prompts):
            wait = max(0.0, send_at[next_index] - time.monotonic())
        message = session.receive(wait)
        if message is None or message[0] is not Kind.OUTPUTS:
            continue
        received = time.monotonic()
        for wire in message[1][0]:
            request_id = wire[0]
            count = sum(len(c.token_ids) for c in decode_output(wire).completions)
            if count:
                first.setdefault(request_id, received)
                last[request_id] = received
                tokens[request_id] = tokens.get(request_id, 0) + count
            if delta_finished(wire):
                unfinished.discard(request_id)
    elapsed = time.monotonic() - start
    ttft = [1000 * (first[r] - sent[r]) for r in first]
    tpot = [1000 * (last[r] - first[r]) / (tokens[r] - 1) for r in first if tokens.get(r, 0) > 1]
    return {
        "elapsed_s": elapsed,
        "output_tokens": sum(tokens.values()),
        "output_tok_per_s": sum(tokens.values()) / elapsed,
        "ttft_ms": _stats(ttft),
        "tpot_ms": _stats(tpot),
    }


def _stats(values: list[float]) -> dict:
    if not values:
        return {}
    array = np.asarray(values)
    return {
        "mean": float(array.mean()),
        "p50": float(np.percentile(array, 50)),
        "p99": float(np.percentile(array, 99)),
    }


@dataclasses.dataclass(frozen=True)
class Load:
    """One traced load: ``num_prompts`` of ``input_len`` ids and ``output_len`` tokens, sent at
    ``rate`` per second (Poisson), or by ``concurrency`` closed-loop clients when ``rate`` is 0."""

    name: str
    num_prompts: int
    input_len: int
    output_len: int
    rate: float
    concurrency: int


LOAD_KEYS = {"n": "num_prompts", "in": "input_len", "out": "output_len", "rate": "rate"}
LOAD_KEYS["concurrency"] = "concurrency"


def parse_load(text: str, defaults: Load) -> Load:
    """``NAME:key=value,...`` (keys ``n``, ``in``, ``out``, ``rate``, ``concurrency``; the others
    from ``defaults``).

    Raises:
        ValueError: no name, an unknown key, or a value out of range.
    """
    name, _, spec = text.partition(":")
    if not name:
        raise ValueError(f"--load {text!r}: give NAME:key=value,...")
    items = [item for item in spec.split(",") if item]
    if any("=" not in item for item in items):
        raise ValueError(f"--load {text!r}: give NAME:key=value,...")
    values = dict(item.split("=", 1) for item in items)
    unknown = sorted(set(values) - set(LOAD_KEYS))
    if unknown:
        raise ValueError(f"--load {text!r}: unknown keys {unknown}; known: {sorted(LOAD_KEYS)}")
    fields = {LOAD_KEYS[key]: value for key, value in values.items()}
    load = dataclasses.replace(
        defaults,
        name=name,
        **{k: float(v) if k == "rate" else int(v) for k, v in fields.items()},
    )
    if min(load.num_prompts, load.input_len, load.output_len, load.concurrency) < 1:
        raise ValueError(f"--load {text!r}: n, in, out and concurrency must be at least 1")
    if load.rate < 0:
        raise ValueError(f"--load {text!r}: rate must be >= 0")
    return load


def trace_variant(engine_args, args, variant: str, loads: list[Load]) -> dict:
    """Every load on one core process of ``variant``: ``{load name: result}``."""
    cores = SIMULATED_CORES if args.simulated_device else CORES
    session = CoreSession(engine_args, cores[variant])
    results = {}
    try:
        vocab = session.info["vocab_size"]
        rng = np.random.default_rng(args.seed + 1)
        for load in loads:
            prompts = [
                rng.integers(10, vocab - 10, load.input_len).tolist()
                for _ in range(load.num_prompts + args.warmup_prompts)
            ]
            shape = (load.output_len, load.rate, load.concurrency)
            # The same shapes once untraced (other prompts: no prefix-cache hits later), so that
            # every step shape is compiled before the timed run.
            warm, prompts = prompts[: args.warmup_prompts], prompts[args.warmup_prompts :]
            run_load(session, warm, *shape, args.seed + 2, f"{variant}-{load.name}-warmup")
            session.utility("clear_request_trace")
            client = run_load(session, prompts, *shape, args.seed, f"{variant}-{load.name}")
            trace = session.utility("request_trace")
            results[load.name] = {
                "load": dataclasses.asdict(load),
                "client": client,
                "summary": summarize(trace),
                "lives": request_lives(trace),
                "trace": trace,
            }
    finally:
        session.close()
    return results


def report(variant: str, load: str, result: dict) -> str:
    client, summary = result["client"], result["summary"]
    dev = summary["device_step_ms"]
    lines = [
        f"== {variant} {load}: {summary['num_requests']} requests, "
        f"{client['output_tok_per_s']:.0f} output tok/s, "
        f"client TTFT mean/p50/p99 {_fmt(client['ttft_ms'])} ms, "
        f"TPOT mean/p50/p99 {_fmt(client['tpot_ms'])} ms",
        f"lag (scheduled step - step running at arrival): {summary['lags']}",
        f"device step ms p50/p99 {summary['device_step_ms']['p50']:.2f}/"
        f"{summary['device_step_ms']['p99']:.2f} "
        f"({summary['device_step_ms']['num_exact']} measured), "
        f"device idle {100 * summary['device_idle_fraction']:.1f}%",
        f"device step ms p50/p99/n: decode-only {_triple(dev['decode_only_p50/p99/n'])}, "
        f"with prefill {_triple(dev['with_prefill_p50/p99/n'])}; prefill tokens per prefill "
        f"step p50/p99/max {_triple(summary['prefill_tokens_per_prefill_step_p50/p99/max'])} "
        f"({summary['steps_with_prefill']} of {summary['num_device_steps']} steps)",
        f"{'segment ms':18} {'mean':>8} {'p50':>8} {'p90':>8} {'p99':>8}",
    ]
    for name, values in summary["segments"].items():
        lines.append(
            f"{name:18} {values['mean']:8.2f} {values['p50']:8.2f} {values['p90']:8.2f} "
            f"{values['p99']:8.2f}"
        )
    lines.append("slowest requests (core_ttft):")
    lines.append(format_lives(result["lives"], limit=8))
    return "\n".join(lines)


def _triple(values: list) -> str:
    return "/".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in values)


def _fmt(stats: dict) -> str:
    if not stats:
        return "-"
    return f"{stats['mean']:.2f}/{stats['p50']:.2f}/{stats['p99']:.2f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=400)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--request-rate", type=float, default=20.0, help="requests/s (Poisson); 0: use "
        "--max-concurrency closed-loop clients"
    )  # fmt: skip
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument(
        "--load",
        action="append",
        default=[],
        help="NAME:key=value,... (n, in, out, rate, concurrency); repeatable, each traced on "
        "the same core process; none: one load from the flags above",
    )
    parser.add_argument("--warmup-prompts", type=int, default=32, help="untraced, first")
    parser.add_argument("--compare", action="store_true", help="also run without late scheduling")
    parser.add_argument(
        "--simulated-device",
        action="store_true",
        help="CPU demonstration: every step takes 50 ms on a simulated device "
        "(tests/engine_core/slow_device.py; run from the repository root)",
    )
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    if min(args.num_prompts, args.input_len, args.output_len) < 1 or args.warmup_prompts < 0:
        parser.error(
            "--num-prompts, --input-len and --output-len must be at least 1, "
            "--warmup-prompts at least 0"
        )
    if args.request_rate < 0 or args.max_concurrency < 1:
        parser.error("--request-rate must be >= 0 and --max-concurrency >= 1")
    flat = Load(
        "load",
        args.num_prompts,
        args.input_len,
        args.output_len,
        args.request_rate,
        args.max_concurrency,
    )
    try:
        loads = [parse_load(text, flat) for text in args.load] or [flat]
    except ValueError as error:
        parser.error(str(error))
    if len({load.name for load in loads}) < len(loads):
        parser.error("--load names must differ")
    engine_args = engine_args_from(args)
    set_jax_memory_fraction(engine_args.gpu_memory_utilization)  # inherited by the core
    results = {}
    for variant in ("late", "eager") if args.compare else ("late",):
        results[variant] = trace_variant(engine_args, args, variant, loads)
        for name, result in results[variant].items():
            print(report(variant, name, result), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
