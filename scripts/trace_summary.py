"""Where each engine step's GPU time goes, from a JAX profiler trace.

The trace is what ``jax.profiler.trace(..., create_perfetto_trace=True)`` writes.

Reads the trace-viewer JSON (``*.trace.json.gz``) that the profiler writes and, for the GPU
processes (``/device:GPU:N``), splits the kernels on the compute streams into step executions:
by the XLA module executions of the ``XLA Modules`` line when the trace has one, else by the
CUDA graph launch (``correlation_id``) each step's kernels share, or a kernel that runs once per
step (``_split_into_steps``). Per group of
steps with the same kernel count (decode and prefill buckets differ) it reports:

- ``span_us``: the module's duration on the device timeline;
- ``busy_us``: the union of its kernels' intervals (what the GPU spent computing);
- ``gap_us = span - busy``: time inside the step with no kernel running, i.e. launch gaps: a
  launch-bound step has large gaps;
- ``kernels``: kernels per step, and their time by category (matmul, Pallas, other fusions,
  copies).

``python scripts/trace_summary.py TRACE_DIR_OR_FILE`` prints the table. The trace format is the
profiler's (TensorBoard trace viewer / Perfetto JSON: ``ph: "M"`` names processes and threads,
``ph: "X"`` events carry ``ts``/``dur`` in microseconds).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import pathlib
import statistics
import sys

CATEGORIES = ("matmul", "pallas", "fusion", "copy")
_MATMUL_MARKERS = ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "sm80_")
_PALLAS_MARKERS = ("paged_attention", "ragged", "kv_cache_update", "pallas", "triton_kernel")
_COPY_MARKERS = ("memcpy", "memset")


def find_trace(path: str | pathlib.Path) -> pathlib.Path:
    """The newest ``*.trace.json.gz`` under ``path`` (or ``path`` itself).

    Raises:
        FileNotFoundError: no trace file there.
    """
    path = pathlib.Path(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"{path} does not exist")
    found = sorted(path.rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no *.trace.json.gz under {path}")
    return found[-1]


def load_events(path: str | pathlib.Path) -> list[dict]:
    """The ``traceEvents`` of a trace file (gzipped or plain JSON).

    Raises:
        ValueError: the file is not a trace-viewer JSON (naming it).
    """
    path = pathlib.Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a trace-viewer JSON file ({e})") from e
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ValueError(f"{path} has no traceEvents list")
    return events


def kernel_category(event: dict) -> str:
    """One of ``CATEGORIES`` for a kernel event, by its name and its ``hlo_op`` argument."""
    name = event.get("name", "").lower()
    hlo_op = str(event.get("args", {}).get("hlo_op", "")).lower()
    if any(m in name for m in _COPY_MARKERS):
        return "copy"
    if any(m in name for m in _PALLAS_MARKERS) or "custom-call" in hlo_op or "custom_call" in hlo_op:
        return "pallas"
    if any(m in name for m in _MATMUL_MARKERS) or hlo_op.startswith(("dot", "gemm", "cublas")):
        return "matmul"
    return "fusion"


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def gpu_steps(events: list[dict], module_substring: str = "") -> list[dict]:
    """Per XLA module execution on a GPU: span, busy time, kernel count and time per category.

    Args:
        events: trace events (``load_events``).
        module_substring: keep only modules whose name contains it (e.g. ``"_step"``).

    Returns:
        One dict per module execution, in time order: ``module``, ``start_us``, ``span_us``,
        ``busy_us``, ``gap_us``, ``kernels``, ``by_category`` (category -> us), ``kernel_names``
        (name -> us).
    """
    processes, threads = {}, {}
    for e in events:
        if e.get("ph") != "M":
            continue
        if e.get("name") == "process_name":
            processes[e["pid"]] = e["args"]["name"]
        elif e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    gpu_pids = {pid for pid, name in processes.items() if name.startswith("/device:GPU")}
    modules, kernels = [], collections.defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in gpu_pids:
            continue
        thread = threads.get((e["pid"], e.get("tid")), "")
        if thread == "XLA Modules":
            if module_substring in e.get("name", ""):
                modules.append(e)
        elif thread.startswith("Stream"):
            kernels[e["pid"]].append(e)
    steps = []
    for pid, pid_kernels in kernels.items():
        pid_kernels.sort(key=lambda k: k["ts"])
        pid_modules = sorted((m for m in modules if m["pid"] == pid), key=lambda m: m["ts"])
        if pid_modules:
            starts = [k["ts"] for k in pid_kernels]
            windows = [
                (m["name"], m["ts"], m["dur"],
                 pid_kernels[bisect.bisect_left(starts, m["ts"]):
                             bisect.bisect_right(starts, m["ts"] + m["dur"])])
                for m in pid_modules
            ]
        else:
            windows = [
                ("step", group[0]["ts"], max(k["ts"] + k["dur"] for k in group) - group[0]["ts"],
                 group)
                for group in _split_into_steps(pid_kernels)
            ]
        for name, start, span, inside in windows:
            by_category = dict.fromkeys(CATEGORIES, 0.0)
            names: dict[str, float] = collections.defaultdict(float)
            for k in inside:
                by_category[kernel_category(k)] += k["dur"]
                names[k["name"]] += k["dur"]
            busy = _union_length([(k["ts"], k["ts"] + k["dur"]) for k in inside])
            steps.append({
                "module": name,
                "start_us": start,
                "span_us": span,
                "busy_us": busy,
                "gap_us": span - busy,
                "kernels": len(inside),
                "by_category": by_category,
                "kernel_names": dict(names),
            })
    steps.sort(key=lambda s: s["start_us"])
    return steps


def _split_into_steps(kernels: list[dict]) -> list[list[dict]]:
    """Kernels (time order) cut into step executions when the trace has no ``XLA Modules`` line.

    XLA runs a step as CUDA graphs (command buffers), and every kernel of one graph launch
    carries that launch's ``correlation_id``: each large launch (at least half the size of the
    largest) starts a step, and kernels launched on their own (copies, memsets) join the step
    running when they start. Without graphs (one launch per kernel) the trace is cut at each
    occurrence of an anchor kernel: the earliest of the names that occur the fewest times (at
    least twice), i.e. once per step of identical steps.
    """
    launches = collections.Counter(k.get("args", {}).get("correlation_id") for k in kernels)
    largest = max(launches.values(), default=0)
    steps_ids = [c for c, n in launches.items() if c is not None and 2 * n >= largest]
    if largest > 1 and len(steps_ids) > 1:
        starts = sorted(
            (next(k["ts"] for k in kernels if k.get("args", {}).get("correlation_id") == c), c)
            for c in steps_ids
        )
        first_ts = [ts for ts, _ in starts]
        groups: list[list[dict]] = [[] for _ in starts]
        for k in kernels:
            index = bisect.bisect_right(first_ts, k["ts"]) - 1
            if index >= 0:
                groups[index].append(k)
        return groups
    counts = collections.Counter(k["name"] for k in kernels)
    repeated = [n for n, c in counts.items() if c >= 2]
    if not repeated:
        return [kernels] if kernels else []
    fewest = min(counts[n] for n in repeated)
    anchor = next(k["name"] for k in kernels if counts[k["name"]] == fewest)
    cuts = [i for i, k in enumerate(kernels) if k["name"] == anchor]
    return [kernels[a:b] for a, b in zip(cuts, cuts[1:] + [len(kernels)], strict=True)]


def group_steps(steps: list[dict], min_count: int = 1) -> list[dict]:
    """Steps grouped by kernel count (one group per bucket shape, roughly), medians per group,
    largest total time first; groups with fewer than ``min_count`` steps are dropped."""
    groups = collections.defaultdict(list)
    for s in steps:
        groups[s["kernels"]].append(s)
    rows = []
    for count, members in groups.items():
        if len(members) < min_count:
            continue
        top = collections.Counter()
        for s in members:
            top.update(s["kernel_names"])
        rows.append({
            "kernels": count,
            "steps": len(members),
            "total_ms": sum(s["span_us"] for s in members) / 1000,
            "span_us": statistics.median(s["span_us"] for s in members),
            "busy_us": statistics.median(s["busy_us"] for s in members),
            "gap_us": statistics.median(s["gap_us"] for s in members),
            "by_category": {
                c: statistics.median(s["by_category"][c] for s in members) for c in CATEGORIES
            },
            "top_kernels": [(n, t / len(members)) for n, t in top.most_common(12)],
        })
    rows.sort(key=lambda r: -r["total_ms"])
    return rows


def idle_between_steps(steps: list[dict]) -> float:
    """Fraction of the span from the first step's start to the last one's end during which no
    step was executing (the device waited on the host)."""
    if len(steps) < 2:
        return 0.0
    first = steps[0]["start_us"]
    last = max(s["start_us"] + s["span_us"] for s in steps)
    if last <= first:
        return 0.0
    covered = _union_length([(s["start_us"], s["start_us"] + s["span_us"]) for s in steps])
    return 1.0 - covered / (last - first)


def describe_lines(events: list[dict]) -> list[str]:
    """Each process and thread of the trace with its number of complete events (to see what a
    trace holds when no steps were found)."""
    names = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name"):
            names[(e["pid"], e.get("tid") if e["name"] == "thread_name" else None)] = e["args"]["name"]
    counts = collections.Counter((e.get("pid"), e.get("tid")) for e in events if e.get("ph") == "X")
    lines = []
    for (pid, tid), n in sorted(counts.items(), key=lambda kv: -kv[1])[:40]:
        example = next(e for e in events
                       if e.get("ph") == "X" and e.get("pid") == pid and e.get("tid") == tid)
        lines.append(f"{names.get((pid, None), pid)!s:28} {names.get((pid, tid), tid)!s:36} "
                     f"{n:8d}  e.g. {example['name'][:60]} {str(example.get('args', ''))[:200]}")
    return lines


def format_report(steps: list[dict]) -> str:
    """The groups as a text table, then each group's heaviest kernels."""
    lines = [
        f"{len(steps)} step executions; device idle between steps "
        f"{100 * idle_between_steps(steps):.1f}%",
        "kernels/step  steps  total ms  span us  busy us  gap us  "
        + "  ".join(f"{c:>8}" for c in CATEGORIES),
    ]
    rows = group_steps(steps)
    for r in rows:
        cats = "  ".join(f"{r['by_category'][c]:8.0f}" for c in CATEGORIES)
        lines.append(
            f"{r['kernels']:12d}  {r['steps']:5d}  {r['total_ms']:8.1f}  {r['span_us']:7.0f}  "
            f"{r['busy_us']:7.0f}  {r['gap_us']:6.0f}  {cats}"
        )
    for r in rows[:3]:
        lines.append(f"-- heaviest kernels, {r['kernels']} kernels/step (us per step):")
        for name, t in r["top_kernels"]:
            lines.append(f"   {t:9.1f}  {name[:110]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="a trace file or a directory holding one")
    parser.add_argument("--module", default="", help="keep modules whose name contains this")
    args = parser.parse_args(argv)
    try:
        events = load_events(find_trace(args.trace))
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    steps = gpu_steps(events, args.module)
    if steps:
        print(format_report(steps))
    elif events:
        print("no GPU steps in this trace; its threads:")
        print("\n".join(describe_lines(events)))
    else:
        print("the trace holds no events")
    return 0


if __name__ == "__main__":
    sys.exit(main())
