"""Per-phase host cost of ``LLMEngine.step()`` at a large decode batch.

Builds the engine on the embedded stories260k model (token-id prompts, no tokenizer), queues
``--num-seqs`` requests, steps until every one of them is decoding, then times
``--steps`` decode steps phase by phase and prints microseconds per step:

    schedule   Scheduler.schedule
    prepare    ModelRunner.prepare (bucket key, LogitsState slots, the packed buffer)
    device     ModelRunner.launch + collect: transfer, jitted step, np.asarray read-back
    commit     Scheduler.update_from_output
    outputs    OutputProcessor.process

With ``--core-clients C`` the engine is stepped as the served engine core steps it
(``jaxpaged.engine_core.core.EngineCore``, in-process, no sockets): requests are added as an API
process adds them (``core_messages`` wire params, DELTA, spread over ``C`` clients), and each
step is ``core.step()``, ``core.route()`` and one ``core_messages.encode`` per client message.
Three more phases are then timed:

    core step  EngineCore.step minus LLMEngine.step (stats, scheduled ids, the wire deltas)
    route      EngineCore.route
    encode     core_messages.encode of every client's message (msgpack)

With ``--add-only N`` nothing is stepped: the script times ``EngineCore.add_request`` (the
served core's admission, during which it does not step) for N requests of ``--prompt-len``
token ids with the wire params a completions request of ``benchmark_serving`` sends
(``params_to_wire`` of temperature 0, ``max_tokens``, ``ignore_eos``), as the core receives
them (after msgpack). It prints the median microseconds per add over ``--repeats`` rounds
(every round aborts its requests, untimed, so each starts from an empty queue);
``--cprofile 1`` then profiles one more round and prints the top functions by cumulative
time. Measured (stories260k, a busy 2-core CPU machine, 1000 adds of 128 tokens, 11
rounds, six paired runs): 82-125 us/add before the admission path was trimmed, 42-69 after
(about half in every pair). The trim: one ``SamplingParams`` built instead of two
(``dataclasses.replace`` validated again), no ``int()`` copy of ids that are ints, and the
id-type check in one C-level pass; what is left is about 6 us of ``params_from_wire``,
13 us of prompt-id checks and 25 us of ``LLMEngine.add_request`` proper (sequence, group,
scheduler and output-processor entries). Rounds with a garbage collection run 2-4x slower.

The phases are timed by wrapping those methods on the live engine, so ``step()`` itself runs
unchanged. ``--cprofile N`` then profiles N more steps and prints the top functions. The model
is tiny, so ``device`` is mostly dispatch; the host phases are what this script is for (also
printed per request-step); each is the median over the timed steps. Run::

    PYTHONPATH=. python scripts/profile_host_step.py --num-seqs 256 --steps 30 --cprofile 10
    PYTHONPATH=. python scripts/profile_host_step.py --num-seqs 256 --core-clients 4
    PYTHONPATH=. python scripts/profile_host_step.py --add-only 1000 --prompt-len 128
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pathlib
import pstats
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from jaxpaged.config import EngineArgs  # noqa: E402
from jaxpaged.engine.llm_engine import LLMEngine  # noqa: E402
from jaxpaged.engine_core.core import EngineCore, freeze_gc_heap  # noqa: E402
from jaxpaged.engine_core.core_messages import Kind, decode, encode, params_to_wire  # noqa: E402
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402

PHASES = ("schedule", "prepare", "device", "commit", "outputs")
CORE_PHASES = ("core step", "route", "encode")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=256, help="requests (= max_num_seqs)")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=30, help="timed decode steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed decode steps first")
    parser.add_argument("--cprofile", type=int, default=0, help="decode steps to cProfile after")
    parser.add_argument("--top", type=int, default=30, help="cProfile functions printed")
    parser.add_argument(
        "--output-kind",
        choices=[k.name.lower() for k in RequestOutputKind],
        default="final_only",
        help="RequestOutputKind of every request (final_only is LLM.generate's; delta a server's)",
    )
    parser.add_argument(
        "--core-clients",
        type=int,
        default=0,
        help="step as the served engine core with this many API clients (0: LLMEngine.step)",
    )
    parser.add_argument(
        "--add-only",
        type=int,
        default=0,
        metavar="N",
        help="time EngineCore.add_request of N requests instead of stepping",
    )
    parser.add_argument("--repeats", type=int, default=5, help="--add-only rounds (median)")
    parser.add_argument(
        "--no-gc-freeze",
        action="store_true",
        help="skip the served core's gc.freeze after start-up (core.freeze_gc_heap)",
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser


class PhaseTimer:
    """Accumulates seconds per phase by wrapping bound methods of the live engine."""

    def __init__(self):
        self.seconds: dict[str, float] = collections.defaultdict(float)

    def wrap(self, obj, method: str, phase: str) -> None:
        inner = getattr(obj, method)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start

        setattr(obj, method, timed)

    def reset(self) -> None:
        self.seconds.clear()


def instrument(engine: LLMEngine) -> PhaseTimer:
    timer = PhaseTimer()
    runner = engine.worker.model_runner
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(runner, "prepare", "prepare")
    timer.wrap(runner, "launch", "device")
    timer.wrap(runner, "collect", "device")
    timer.wrap(engine.scheduler, "update_from_output", "commit")
    timer.wrap(engine.output_processor, "process", "outputs")
    return timer


def all_decoding(engine: LLMEngine, num_seqs: int) -> bool:
    seqs = engine.scheduler.running_seqs()
    return len(seqs) == num_seqs and not any(seq.is_prefill for seq in seqs)


class ServedCore:
    """``EngineCore`` stepped as ``core._loop`` steps it, its extra phases timed."""

    def __init__(self, engine: LLMEngine, num_clients: int, timer: PhaseTimer | None = None):
        self.core = EngineCore(engine, num_clients=num_clients)
        self.timer = timer

    def step(self) -> None:
        timer = self.timer
        start = time.perf_counter()
        step = self.core.step()
        routed_at = time.perf_counter()
        routed = self.core.route(step)
        encoded_at = time.perf_counter()
        for _, message in routed:
            encode(Kind.OUTPUTS, message)
        if timer is not None:
            end = time.perf_counter()
            timer.seconds["core step"] += routed_at - start
            timer.seconds["route"] += encoded_at - routed_at
            timer.seconds["encode"] += end - encoded_at


def time_adds(engine: LLMEngine, args) -> None:
    """``--add-only``: microseconds per ``EngineCore.add_request``, then the optional cProfile."""
    core = EngineCore(engine)
    rng = np.random.default_rng(args.seed)
    wire = params_to_wire(SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True))
    # msgpack round trip: the core sees what decode() gives it (lists of ints, a plain dict).
    payloads = []
    for _ in range(args.add_only):
        ids = rng.integers(3, engine.vocab_size, size=args.prompt_len).tolist()
        payloads.append(decode(encode(Kind.ADD, [ids, wire]))[1])

    def add_round(tag: str) -> float:
        ids = [f"{tag}-{i}" for i in range(args.add_only)]
        start = time.perf_counter()
        for request_id, (prompt, params) in zip(ids, payloads, strict=True):
            error = core.add_request(request_id, prompt, params, time.monotonic())
            assert error is None, error
        seconds = time.perf_counter() - start
        core.abort_requests(ids)
        return seconds

    add_round("warmup")
    rounds = [add_round(f"r{r}") for r in range(args.repeats)]
    per_add = [1e6 * s / args.add_only for s in rounds]
    print(
        f"EngineCore.add_request: {args.add_only} requests of {args.prompt_len} tokens, "
        f"wire params {wire}"
    )
    print(
        f"us/add median {np.median(per_add):.1f} over {args.repeats} rounds "
        f"(min {min(per_add):.1f}, max {max(per_add):.1f})"
    )
    if args.cprofile:
        profiler = cProfile.Profile()
        profiler.enable()
        add_round("profiled")
        profiler.disable()
        stats = pstats.Stats(profiler).strip_dirs()
        print(f"\ncProfile over one round of {args.add_only} adds (and their aborts), cumulative:")
        stats.sort_stats("cumulative").print_stats(args.top)


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            dtype="float32",
            skip_tokenizer_init=True,
            max_model_len=512,
            max_num_seqs=args.num_seqs,
            seed=args.seed,
        ),
        show_progress=False,
    )
    if not args.no_gc_freeze:
        freeze_gc_heap()  # as the served core does once it is ready
    if args.add_only:
        time_adds(engine, args)
        return
    engine.wait_for_executables()  # a warm start loads buckets in the background
    rng = np.random.default_rng(args.seed)
    params = SamplingParams(
        temperature=1.0,
        max_tokens=args.prompt_len + args.warmup + args.steps + args.cprofile + 64,
        ignore_eos=True,
        output_kind=RequestOutputKind[args.output_kind.upper()],
    )
    served = ServedCore(engine, args.core_clients) if args.core_clients else None
    for i in range(args.num_seqs):
        prompt = rng.integers(3, engine.vocab_size, size=args.prompt_len).tolist()
        if served is None:
            engine.add_request(f"req-{i}", {"prompt_token_ids": prompt}, params)
        else:  # as an API process adds it: wire params, its client index
            wire = params_to_wire(params)
            error = served.core.add_request(
                f"req-{i}", prompt, wire, time.monotonic(), None, i % args.core_clients
            )
            assert error is None, error
    step = engine.step if served is None else served.step
    num_prefill_steps = 0
    while not all_decoding(engine, args.num_seqs):
        step()
        num_prefill_steps += 1
    for _ in range(args.warmup):
        step()

    timer = instrument(engine)
    if served is not None:
        served.timer = timer
        timer.wrap(engine, "step", "engine step")
    samples = collections.defaultdict(list)  # phase -> microseconds of each timed step
    for _ in range(args.steps):
        timer.reset()
        start = time.perf_counter()
        step()
        samples["step (total)"].append(1e6 * (time.perf_counter() - start))
        seconds = timer.seconds
        if served is not None:
            seconds["core step"] -= seconds.pop("engine step")
        for phase, value in seconds.items():
            samples[phase].append(1e6 * value)
    # Medians: a busy machine's stray slow steps do not move them.
    per_step = {phase: float(np.median(values)) for phase, values in samples.items()}
    phases = PHASES
    if served is not None:
        phases = PHASES + CORE_PHASES
    mode = f"served core, {args.core_clients} clients" if served else "LLMEngine.step"
    print(
        f"{args.num_seqs} sequences decoding, prompt {args.prompt_len} tokens "
        f"({num_prefill_steps} prefill steps), {args.steps} timed steps, "
        f"output_kind={'delta (core)' if served else args.output_kind}, {mode}"
    )
    print(f"{'phase':<14}{'us/step':>10}{'us/req-step':>13}")
    for phase in (*phases, "step (total)"):
        print(f"{phase:<14}{per_step[phase]:>10.0f}{per_step[phase] / args.num_seqs:>13.2f}")
    host = sum(per_step[p] for p in phases if p != "device")
    print(f"{'host phases':<14}{host:>10.0f}{host / args.num_seqs:>13.2f}")

    if args.cprofile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.cprofile):
            step()
        profiler.disable()
        stats = pstats.Stats(profiler).strip_dirs()
        print(f"\ncProfile over {args.cprofile} steps, by own time:")
        stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
