"""Benchmark figures as data: each measured value with the tree, date and device it came from.

``docs/benchmarks.md``'s current tables are rendered from figure files (``benchmarks/render.py``
writes them; a CPU test fails when the page and the files disagree), so no figure is typed by
hand. A figure file is JSON::

    {"source": "who measured, how",            # the default of each figure's "source"
     "defaults": {"tree": "c44c78e", ...},     # optional: what a figure lacks, it takes here
     "figures": [{"group": "engine", "configuration": "bf16",
                  "measure": "output tok/s, 1000 x 128/128", "value": 16398, "unit": "tok/s",
                  "target": null, "tree": "c44c78e", "date": "2026-12-07",
                  "device": "NVIDIA H100 80GB HBM3", "suite": "benchmarks/gpu.sh"}]}

``benchmarks/gpu.sh``'s ``results.json`` is such a file: :func:`gpu_step_figures` turns each
finished step's own JSON into figures. The current table holds, per (group, configuration,
measure, device), the figure of the latest date (a later file wins a tie), in the order the
keys first appear; so a new GPU call's figures replace the older ones beside them and figures
from another device stay as their own rows.
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Iterable, Sequence

FIELDS = ("group", "configuration", "measure", "value", "unit", "target", "tree", "date",
          "device", "source", "suite")  # fmt: skip
REQUIRED = ("group", "configuration", "measure", "value", "tree", "date", "device", "source")

# Measures that a GPU call and a seed file must spell alike so that the newer figure replaces
# the older one (the table's key includes the measure's name).
TOKS = "output tok/s, {n} x {inp}/{out}"
TPOT = "batch-1 TPOT, {inp}/{out}"
STARTUP = "start-up, engine built"
FIRST_TOKEN = "process start to first token"

# The engine configurations of benchmarks/gpu.sh's steps (step name -> row label).
ENGINE_STEPS = {
    "bf16": "bf16",
    "fp8": "FP8 W8A8 (online) + FP8 KV cache",
    "int8": "INT8 W8A8 (compressed-tensors), linear_backend auto",
    "awq": "W4A16 AWQ, linear_backend auto",
    "gptq": "W4A16 GPTQ, linear_backend auto",
}


def load_file(path: str | pathlib.Path) -> list[dict]:
    """The figures of one file, each with the file's ``defaults`` and ``source`` filled in.

    Raises:
        ValueError: a figure without one of :data:`REQUIRED` or with a key outside
            :data:`FIELDS`, naming the file and the figure.
    """
    data = json.loads(pathlib.Path(path).read_text())
    defaults = dict(data.get("defaults") or {})
    if "source" in data:
        defaults.setdefault("source", data["source"])
    out = []
    for i, raw in enumerate(data.get("figures") or []):
        figure = {**defaults, **raw}
        missing = [key for key in REQUIRED if figure.get(key) in (None, "")]
        unknown = sorted(set(figure) - set(FIELDS))
        if missing or unknown:
            raise ValueError(
                f"{path}: figure {i} ({figure.get('configuration')!r}, "
                f"{figure.get('measure')!r}): missing {missing}, unknown keys {unknown}"
            )
        out.append(figure)
    return out


def load_figures(paths: Iterable[str | pathlib.Path]) -> list[dict]:
    """Every figure of ``paths``, file by file in the given order."""
    return [figure for path in paths for figure in load_file(path)]


def current(figures: Sequence[dict]) -> list[dict]:
    """The latest figure per (group, configuration, measure, device): latest ``date``, and the
    later one in ``figures`` on a tie; in the order the keys first appear."""
    chosen: dict[tuple, dict] = {}
    for figure in figures:
        key = (figure["group"], figure["configuration"], figure["measure"], figure["device"])
        if key not in chosen or figure["date"] >= chosen[key]["date"]:
            chosen[key] = figure
    return list(chosen.values())


def format_value(value, unit: str | None) -> str:
    """A figure's value for the table: text as given; numbers of 100 or more whole with
    thousands separators, smaller ones to 4 significant digits (``16,398``, ``5.66``,
    ``0.0004``), ratios and growths as ``0.60x`` and ``+13.0%``; then the unit."""
    if isinstance(value, str):
        return value
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "%":
        return f"{value:+.1f}%"
    text = f"{value:,.0f}" if isinstance(value, int) or abs(value) >= 100 else f"{value:.4g}"
    return f"{text} {unit}" if unit else text


def render(figures: Sequence[dict]) -> str:
    """The markdown of the current figures: one table per group, groups in the order they
    first appear; inside a group, rows by configuration, then measure (each in the order it
    first appears), then device; each row a figure with its target, device, tree, date and
    source (numbered; the sources listed under the tables)."""
    rows = current(figures)
    first: dict = {}
    for figure in figures:
        for key in ("group", "configuration", "measure"):
            first.setdefault((key, figure[key]), len(first))
    rows.sort(key=lambda f: (first["group", f["group"]], first["configuration", f["configuration"]],
                             first["measure", f["measure"]], f["device"]))  # fmt: skip
    parts, group, sources = [], None, {}
    for f in rows:
        if f["group"] != group:
            group = f["group"]
            parts.append(
                f"\n| {group} | measure | value | target | device | tree | date | source |"
            )
            parts.append("|---|---|---:|---|---|---|---|---|")
        cells = [f["configuration"], f["measure"], format_value(f["value"], f.get("unit")),
                 f.get("target") or "", f["device"], f"`{f['tree']}`", f["date"],
                 f"[{sources.setdefault(f['source'], len(sources) + 1)}]"]  # fmt: skip
        parts.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    parts.append("")
    parts += [f"[{n}] {source}  " for source, n in sources.items()]
    return "\n".join(parts).lstrip("\n").rstrip() + "\n"


# ---------------------------------------------------------------- figures of gpu.sh's steps
def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def engine_figures(label: str, suite: dict) -> list[dict]:
    """The throughput, batch-1 TPOT and start-up figures of one ``benchmarks/e2e_suite.py``
    ``suite.json`` (those it got to before it stopped)."""
    args = suite.get("args") or {}
    out = []
    random = (suite.get("random") or {}).get("output_tokens_per_second")
    if _finite(random):
        measure = TOKS.format(n=args.get("num_prompts"), inp=args.get("input_len"),
                              out=args.get("output_len"))  # fmt: skip
        out.append(dict(configuration=label, measure=measure, value=round(random), unit="tok/s"))
    tpot = (suite.get("latency") or {}).get("avg_tpot_seconds")
    if _finite(tpot):
        measure = TPOT.format(inp=args.get("latency_input_len"), out=args.get("latency_output_len"))
        out.append(
            dict(configuration=label, measure=measure, value=round(1e3 * tpot, 3), unit="ms")
        )
    if _finite(suite.get("startup_seconds")):
        out.append(dict(configuration=label, measure=STARTUP,
                        value=round(suite["startup_seconds"], 1), unit="s"))  # fmt: skip
    if _finite(suite.get("start_to_first_token_s")):
        out.append(dict(configuration=label, measure=FIRST_TOKEN,
                        value=round(suite["start_to_first_token_s"], 1), unit="s"))  # fmt: skip
    return [dict(group="engine", **f) for f in out]


def structured_figures(result: dict) -> list[dict]:
    """``benchmarks/structured_outputs.py``'s ratios and their targets."""
    label = f"every request under a JSON schema ({result.get('backend')})"
    out = []
    if _finite(result.get("throughput_ratio")):
        out.append(dict(measure="output tok/s / unconstrained", unit="x", target=">= 0.9x",
                        value=round(result["throughput_ratio"], 3)))  # fmt: skip
    if _finite(result.get("tpot_growth")):
        out.append(dict(measure="batch-1 TPOT growth", value=round(100 * result["tpot_growth"], 1),
                        unit="%", target="<= +10%"))  # fmt: skip
    return [dict(group="structured outputs, weight sync", configuration=label, **f) for f in out]


def weight_sync_figures(result: dict) -> list[dict]:
    """``benchmarks/weight_sync.py``'s update, sleep and wake-up times and the throughput
    after the round trip against before."""
    rows = (("update_weights, own layout", "update_own_layout_s", "<= 500 ms"),
            ("update_weights, HF names", "update_hf_names_s", "<= 500 ms"),
            ("sleep(level=1)", "sleep_level1_s", "<= 1,000 ms"),
            ("wake_up()", "wake_up_s", "<= 1,000 ms"))  # fmt: skip
    out = [
        dict(measure=measure, value=round(1e3 * result[key], 2), unit="ms", target=target)
        for measure, key, target in rows
        if _finite(result.get(key))
    ]
    before, after = result.get("throughput_before_tok_s"), result.get("throughput_after_tok_s")
    if _finite(before) and _finite(after) and before:
        out.append(dict(measure="output tok/s after sleep / wake_up vs before",
                        value=f"{after:,.0f} vs {before:,.0f} ({after / before - 1:+.0%})",
                        target="within 3%"))  # fmt: skip
    return [dict(group="structured outputs, weight sync", configuration="weight sync, sleep mode",
                 **f) for f in out]  # fmt: skip


def server_figures(summary: dict, api_servers: int | None) -> list[dict]:
    """``benchmarks/lib/server_summary.py``'s ``summary.json`` rows that have targets."""
    label = f"jaxpaged serve, {api_servers or '?'} API processes"
    names = {"served / offline": ("served / offline output tok/s", "x", ">= 0.90"),
             "P99 TTFT ms, 20 req/s 512/128": ("P99 TTFT, 20 req/s of 512/128", "ms", "<= 60 ms"),
             "P99 TPOT ms, 20 req/s 512/128": ("P99 TPOT, 20 req/s of 512/128", "ms",
                                               "<= 10 ms")}  # fmt: skip
    out = []
    for row in summary.get("rows") or []:
        if row["measure"] in names and _finite(row.get("value")):
            measure, unit, target = names[row["measure"]]
            out.append(dict(group="server", configuration=label, measure=measure,
                            value=round(row["value"], 3 if unit == "x" else 1), unit=unit,
                            target=target))  # fmt: skip
    return out


def matrix_figures(matrix: dict, total_rows: int | None) -> list[dict]:
    """The matrix's rows run, compiled and matching, and the failing rows' names."""
    rows = [r for r in matrix.get("rows") or [] if not _never_ran(r)]
    if not rows:
        return []
    compiled = sum(r.get("compiled") not in ("error", None) for r in rows)
    matching = sum(r.get("matches") is True for r in rows)
    failing = [r["name"] for r in rows if r.get("compiled") == "error" or r.get("matches") is False]
    of = f" of {total_rows}" if total_rows else ""
    value = f"{len(rows)}{of} rows ran: {compiled} compiled, {matching} matching"
    if failing:
        value += f"; failing: {', '.join(failing)}"
    return [dict(group="matrix", configuration="every option value (2-layer engines)",
                 measure="rows compiled and matching", value=value, target="all")]  # fmt: skip


def _never_ran(record: dict) -> bool:
    """A matrix record a killed worker left for a row it never reached."""
    return str(record.get("note") or "").startswith("worker exited")


def gpu_step_figures(name: str, step: dict, meta: dict) -> list[dict]:
    """The figures of one gpu.sh step (``{"status", "seconds", "result"}``: ``result`` is the
    step's own JSON), each stamped with ``meta`` (``tree``, ``date``, ``device``, ``source``,
    ``suite``). An engine step stopped before its engine was built gives its start-up as
    "not built in N s"."""
    result = step.get("result") or {}
    if name in ENGINE_STEPS:
        figures = engine_figures(ENGINE_STEPS[name], result)
        if step.get("status") != "ok" and "startup_seconds" not in result:
            figures.append(dict(group="engine", configuration=ENGINE_STEPS[name], measure=STARTUP,
                                value=f"not built in {step.get('seconds', 0):.0f} s "
                                f"({step.get('status')})"))  # fmt: skip
    elif name == "structured":
        figures = structured_figures(result)
    elif name == "weight_sync":
        figures = weight_sync_figures(result)
    elif name == "server":
        figures = server_figures(result.get("summary") or {}, result.get("api_servers"))
    elif name == "matrix":
        figures = matrix_figures(result, result.get("total_rows"))
    else:
        figures = []
    return [{**f, **meta} for f in figures]
