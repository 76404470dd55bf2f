"""The driver of ``benchmarks/gpu.sh``: its steps in priority order, each in its own process
group inside its time box and the call's deadline; what finished kept in one ``results.json``
(rewritten after every step, so a call cut short keeps its steps); one table at the end.

    python benchmarks/lib/gpu_run.py --steps "bf16:200 fp8:150 ... matrix:rest" \\
        --deadline-s 560 --started-at EPOCH --work DIR --out OUT [--resume OLD.json] [--smoke]

A step gets the smaller of its box and the time left before the deadline (less a reserve for
the table and the logs' archive); one that would get less than ``--min-step-s`` is
``deferred``, not run. ``--resume`` takes an earlier call's ``results.json``: its ``ok`` steps
measured on this same device are kept and not run again; the others run, those never run
before first; the matrix keeps the rows it has and runs the rest. Every step's log and own JSON
go to ``WORK`` and, at the end, into ``OUT/logs.tar.gz``; ``OUT`` gets ``results.json`` and
``table.txt`` too (three files: the GPU tool returns at most eight).

Steps (``--smoke``: the same scripts on CPU, tiny configs and counts):

- ``bf16``, ``fp8``, ``int8``, ``awq``, ``gptq``: ``benchmarks/e2e_suite.py``, Llama-3-8B
  shape with dummy weights, max_num_seqs 512, async scheduling: 1000 x 128/128 output tok/s,
  batch-1 TPOT of 128/128, start-up and process start to first token. FP8 is online FP8 with an
  FP8 KV cache; INT8, AWQ and GPTQ are their checkpoints' configs with ``linear_backend auto``.
- ``structured``: ``benchmarks/structured_outputs.py`` on the bf16 engine's flags (its
  buckets load from the compilation cache the bf16 step filled).
- ``weight_sync``: ``benchmarks/weight_sync.py``.
- ``server``: ``benchmarks/server.sh`` (4 API processes; the request-life trace off).
- ``matrix``: ``jaxpaged bench matrix --workers 4``, resumable row by row.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import signal
import subprocess
import sys
import tarfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from jaxpaged.benchmarks.figures import ENGINE_STEPS, gpu_step_figures  # noqa: E402

SCHEMA = "jaxpaged-gpu-results/1"
ENGINE_MODELS = {  # step -> (config under benchmarks/configs or the smoke dir, extra flags)
    "bf16": ("llama-3-8b", []),
    "fp8": ("llama-3-8b", ["--quantization", "fp8", "--kv-cache-dtype", "fp8"]),
    "int8": ("llama-3-8b-w8a8-int8", ["--linear-backend", "auto"]),
    "awq": ("llama-3-8b-awq", ["--linear-backend", "auto"]),
    "gptq": ("llama-3-8b-gptq", ["--linear-backend", "auto"]),
}
GPU_ENGINE = ["--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "bfloat16",
              "--max-model-len", "2048", "--max-num-seqs", "512",
              "--max-num-batched-tokens", "4096", "--gpu-memory-utilization", "0.9",
              "--async-scheduling"]  # fmt: skip
SMOKE_ENGINE = ["--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "float32",
                "--max-model-len", "128", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
                "--async-scheduling"]  # fmt: skip
GPU_WORK = ["--num-prompts", "1000", "--input-len", "128", "--output-len", "128",
            "--latency-input-len", "128", "--latency-output-len", "128", "--latency-warmup", "1",
            "--latency-iters", "3"]  # fmt: skip
SMOKE_WORK = ["--num-prompts", "8", "--input-len", "16", "--output-len", "8",
              "--latency-input-len", "16", "--latency-output-len", "8", "--latency-warmup", "1",
              "--latency-iters", "1"]  # fmt: skip
MATRIX_WORKERS = 4
SMOKE_MATRIX_ROWS = ["llama3-bf16"]
RESERVE_S = 15  # kept back from the deadline for the table and the archive
LOG_TAIL_CHARS = 4000


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    box_s: float | None  # None: whatever is left ("rest")


@dataclasses.dataclass
class Context:
    smoke: bool
    work: pathlib.Path
    configs: pathlib.Path
    python: str = sys.executable

    def step_dir(self, name: str) -> pathlib.Path:
        path = self.work / name
        path.mkdir(parents=True, exist_ok=True)
        return path


def parse_steps(spec: str) -> list[Step]:
    """``"bf16:200 fp8:150 matrix:rest"`` -> steps in that order.

    Raises:
        ValueError: an unknown step, a repeated one, or a box that is neither a positive number
            nor ``rest``.
    """
    steps = []
    for item in spec.split():
        name, _, box = item.partition(":")
        if name not in KNOWN_STEPS:
            raise ValueError(f"unknown step {name!r}; known: {', '.join(KNOWN_STEPS)}")
        if any(s.name == name for s in steps):
            raise ValueError(f"step {name!r} is listed twice")
        if box == "rest":
            steps.append(Step(name, None))
            continue
        try:
            seconds = float(box)
        except ValueError:
            seconds = -1.0
        if seconds <= 0:
            raise ValueError(f"step {name!r}: box must be seconds > 0 or 'rest', got {box!r}")
        steps.append(Step(name, seconds))
    return steps


# ------------------------------------------------------------------------------- commands
def engine_command(ctx: Context, name: str) -> list[str]:
    config, extra = ENGINE_MODELS[name]
    if ctx.smoke:
        model = str(ctx.configs / config.replace("llama-3-8b", "tiny"))
        engine, work = SMOKE_ENGINE, SMOKE_WORK
    else:
        model, engine, work = f"benchmarks/configs/{config}", GPU_ENGINE, GPU_WORK
    out = str(ctx.step_dir(name))
    return [ctx.python, "benchmarks/e2e_suite.py", "--model", model, *engine, *extra, *work,
            "--workloads", "random", "latency", "--output-dir", out]  # fmt: skip


def structured_command(ctx: Context) -> list[str]:
    out = str(ctx.step_dir("structured") / "structured.json")
    if ctx.smoke:  # stories260k (the default model) brings its own tokenizer
        return [ctx.python, "benchmarks/structured_outputs.py", "--dtype", "float32",
                "--max-model-len", "128", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
                "--async-scheduling", "--num-prompts", "8", "--input-len", "8", "--output-len",
                "8", "--tpot-requests", "1", "--out", out]  # fmt: skip
    return [ctx.python, "benchmarks/structured_outputs.py", "--model",
            "benchmarks/configs/llama-3-8b", "--synthetic-vocab", *GPU_ENGINE, "--num-prompts",
            "1000", "--input-len", "128", "--output-len", "128", "--out", out]  # fmt: skip


def weight_sync_command(ctx: Context) -> list[str]:
    out = str(ctx.step_dir("weight_sync") / "weight_sync.json")
    smoke = ["--model", "jaxpaged/model_data/stories260k", "--dtype", "float32", "--num-prompts",
             "4", "--input-len", "16", "--output-len", "16", "--kv-cache-gib", "0.01",
             "--repeats", "1"]  # fmt: skip
    return [ctx.python, "benchmarks/weight_sync.py", *(smoke if ctx.smoke else []),
            "--out", out]  # fmt: skip


def server_command(ctx: Context) -> list[str]:
    ctx.step_dir("server")
    return ["bash", "benchmarks/server.sh", *(["--smoke"] if ctx.smoke else [])]


def matrix_command(ctx: Context, rows: list[str] | None) -> list[str]:
    out = ctx.step_dir("matrix") / "matrix.json"
    command = [ctx.python, "-m", "jaxpaged.entrypoints.cli", "bench", "matrix", "--out", str(out),
               "--no-tqdm"]  # fmt: skip
    if ctx.smoke:
        return [*command, "--shrink", "--rows", *(rows or SMOKE_MATRIX_ROWS)]
    return [*command, "--workers", str(MATRIX_WORKERS), *(["--rows", *rows] if rows else [])]


def step_command(ctx: Context, name: str, matrix_rows: list[str] | None) -> list[str]:
    """The command of step ``name`` (``matrix_rows``: the matrix rows to run; None: all)."""
    if name in ENGINE_STEPS:
        return engine_command(ctx, name)
    return {
        "structured": structured_command,
        "weight_sync": weight_sync_command,
        "server": server_command,
        "matrix": lambda c: matrix_command(c, matrix_rows),
    }[name](ctx)


KNOWN_STEPS = (*ENGINE_STEPS, "structured", "weight_sync", "server", "matrix")


# --------------------------------------------------------------------------- step results
def read_json(path: pathlib.Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def step_result(ctx: Context, name: str) -> dict | None:
    """The step's own JSON as it stands (possibly partial: the suites rewrite theirs as they
    go), or None when it wrote none."""
    d = ctx.work / name
    if name in ENGINE_STEPS:
        return read_json(d / "suite.json")
    if name == "structured":
        return read_json(d / "structured.json")
    if name == "weight_sync":
        return read_json(d / "weight_sync.json")
    if name == "server":
        summary = read_json(d / "summary.json")
        config = (
            (d / "server-config.txt").read_text().split()
            if (d / "server-config.txt").exists()
            else []
        )
        api = int(config[1]) if len(config) > 1 and config[1].isdigit() else None
        files = {
            n: read_json(d / f"{n}.json")
            for n in ("offline", "saturation", "rate20", "concurrent16")
        }
        if summary is None and not any(files.values()):
            return None
        return {"summary": summary, "api_servers": api, **{k: v for k, v in files.items() if v}}
    if name == "matrix":
        return matrix_rows_so_far(d / "matrix.json")
    return None


def matrix_rows_so_far(out: pathlib.Path) -> dict | None:
    """``bench matrix``'s JSON, or, when its parent was stopped before merging, its workers'
    ``.shardK`` files merged (the rows they finished)."""
    merged = read_json(out)
    if merged is not None:
        return merged
    parts = [read_json(p) for p in sorted(out.parent.glob(out.name + ".shard*"))]
    parts = [p for p in parts if p]
    if not parts:
        return None
    report = {k: v for k, v in parts[0].items() if k != "rows"}
    report["rows"] = [row for part in parts for row in part.get("rows", [])]
    return report


def matrix_row_names(ctx: Context) -> list[str] | None:
    """Every row's name, in declared order (``bench matrix --list``; None if that fails)."""
    if ctx.smoke:
        return list(SMOKE_MATRIX_ROWS)
    try:
        done = subprocess.run(
            [ctx.python, "-m", "jaxpaged.entrypoints.cli", "bench", "matrix", "--list"],
            capture_output=True, text=True, cwd=ROOT, env=step_env(ctx), timeout=120, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


# ------------------------------------------------------------------------------ running
def step_env(ctx: Context) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    if ctx.smoke:
        env["JAX_PLATFORMS"] = "cpu"
    return env


def run_process(command: list[str], env: dict, box_s: float, log: pathlib.Path) -> tuple[str, int]:
    """Run ``command`` in its own process group with output to ``log``; past ``box_s`` the
    whole group gets SIGABRT (each Python process, with ``PYTHONFAULTHANDLER`` set, writes every
    thread's stack to the log first: where a step that ran out of time was), then SIGTERM and
    SIGKILL. Returns ``(status, returncode)``: ``ok``, ``failed`` or ``timeout``."""
    with open(log, "w") as f:
        f.write(f"$ {' '.join(command)}\n")
        f.flush()
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            rc = proc.wait(timeout=box_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc, first=signal.SIGABRT)
            return "timeout", proc.returncode
    _kill_group(proc)  # children a finished step left behind (a server, matrix workers)
    return ("ok" if rc == 0 else "failed"), rc


def _kill_group(proc: subprocess.Popen, first: signal.Signals | None = None) -> None:
    """Signal ``proc``'s process group (``first``, then SIGTERM, then SIGKILL) until it is gone."""
    signals = [(first, 5)] if first is not None else []
    for sig, grace in (*signals, (signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
        try:  # the leader is gone; give its group the rest of the grace to follow
            deadline = time.time() + grace
            while time.time() < deadline:
                os.killpg(proc.pid, 0)
                time.sleep(0.2)
        except ProcessLookupError:
            return


def tail(path: pathlib.Path, chars: int = LOG_TAIL_CHARS) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-chars:]


# ------------------------------------------------------------------------- call metadata
def device_name(smoke: bool) -> str:
    if smoke:
        return "cpu (smoke)"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout  # fmt: skip
        return out.strip().splitlines()[0] if out.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def tree() -> str:
    """``TREE`` when set (the GPU copy of the tree may have no .git), else git's short HEAD,
    with ``+dirty`` when the work tree differs from it."""
    if os.environ.get("TREE"):
        return os.environ["TREE"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()  # fmt: skip
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def packages() -> dict:
    """Versions of the packages the steps lean on (metadata only: nothing is imported), and
    the modules that would not import."""
    names = ("jax", "jaxlib", "jax-cuda13-plugin", "flax", "transformers", "torch", "xgrammar",
             "llguidance", "fastapi", "uvicorn", "pyzmq", "numpy")  # fmt: skip
    versions = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    modules = ("fastapi", "starlette", "pydantic", "uvicorn", "httptools", "zmq", "llguidance",
               "xgrammar", "jsonschema", "msgpack", "httpx", "uvloop",
               "prometheus_client")  # fmt: skip
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return {"versions": versions, "missing_modules": missing}


# ------------------------------------------------------------------------------- resume
def carried_steps(previous: dict | None, device: str, smoke: bool) -> dict:
    """The steps of an earlier call to keep: ``ok`` ones measured on ``device`` (the matrix
    whatever its status: its finished rows), in the same mode (smoke or not)."""
    if not previous or previous.get("schema") != SCHEMA:
        return {}
    kept = {}
    for name, step in (previous.get("steps") or {}).items():
        if step.get("device") != device or bool(step.get("smoke")) != smoke:
            continue
        if step.get("status") == "ok" or (name == "matrix" and step.get("result")):
            kept[name] = step
    return kept


def order(steps: list[Step], previous: dict | None, kept: dict) -> list[Step]:
    """The steps to run: those not kept, first the boxed ones an earlier call never ran (in
    the given order), then the boxed ones it ran and that failed or timed out, last those that
    take the rest of the time (the matrix, which resumes row by row)."""
    before = (previous or {}).get("steps") or {}
    todo = [s for s in steps if s.name not in kept or s.name == "matrix"]
    tried = {n for n, st in before.items() if st.get("status") in ("failed", "timeout")}
    boxed = [s for s in todo if s.box_s is not None]
    return (
        [s for s in boxed if s.name not in tried]
        + [s for s in boxed if s.name in tried]
        + [s for s in todo if s.box_s is None]
    )


def matrix_rows_left(kept: dict, names: list[str] | None) -> list[str] | None:
    """Rows of ``names`` the matrix still has to run (None: all of them: nothing kept, or the
    names unknown)."""
    rows = ((kept.get("matrix") or {}).get("result") or {}).get("rows") or []
    done = {r["name"] for r in rows if not _never_ran(r)}
    if not done or names is None:
        return None
    return [n for n in names if n not in done]


def merge_matrix(kept_step: dict | None, new: dict | None) -> dict | None:
    old_rows = ((kept_step or {}).get("result") or {}).get("rows") or []
    if new is None:
        return (kept_step or {}).get("result")
    fresh = {r["name"]: r for r in new.get("rows") or []}
    rows = [r for r in old_rows if r["name"] not in fresh and not _never_ran(r)]
    return {**new, "rows": rows + list(fresh.values())}


def _never_ran(record: dict) -> bool:
    return str(record.get("note") or "").startswith("worker exited")


# -------------------------------------------------------------------------------- main
def run_all(args, ctx: Context) -> dict:
    steps = parse_steps(args.steps)
    device, commit = device_name(ctx.smoke), tree()
    date = time.strftime("%Y-%m-%d", time.gmtime())
    previous = read_json(pathlib.Path(args.resume)) if args.resume else None
    kept = carried_steps(previous, device, ctx.smoke)
    results = {
        "schema": SCHEMA,
        "source": f"benchmarks/gpu.sh{' --smoke' if ctx.smoke else ''}",
        "calls": [*((previous or {}).get("calls") or []), dict(
            tree=commit, date=date, device=device, smoke=ctx.smoke, deadline_s=args.deadline_s,
            steps=args.steps, **packages())],
        "steps": {name: step for name, step in kept.items()},
        "figures": [],
    }  # fmt: skip
    save(args.out, results)
    for step in order(steps, previous, kept):
        left = args.deadline_s - (time.time() - args.started_at) - RESERVE_S
        box = left if step.box_s is None else min(step.box_s, left)
        rows = None
        if step.name == "matrix":
            names = matrix_row_names(ctx)
            rows = matrix_rows_left(kept, names)
        if box < args.min_step_s or rows == []:
            if rows != [] and step.name not in kept:
                results["steps"][step.name] = dict(status="deferred", box_s=step.box_s,
                                                   device=device, tree=commit, date=date,
                                                   smoke=ctx.smoke)  # fmt: skip
            print(f"[gpu.sh] {step.name}: {'nothing left' if rows == [] else 'deferred'} "
                  f"({max(left, 0):.0f} s left)", flush=True)  # fmt: skip
            continue
        command = step_command(ctx, step.name, rows)
        env = step_env(ctx)
        if step.name == "server":
            env.update(OUT=str(ctx.work / "server"), TRACE="0")
        print(f"[gpu.sh] {step.name}: box {box:.0f} s", flush=True)
        log = ctx.work / f"{step.name}.log"
        start = time.time()
        status, rc = run_process(command, env, box, log)
        result = step_result(ctx, step.name)
        if step.name == "matrix":
            result = merge_matrix(kept.get("matrix"), result)
            if result is not None and names is not None:
                result["total_rows"] = len(names)
        results["steps"][step.name] = dict(
            status=status, rc=rc, seconds=round(time.time() - start, 1), box_s=round(box),
            device=device, tree=commit, date=date, smoke=ctx.smoke, result=result,
            log_tail=tail(log),
        )  # fmt: skip
        print(f"[gpu.sh] {step.name}: {status} (rc {rc}) in {time.time() - start:.0f} s",
              flush=True)  # fmt: skip
        save(args.out, results)
    return results


def save(out: pathlib.Path, results: dict) -> None:
    results["figures"] = [
        figure
        for name, step in results["steps"].items()
        if step.get("result") or step.get("status") in ("failed", "timeout")
        for figure in gpu_step_figures(name, step, dict(
            tree=step["tree"], date=step["date"], device=step["device"],
            source=results["source"] + f" ({step['status']})", suite="benchmarks/gpu.sh"))
    ]  # fmt: skip
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=1, default=str))
    tmp.replace(out / "results.json")


def table(results: dict) -> str:
    """One line per step (status, seconds of its box, device, tree), its figures under it."""
    lines = [f"{'step':<12} {'status':<9} {'s / box':>11}  device, tree, date"]
    steps = sorted(results["steps"].items(), key=lambda item: KNOWN_STEPS.index(item[0]))
    for name, step in steps:
        secs = f"{step.get('seconds', 0):.0f} / {step.get('box_s') or '-'}"
        lines.append(f"{name:<12} {step['status']:<9} {secs:>11}  {step.get('device')}, "
                     f"{step.get('tree')}, {step.get('date')}")  # fmt: skip
        for f in results["figures"]:
            if f["configuration"] and _figure_of(name, f):
                unit = f" {f['unit']}" if f.get("unit") and not isinstance(f["value"], str) else ""
                target = f"   (target {f['target']})" if f.get("target") else ""
                lines.append(f"    {f['configuration'][:34]:<34} {f['measure'][:44]:<44} "
                             f"{f['value']}{unit}{target}")  # fmt: skip
    return "\n".join(lines) + "\n"


def _figure_of(step: str, figure: dict) -> bool:
    group = {"structured": "every request", "weight_sync": "weight sync",
             "server": "jaxpaged serve", "matrix": "every option"}  # fmt: skip
    if step in ENGINE_STEPS:
        return figure["group"] == "engine" and figure["configuration"] == ENGINE_STEPS[step]
    return figure["configuration"].startswith(group.get(step, "\0"))


def archive(ctx: Context, out: pathlib.Path) -> None:
    """Every step's log and JSON (not the compilation caches) as ``OUT/logs.tar.gz``."""
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        for path in sorted(ctx.work.rglob("*")):
            if path.is_file() and path.suffix in (".log", ".json", ".txt", ".prom"):
                if path.stat().st_size <= 32 * 2**20:
                    tar.add(path, arcname=str(path.relative_to(ctx.work)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", required=True, help='"name:seconds ... name:rest"')
    parser.add_argument("--deadline-s", type=float, required=True)
    parser.add_argument("--started-at", type=float, default=time.time(), help="epoch seconds")
    parser.add_argument("--min-step-s", type=float, default=60)
    parser.add_argument("--work", type=pathlib.Path, required=True)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--resume", default=None, help="an earlier call's results.json")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    try:
        parse_steps(args.steps)
    except ValueError as error:
        parser.error(str(error))
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = Context(smoke=args.smoke, work=args.work, configs=args.work / "configs")
    if args.smoke:
        subprocess.run([sys.executable, "benchmarks/lib/quantization_summary.py",
                        "--smoke-configs", str(ctx.configs)], cwd=ROOT, check=True)  # fmt: skip
    results = run_all(args, ctx)
    text = table(results)
    (args.out / "table.txt").write_text(text)
    archive(ctx, args.out)
    print(text, end="")
    return 0 if all(s["status"] == "ok" for s in results["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
