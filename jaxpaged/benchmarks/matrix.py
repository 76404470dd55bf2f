"""Every option value that selects a kernel or code path, each on a small engine, in one process.

``jaxpaged bench matrix``: for each declared row (``matrix_rows.ROWS``) the matrix builds a
small engine (2 layers of the real config's shapes with dummy weights, or stories260k), runs a
few steps on the device (four prompts of 7 to 60 tokens, one of them arriving two steps late
and sharing a 32-token prefix with another, so steps mix chunked prefill, cached-prefix prefill
and decodes; 8 new tokens each, greedy with top-5 logprobs unless the row's workload says
otherwise), runs the same requests a second time (the timed pass; the prefix cache reset
first), and compares them with the row's reference (``matrix_rows`` module docstring).

A row matches when (1) the engine and its reference hold the same weights (checksum), (2) the
two passes give the same tokens, (3) the outputs agree with the reference's within the
tolerance of the row's dtype (``matrix_rows.TOLERANCE``; the rule: ``matrix_compare``), and (4)
a row with a ``preemption_mode`` did preempt. ``golden`` rows compare tokens with HF
transformers' greedy tokens.

Each row is isolated: an exception is recorded (with the first line of its message) and the
walk goes on; engines are dropped and garbage-collected between rows. Output: a table on
stdout and, with ``--out``, a JSON file rewritten after every row (so a run cut short keeps
its rows). Timings: ``startup_s`` (engine construction, including the compile of every step
bucket when the engine compiles them up front, as on a GPU), ``compile_s`` (the engine's
start-up compile plus the first pass's extra time over the second: buckets compiled on first
use), ``step_ms`` (median wall time of one engine step in the second pass).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import importlib
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence

import numpy as np

from jaxpaged.benchmarks.matrix_compare import Completion, compare, same_checksum
from jaxpaged.benchmarks.matrix_rows import MODELS, ROWS, TOLERANCE, MatrixRow, ModelSpec

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS_DIR = ROOT / "benchmarks" / "configs"
GOLDEN_PATH = ROOT / "tests" / "data" / "stories260k" / "golden.json"
NUM_LAYERS = 2
MAX_TOKENS = 8
TOP_LOGPROBS = 5
# Small engines: few step buckets (sequences 1-8, tokens 16-64) so few programs compile; 4
# prompts x n=2 fit in 8 sequences, and a 64-token budget chunks the longer prefills.
COMMON_ENGINE_ARGS = dict(
    max_model_len=128,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    block_size=16,
    num_gpu_blocks_override=160,
    swap_space=0.25,
    seed=0,
    disable_log_stats=True,
)
# The plain-JAX path every "reference" row is compared with. Options that change the schedule
# or the cache layout but not the results (block size, cache size, preemption, prefix caching,
# async, eager) take one setting, so rows that differ only in them share one reference run;
# buckets compile on first use (only the few the requests need).
REFERENCE_OVERRIDES = dict(
    attention_backend="reference",
    linear_backend="xla",
    async_scheduling=False,
    enforce_eager=True,
    block_size=COMMON_ENGINE_ARGS["block_size"],
    num_gpu_blocks_override=COMMON_ENGINE_ARGS["num_gpu_blocks_override"],
    preemption_mode=None,
    enable_prefix_caching=True,
)
STRUCTURED_CHOICES = ("yes", "no", "maybe")
# ``--shrink``: tiny shapes (keys replaced where a config has them) for a CPU smoke test of the
# harness itself; the 4-bit group size 128 still divides 256 and 512.
SHRINK = dict(hidden_size=256, n_embd=256, intermediate_size=512, num_attention_heads=4, n_head=4,
              num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64, vocab_size=512,
              num_local_experts=4)  # fmt: skip


@dataclasses.dataclass
class RunResult:
    """Both passes of one engine over a row's requests."""

    completions: list[list[Completion]]  # per request, per completion
    repeat_equal: bool  # the second pass gave the same tokens
    step_seconds: list[float]  # the second pass's engine steps
    first_pass_s: float
    second_pass_s: float
    checksum: tuple[float, int] | None
    preemptions: int = 0  # both passes


# ---------------------------------------------------------------------------------- models
def model_directory(name: str, workdir: str, *, shrink: bool = False) -> tuple[str, dict]:
    """``(directory, config.json contents)`` of :data:`MODELS` ``[name]``: stories260k's own
    directory, or a new directory under ``workdir`` holding the benchmark config with
    :data:`NUM_LAYERS` layers, the spec's overrides and its quantization_config (``shrink``:
    and the :data:`SHRINK` shapes).

    Raises:
        FileNotFoundError: ``benchmarks/configs`` is missing (run from a checkout).
    """
    from jaxpaged.config import default_model_path

    spec: ModelSpec = MODELS[name]
    if spec.config is None:
        path = default_model_path()
        return path, json.loads((pathlib.Path(path) / "config.json").read_text())
    source = CONFIGS_DIR / spec.config / "config.json"
    config = json.loads(source.read_text())
    layers_key = "n_layer" if "n_layer" in config else "num_hidden_layers"
    config[layers_key] = NUM_LAYERS
    config.update(spec.overrides)
    if shrink:
        config.update({k: v for k, v in SHRINK.items() if k in config})
    if spec.quantization_config is not None:
        config["quantization_config"] = dict(spec.quantization_config)
    directory = pathlib.Path(workdir) / name
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return str(directory), config


def engine_args(row: MatrixRow, model_dir: str, *, reference: bool, cache_dir: str | None) -> dict:
    """The ``EngineArgs`` fields of ``row``'s engine (``reference``: of its reference)."""
    args = dict(COMMON_ENGINE_ARGS, model=model_dir)
    if MODELS[row.model].config is not None:
        args.update(load_format="dummy", skip_tokenizer_init=True)
    else:
        args.update(skip_tokenizer_init=row.workload != "structured_outputs")
    args.update(row.engine)
    if reference:
        args.update(REFERENCE_OVERRIDES)
    if cache_dir is None:
        args.update(enable_compilation_cache=False)
    else:
        args.update(enable_compilation_cache=True, compilation_cache_dir=cache_dir)
    return args


# ------------------------------------------------------------------------------- requests
def prompts(vocab_size: int, *, golden: dict | None = None) -> tuple[list[list[int]], int]:
    """``(prompt token ids, index of the late prompt)``: golden.json's four non-empty prompts
    (late: none, -1), else four prompts of 45, 7, 60 and 41 ids drawn from ``[3, vocab)``
    with a fixed seed, the last sharing its first 32 ids (two blocks) with the first and
    arriving after two steps, so it hits the prefix cache in a step that also decodes."""
    if golden is not None:
        return [case["prompt_ids"] for case in golden["cases"] if case["prompt"]][:4], -1
    rng = np.random.default_rng(0)
    high = min(vocab_size, 32000)

    def draw(n):
        return rng.integers(3, high, n).tolist()

    first = draw(45)
    return [first, draw(7), draw(60), first[:32] + draw(9)], 3


def request_params(row: MatrixRow, index: int):
    """The sampling (or beam search) parameters of request ``index`` of ``row``."""
    from jaxpaged.beam_search import BeamSearchParams
    from jaxpaged.sampling_params import SamplingParams

    if row.workload == "beam":
        return BeamSearchParams(beam_width=2, max_tokens=MAX_TOKENS, ignore_eos=True)
    common = dict(max_tokens=MAX_TOKENS, logprobs=TOP_LOGPROBS, ignore_eos=True)
    if row.workload == "sample_n2":
        return SamplingParams(n=2, temperature=0.8, top_k=TOP_LOGPROBS, seed=100 + index, **common)
    if row.workload == "structured_outputs":
        structured = structured_outputs_params()
        return SamplingParams(
            temperature=0.0, structured_outputs=structured(choice=list(STRUCTURED_CHOICES)),
            **common,
        )  # fmt: skip
    return SamplingParams(temperature=0.0, **common)


def structured_outputs_params():
    """vLLM's ``StructuredOutputsParams`` class, or None where jaxpaged has none yet."""
    module = importlib.import_module("jaxpaged.sampling_params")
    return getattr(module, "StructuredOutputsParams", None)


def lora_requests(row: MatrixRow, engine, workdir: str, count: int) -> list:
    """Per request, its LoRA adapter (two random rank-8 adapters on every projection, written
    once per model under ``workdir``; the last request runs the base model); Nones without
    LoRA."""
    if row.workload != "lora":
        return [None] * count
    from jaxpaged.lora.dummy import write_random_peft_adapter
    from jaxpaged.lora.peft import TARGET_MODULES
    from jaxpaged.lora.request import LoRARequest
    from models.lora import llama_projection_specs

    config = engine.worker.hf_config
    specs = llama_projection_specs(config)
    modules = set(_lora_modules(specs))  # a MoE model's experts take no LoRA
    targets = [m for m in TARGET_MODULES if m in modules]
    adapters = []
    for i in (1, 2):
        path = os.path.join(workdir, f"{row.model}-adapter{i}")
        if not os.path.isdir(path):
            write_random_peft_adapter(
                path, specs=specs, num_layers=NUM_LAYERS, rank=8, lora_alpha=16.0,
                target_modules=targets, seed=i,
            )  # fmt: skip
        adapters.append(LoRARequest(f"adapter{i}", i, path))
    return [adapters[i % 2] if i < count - 1 else None for i in range(count)]


def _lora_modules(specs) -> list[str]:
    from models.lora import LORA_PROJECTIONS

    return [module for name in specs for module in LORA_PROJECTIONS[name]]


def run_requests(engine, row, prompt_ids, late, loras, tag) -> tuple[list, list[float]]:
    """Queue the prompts (the ``late`` one after two steps), step to the end; returns the
    completions per request and each step's wall time."""

    def add(i):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt_ids[i]},
                           request_params(row, i), final_only=True, lora_request=loras[i])  # fmt: skip

    for i in range(len(prompt_ids)):
        if i != late:
            add(i)
    finished, step_seconds = {}, []
    while len(finished) < len(prompt_ids):
        if len(step_seconds) == 2 and late >= 0:
            add(late)
        start = time.perf_counter()
        outputs = engine.step()
        step_seconds.append(time.perf_counter() - start)
        for output in outputs:
            if output.finished:
                finished[output.request_id] = output
        if len(step_seconds) > 10_000:
            raise RuntimeError("the requests did not finish within 10000 steps")
    ordered = [finished[f"{tag}-{i}"] for i in range(len(prompt_ids))]
    return [[_completion(c) for c in output.outputs] for output in ordered], step_seconds


def _completion(output) -> Completion:
    logprobs = None
    if output.logprobs is not None:
        logprobs = [  # beam search's are plain floats (its candidates' logprobs)
            {t: getattr(lp, "logprob", lp) for t, lp in position.items()}
            for position in output.logprobs
        ]
    return Completion(list(output.token_ids), logprobs, output.cumulative_logprob)


def run_engine(row: MatrixRow, args: dict, workdir: str, golden: dict | None) -> tuple:
    """Build the engine of ``args``, run ``row``'s requests twice; returns
    ``(RunResult, startup seconds, engine compile seconds)``. The engine is dropped on return."""
    from jaxpaged.entrypoints.llm import LLM

    start = time.perf_counter()
    llm = LLM(**args)
    engine = llm.llm_engine
    engine.wait_for_executables()
    startup = time.perf_counter() - start
    # Before any adapter is loaded (the LoRA fold layout writes adapters into base columns).
    checksum = engine.worker.weights_checksum()
    try:
        prompt_ids, late = prompts(engine.vocab_size, golden=golden)
        loras = lora_requests(row, engine, workdir, len(prompt_ids))
        t0 = time.perf_counter()
        first, _ = run_requests(engine, row, prompt_ids, late, loras, "first")
        t1 = time.perf_counter()
        llm.reset_prefix_cache()
        second, steps = run_requests(engine, row, prompt_ids, late, loras, "second")
        t2 = time.perf_counter()
        same = [[c.tokens for c in r] for r in first] == [[c.tokens for c in r] for r in second]
        preemptions = engine.get_stats().num_preemptions
        result = RunResult(first, same, steps, t1 - t0, t2 - t1, checksum, preemptions)
        return result, startup, engine.worker.compile_seconds
    finally:
        del engine, llm
        gc.collect()


def golden_completions(golden: dict) -> list[list[Completion]]:
    cases = [case for case in golden["cases"] if case["prompt"]][:4]
    return [[Completion(case["greedy_new_ids"][:MAX_TOKENS], None, None)] for case in cases]


# ---------------------------------------------------------------------------------- rows
@contextlib.contextmanager
def patched(patches: dict) -> Iterator[None]:
    """Set ``"module:NAME": value`` constants for the block; restored after it."""
    saved = []
    try:
        for target, value in patches.items():
            module_name, attr = target.split(":")
            module = importlib.import_module(module_name)
            saved.append((module, attr, getattr(module, attr)))
            setattr(module, attr, value)
        yield
    finally:
        for module, attr, value in reversed(saved):
            setattr(module, attr, value)


class Matrix:
    """Walks rows, caching each reference's run (rows share references)."""

    def __init__(self, workdir: str, cache_dir: str | None, *, shrink: bool = False):
        self.workdir = workdir
        self.cache_dir = cache_dir
        self.shrink = shrink
        self._references: dict[str, RunResult | Exception] = {}
        self._golden: dict | None = None

    def golden(self) -> dict:
        if self._golden is None:
            self._golden = json.loads(GOLDEN_PATH.read_text())
        return self._golden

    def run_row(self, row: MatrixRow) -> dict:
        """One row's record: ``compiled`` ("ok", "error" or "skipped"), ``matches`` (bool or
        None), ``max_abs_dlogprob``, ``tolerance``, timings, ``note`` (the first line of an
        error, a skip reason or the comparison's note)."""
        record = dict(name=row.name, model=row.model, engine=dict(row.engine),
                      workload=row.workload, reference=row.reference, patches=dict(row.patches),
                      compiled=None, matches=None, max_abs_dlogprob=None, tolerance=None,
                      startup_s=None, compile_s=None, step_ms=None, preemptions=None,
                      note="")  # fmt: skip
        if row.workload == "structured_outputs" and structured_outputs_params() is None:
            record.update(compiled="skipped", note="not built yet (no StructuredOutputsParams)")
            return record
        golden = self.golden() if row.reference == "golden" else None
        try:
            model_dir, _ = model_directory(row.model, self.workdir, shrink=self.shrink)
            args = engine_args(row, model_dir, reference=False, cache_dir=self.cache_dir)
            with patched(row.patches):
                result, startup, compile_s = run_engine(row, args, self.workdir, golden)
        except Exception as error:  # noqa: BLE001 - one row's failure is its record
            record.update(compiled="error", note=_first_line(error))
            return record
        record.update(
            compiled="ok",
            startup_s=round(startup, 2),
            compile_s=round(compile_s + max(0.0, result.first_pass_s - result.second_pass_s), 2),
            step_ms=round(1000 * statistics.median(result.step_seconds), 2),
            preemptions=int(result.preemptions),
        )
        dtype = self._dtype(row, model_dir)
        tolerance = row.tolerance if row.tolerance is not None else TOLERANCE[dtype]
        record["tolerance"] = tolerance
        try:
            reference = self._reference(row, model_dir, golden)
        except Exception as error:  # noqa: BLE001
            record.update(note="reference failed: " + _first_line(error))
            return record
        matches, worst, note = compare(
            result.completions, reference.completions, tolerance, beam=row.workload == "beam"
        )
        if not result.repeat_equal:
            matches, note = False, "the second pass gave other tokens than the first; " + note
        if reference.checksum is not None and not same_checksum(
            result.checksum, reference.checksum
        ):
            matches, note = (
                False,
                f"weights differ from the reference's: {result.checksum} vs {reference.checksum}",
            )
        if "preemption_mode" in row.engine and not result.preemptions:
            matches, note = False, "no request was preempted: the row tests nothing; " + note
        if math.isinf(worst) or golden is not None:  # golden.json holds tokens only
            worst = None
        record.update(
            matches=bool(matches),
            max_abs_dlogprob=None if worst is None else float(worst),  # not a numpy scalar
            note=note,
        )
        return record

    def _reference(self, row: MatrixRow, model_dir: str, golden: dict | None) -> RunResult:
        if golden is not None:
            return RunResult(golden_completions(golden), True, [], 0.0, 0.0, None)
        args = engine_args(row, model_dir, reference=True, cache_dir=self.cache_dir)
        key = json.dumps([row.model, row.workload, args], sort_keys=True, default=str)
        if key not in self._references:
            try:
                self._references[key] = run_engine(row, args, self.workdir, None)[0]
            except Exception as error:  # noqa: BLE001 - remembered: rows sharing it skip it
                # Its message only: a traceback would keep the failed engine (and its device
                # memory) alive for the rest of the walk.
                self._references[key] = RuntimeError(_first_line(error))
        cached = self._references[key]
        if isinstance(cached, Exception):
            raise cached
        return cached

    @staticmethod
    def _dtype(row: MatrixRow, model_dir: str) -> str:
        from models.dtypes import DTYPES

        dtype = row.engine.get("dtype", "auto")
        if dtype == "auto":
            config = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
            dtype = config.get("torch_dtype") or config.get("dtype") or "float32"
        return DTYPES.get(dtype, "float32")


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


# ----------------------------------------------------------------------------------- output
COLUMNS = ("name", "compiled", "matches", "max_abs_dlogprob", "tolerance", "startup_s",
           "compile_s", "step_ms", "note")  # fmt: skip


def format_row(record: dict) -> str:
    def cell(key):
        value = record.get(key)
        if value is None:
            return "-"
        if isinstance(value, bool):
            return "yes" if value else "NO"
        if isinstance(value, float):
            return f"{value:.3g}"
        return str(value)

    widths = (30, 8, 7, 9, 6, 8, 9, 8, 0)
    return " ".join(
        f"{cell(k):<{w}}" if w else cell(k) for k, w in zip(COLUMNS, widths, strict=True)
    )


def header() -> str:
    return format_row({k: k for k in COLUMNS}).replace("max_abs_dlogprob", "max|dlp|")


def environment() -> dict:
    """Commit, date, device and versions for the JSON file."""
    import jax

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                                capture_output=True, timeout=10).stdout.strip() or None  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        commit = None
    device = jax.devices()[0]
    return dict(commit=commit, date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                platform=device.platform, device=device.device_kind, jax=jax.__version__,
                num_layers=NUM_LAYERS, max_tokens=MAX_TOKENS, engine=COMMON_ENGINE_ARGS)  # fmt: skip


def select(rows: Sequence[MatrixRow], only: Sequence[str] | None) -> list[MatrixRow]:
    """The rows whose name contains one of ``only`` (all if empty).

    Raises:
        ValueError: no row matches.
    """
    if not only:
        return list(rows)
    chosen = [row for row in rows if any(part in row.name for part in only)]
    if not chosen:
        raise ValueError(f"--only {list(only)} matches no row; --list shows them")
    return chosen


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", default=None, metavar="SUBSTRING",
                        help="run only the rows whose name contains one of these")  # fmt: skip
    parser.add_argument("--rows", nargs="+", default=None, metavar="NAME",
                        help="run only these rows (exact names)")  # fmt: skip
    parser.add_argument("--list", action="store_true", help="print the rows and exit")
    parser.add_argument(
        "--workers", type=int, default=1,
        help="split the rows over this many processes sharing the device (compiles overlap; "
        "jaxpaged/benchmarks/matrix_shards.py); needs --out",
    )  # fmt: skip
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=None,
        help="the rows' gpu_memory_utilization (default: the engine's); --workers sets it",
    )  # fmt: skip
    parser.add_argument("--out", default=None, help="write the results as JSON to this path")
    parser.add_argument(
        "--compilation-cache-dir", default=None,
        help="share this persistent compilation cache among the rows' engines (identical "
        "programs compile once; a re-run compiles nothing); default: no cache",
    )  # fmt: skip
    parser.add_argument(
        "--resume", action="store_true",
        help="keep the rows already in --out (a run that was cut short) and run only the others",
    )  # fmt: skip
    parser.add_argument("--no-tqdm", action="store_true", help="no progress bar")
    parser.add_argument(
        "--shrink", action="store_true",
        help="tiny shapes instead of the real configs' (a CPU smoke test of the harness; "
        "says nothing about the real shapes)",
    )  # fmt: skip
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        rows = select(ROWS, args.only)
        if args.rows is not None:
            unknown = set(args.rows) - {row.name for row in ROWS}
            if unknown:
                raise ValueError(f"--rows names no row: {sorted(unknown)}; --list shows them")
            rows = [row for row in rows if row.name in args.rows]
        if args.workers > 1 and (not args.out or args.resume):
            raise ValueError("--workers needs --out and takes no --resume")
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.gpu_memory_utilization is not None:
        COMMON_ENGINE_ARGS["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.list:
        for row in rows:
            print(
                f"{row.name:<30} {row.model:<28} {row.workload:<18} {json.dumps(dict(row.engine))}"
            )
        return 0
    if args.workers > 1:
        from jaxpaged.benchmarks.matrix_shards import run_sharded

        passthrough = ["--shrink"] if args.shrink else []
        if args.compilation_cache_dir:
            passthrough += ["--compilation-cache-dir", args.compilation_cache_dir]
        report = run_sharded(rows, args.workers, args.out, passthrough)
        return _print_report(report)
    import jax
    from tqdm.auto import tqdm

    report = dict(environment(), shrink=args.shrink, rows=[])
    if args.resume:  # keep the rows a cut-short run wrote; run the others
        if not args.out or not os.path.isfile(args.out):
            print("error: --resume needs an existing --out file", file=sys.stderr)
            return 2
        report["rows"] = json.loads(pathlib.Path(args.out).read_text())["rows"]
        done = {record["name"] for record in report["rows"]}
        rows = [row for row in rows if row.name not in done]
    with tempfile.TemporaryDirectory(prefix="jaxpaged-matrix-") as workdir:
        matrix = Matrix(workdir, args.compilation_cache_dir, shrink=args.shrink)
        bar = tqdm(rows, desc="matrix", unit="row", disable=args.no_tqdm, file=sys.stderr)
        start = time.perf_counter()
        for row in bar:
            bar.set_postfix_str(row.name)
            row_start = time.perf_counter()
            record = matrix.run_row(row)
            gc.collect()
            jax.clear_caches()  # the row's jitted helpers; its engines are gone already
            record["row_s"] = round(time.perf_counter() - row_start, 2)
            report["rows"].append(record)
            tqdm.write(format_row(record), file=sys.stderr)
            if args.out:
                report["total_s"] = round(time.perf_counter() - start, 2)
                pathlib.Path(args.out).write_text(json.dumps(report, indent=1, default=float))
        report["total_s"] = round(time.perf_counter() - start, 2)
    return _print_report(report)


def _print_report(report: dict) -> int:
    """The table and the summary line; 1 when a row failed to compile or to match."""
    print(header())
    for record in report["rows"]:
        print(format_row(record))
    bad = [r["name"] for r in report["rows"] if r["compiled"] == "error" or r["matches"] is False]
    print(f"{len(report['rows'])} rows in {report.get('total_s', 0):.0f} s on "
          f"{report.get('device')} at {report.get('commit')}; failing: {', '.join(bad) or 'none'}")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
