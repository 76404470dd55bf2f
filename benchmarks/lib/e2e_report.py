"""Tables (markdown) and the plot of docs/benchmarks.md's end-to-end section from the JSON of
``benchmarks/e2e_suite.py`` and the HF baseline's JSON (or, when its process was stopped before
writing JSON, the result lines of its log).

    python benchmarks/lib/e2e_report.py --suite suite.json --hf-log hf.log --plot e2e.png
"""

from __future__ import annotations

import argparse
import json
import re
import sys

# Targets of the end-to-end issue (one H200, Llama-3-8B shape, bf16, dummy weights).
TARGETS = {
    "random_output_tps": 20_000,
    "sharegpt_output_tps": 9_200,
    "batch1_tpot_ms": 4.5,
    "vs_hf_batch1": 15.0,
    "vs_hf_best_random": 2.5,
    "vs_hf_best_sharegpt": 5.0,
    "kv_share": 0.90,
    "fragmentation": 0.04,
}
_HF_LINE = re.compile(r"^HF (random \S+|sharegpt-synthetic) batch (\d+): ([\d.]+) output tokens/s")


def hf_from_log(text: str) -> dict:
    """``{"random": {B: tok/s}, "sharegpt-synthetic": {B: tok/s}}`` from the baseline's lines."""
    runs: dict = {"random": {}, "sharegpt-synthetic": {}}
    for line in text.splitlines():
        match = _HF_LINE.match(line.strip())
        if match:
            workload = "random" if match[1].startswith("random") else "sharegpt-synthetic"
            runs[workload][int(match[2])] = float(match[3])
    return runs


def hf_from_json(data: dict) -> dict:
    runs: dict = {"random": {}, "sharegpt-synthetic": {}}
    for workload in runs:
        for run in data.get(workload, {}).get("runs", []):
            if not run.get("oom"):
                runs[workload][run["batch_size"]] = run["output_tokens_per_second"]
    return runs


def targets_table(suite: dict, hf: dict) -> list[str]:
    """Each target's measured value and ratio (>= 1 means met) as markdown rows."""
    random, sharegpt, latency = suite["random"], suite["sharegpt-synthetic"], suite["latency"]
    tpot_ms = 1000 * latency["avg_tpot_seconds"]
    budget = suite["kv_cache"]["budget"]
    kv_share = suite["kv_cache"]["bytes"] / (budget["requested"] - budget["peak"])
    hf_random, hf_sharegpt = hf["random"], hf["sharegpt-synthetic"]
    rows = [
        (
            "Offline 1000 × 128/128, output tok/s",
            random["output_tokens_per_second"],
            f"≥ {TARGETS['random_output_tps']:,}",
            random["output_tokens_per_second"] / TARGETS["random_output_tps"],
        ),
        (
            "Offline 1000 ShareGPT-like, output tok/s",
            sharegpt["output_tokens_per_second"],
            f"≥ {TARGETS['sharegpt_output_tps']:,}",
            sharegpt["output_tokens_per_second"] / TARGETS["sharegpt_output_tps"],
        ),
        (
            "Batch-1 TPOT (128 in / 128 out), ms",
            tpot_ms,
            f"≤ {TARGETS['batch1_tpot_ms']}",
            TARGETS["batch1_tpot_ms"] / tpot_ms,
        ),
    ]
    if 1 in hf_random:
        ratio = (1 / latency["avg_tpot_seconds"]) / hf_random[1]
        rows.append(
            (
                "vs HF batch 1 (decode tok/s)",
                ratio,
                f"≥ {TARGETS['vs_hf_batch1']}×",
                ratio / TARGETS["vs_hf_batch1"],
            )
        )
    if hf_random:
        ratio = random["output_tokens_per_second"] / max(hf_random.values())
        rows.append(
            (
                "vs HF best batch, 128/128",
                ratio,
                f"≥ {TARGETS['vs_hf_best_random']}×",
                ratio / TARGETS["vs_hf_best_random"],
            )
        )
    if hf_sharegpt:
        ratio = sharegpt["output_tokens_per_second"] / max(hf_sharegpt.values())
        rows.append(
            (
                "vs HF best measured batch, ShareGPT-like",
                ratio,
                f"≥ {TARGETS['vs_hf_best_sharegpt']}×",
                ratio / TARGETS["vs_hf_best_sharegpt"],
            )
        )
    rows.append(
        (
            "KV cache share of memory left after weights + activations",
            kv_share,
            f"≥ {TARGETS['kv_share']:.0%}",
            kv_share / TARGETS["kv_share"],
        )
    )
    frag = max(random["fragmentation"], sharegpt["fragmentation"])
    rows.append(
        (
            "Internal fragmentation (worse workload, mean over the run)",
            frag,
            f"< {TARGETS['fragmentation']:.0%}",
            TARGETS["fragmentation"] / frag,
        )
    )
    lines = ["| Target | Measured | Goal | Ratio to goal |", "|---|---|---|---|"]
    for name, value, goal, ratio in rows:
        shown = (
            f"{value:.1%}"
            if value < 1.5 and "share" in name or "fragmentation" in name
            else f"{value:,.2f}"
        )
        lines.append(f"| {name} | {shown} | {goal} | {ratio:.2f} {'✓' if ratio >= 1 else '✗'} |")
    return lines


def plot(suite: dict, hf: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, workload, title, target in (
        (axes[0], "random", "1000 × 128 in / 128 out", TARGETS["random_output_tps"]),
        (
            axes[1],
            "sharegpt-synthetic",
            "1000 ShareGPT-like (≈200 / ≈200)",
            TARGETS["sharegpt_output_tps"],
        ),
    ):
        labels = [f"HF B={b}" for b in sorted(hf[workload])] + ["jaxpaged"]
        values = [hf[workload][b] for b in sorted(hf[workload])]
        values.append(suite[workload]["output_tokens_per_second"])
        colors = ["#999999"] * (len(values) - 1) + ["#1f77b4"]
        bars = ax.bar(labels, values, color=colors)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.axhline(target, color="#d62728", linestyle="--", linewidth=1, label="target")
        ax.set_yscale("log")
        ax.set_ylabel("output tokens/s")
        ax.set_title(title)
        ax.legend(loc="upper left", fontsize=8)
    fig.suptitle("Llama-3-8B shape, bf16, dummy weights, one H200: jaxpaged vs HF generate")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", required=True, help="suite.json of benchmarks/e2e_suite.py")
    parser.add_argument("--hf-json", default=None, help="JSON of benchmarks/hf_baseline.py")
    parser.add_argument("--hf-log", default=None, help="its log, when it wrote no JSON")
    parser.add_argument("--plot", default=None, help="write the PNG plot here")
    args = parser.parse_args(argv)
    with open(args.suite) as f:
        suite = json.load(f)
    if args.hf_json:
        with open(args.hf_json) as f:
            hf = hf_from_json(json.load(f))
    elif args.hf_log:
        with open(args.hf_log) as f:
            hf = hf_from_log(f.read())
    else:
        hf = {"random": {}, "sharegpt-synthetic": {}}
    for line in targets_table(suite, hf):
        print(line)
    if args.plot:
        plot(suite, hf, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
