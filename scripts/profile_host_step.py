"""Per-phase host cost of ``LLMEngine.step()`` at a large decode batch.

Builds the engine on the embedded stories260k model (token-id prompts, no tokenizer), queues
``--num-seqs`` requests, steps until every one of them is decoding, then times
``--steps`` decode steps phase by phase and prints microseconds per step:

    schedule   Scheduler.schedule
    prepare    ModelRunner._assign_logits_state_slots + _prepare_inputs (the packed buffer)
    device     the rest of execute_model: transfer, jitted step, np.asarray read-back
    commit     Scheduler.update_from_output
    outputs    OutputProcessor.process

The phases are timed by wrapping those methods on the live engine, so ``step()`` itself runs
unchanged. ``--cprofile N`` then profiles N more steps and prints the top functions. The model
is tiny, so ``device`` is mostly dispatch; the host phases are what this script is for. Run::

    PYTHONPATH=. python scripts/profile_host_step.py --num-seqs 256 --steps 30 --cprofile 10
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
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402

PHASES = ("schedule", "prepare", "device", "commit", "outputs")


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
    timer.wrap(runner, "_assign_logits_state_slots", "prepare")
    timer.wrap(runner, "_prepare_inputs", "prepare")
    # execute_model includes prepare; "device" is reported as execute_model minus prepare.
    timer.wrap(runner, "execute_model", "execute_model")
    timer.wrap(engine.scheduler, "update_from_output", "commit")
    timer.wrap(engine.output_processor, "process", "outputs")
    return timer


def all_decoding(engine: LLMEngine, num_seqs: int) -> bool:
    seqs = engine.scheduler.running_seqs()
    return len(seqs) == num_seqs and not any(seq.is_prefill for seq in seqs)


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
    engine.wait_for_executables()  # a warm start loads buckets in the background
    rng = np.random.default_rng(args.seed)
    params = SamplingParams(
        temperature=1.0,
        max_tokens=args.prompt_len + args.warmup + args.steps + args.cprofile + 64,
        ignore_eos=True,
        output_kind=RequestOutputKind[args.output_kind.upper()],
    )
    for i in range(args.num_seqs):
        prompt = rng.integers(3, engine.vocab_size, size=args.prompt_len).tolist()
        engine.add_request(f"req-{i}", {"prompt_token_ids": prompt}, params)
    num_prefill_steps = 0
    while not all_decoding(engine, args.num_seqs):
        engine.step()
        num_prefill_steps += 1
    for _ in range(args.warmup):
        engine.step()

    timer = instrument(engine)
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    total = time.perf_counter() - start
    per_step = {phase: 1e6 * s / args.steps for phase, s in timer.seconds.items()}
    per_step["device"] = per_step.pop("execute_model") - per_step["prepare"]
    per_step["step (total)"] = 1e6 * total / args.steps
    print(
        f"{args.num_seqs} sequences decoding, prompt {args.prompt_len} tokens "
        f"({num_prefill_steps} prefill steps), {args.steps} timed steps, "
        f"output_kind={args.output_kind}"
    )
    print(f"{'phase':<14}{'us/step':>10}")
    for phase in (*PHASES, "step (total)"):
        print(f"{phase:<14}{per_step[phase]:>10.0f}")
    host = sum(per_step[p] for p in PHASES if p != "device")
    print(f"{'host phases':<14}{host:>10.0f}")

    if args.cprofile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.cprofile):
            engine.step()
        profiler.disable()
        stats = pstats.Stats(profiler).strip_dirs()
        print(f"\ncProfile over {args.cprofile} steps, by own time:")
        stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
