"""The table of benchmarks/server.sh: served vs offline and the latency targets
of docs/benchmarks.md's serving and late-scheduling sections, the server's own latency split,
and the request-life trace
(``trace.json`` of ``scripts/trace_request_life.py``) when there is one. Prints the table and
writes it as ``OUT_DIR/summary.json``. Usage: ``python benchmarks/lib/server_summary.py OUT_DIR``."""

from __future__ import annotations

import json
import pathlib
import sys


def main(out_dir: str) -> int:
    out = pathlib.Path(out_dir)

    def load(name):
        path = out / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else None

    offline, saturation = load("offline"), load("saturation")
    rate, concurrent = load("rate20"), load("concurrent16")
    rows = []  # (measure, value, target, ratio to target; > 1 is better)
    if offline and saturation:
        served, alone = saturation["output_throughput"], offline["output_tokens_per_second"]
        rows.append(("offline output tok/s (1000 x 128/128)", alone, None, None))
        rows.append(("served output tok/s, rate inf", served, None, None))
        rows.append(("served / offline", served / alone, 0.90, served / alone / 0.90))
    for name, data, key, target in (
        ("P99 TTFT ms, 20 req/s 512/128", rate, "p99_ttft_ms", 60.0),
        ("P99 TPOT ms, 20 req/s 512/128", rate, "p99_tpot_ms", 10.0),
        ("mean TPOT ms, 16 clients 50/128", concurrent, "mean_tpot_ms", 4.6),
    ):
        if data:
            rows.append((name, data[key], target, target / max(data[key], 1e-9)))
    for name, data in (("saturation", saturation), ("rate20", rate), ("concurrent16", concurrent)):
        if data and data.get("failed"):
            rows.append((f"FAILED requests in {name}", data["failed"], 0, None))
    print(f"{'measure':42} {'value':>10} {'target':>8} {'ratio':>7}")
    for measure, value, target, ratio in rows:
        target_s = "" if target is None else f"{target:g}"
        ratio_s = "" if ratio is None else f"{ratio:.2f}"
        print(f"{measure:42} {value:10.2f} {target_s:>8} {ratio_s:>7}")
    server_side = [(name, server_means(out, name)) for name in ("rate20", "concurrent16")]
    trace = load("trace")
    summary = {
        "rows": [{"measure": m, "value": v, "target": t, "ratio": r} for m, v, t, r in rows],
        "server_side_ms": {name: means for name, means in server_side},
        "trace": None
        if trace is None
        else {
            variant: {
                load: {"client": result["client"], "summary": result["summary"]}
                for load, result in loads.items()
            }
            for variant, loads in trace["results"].items()
        },
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if trace is not None:
        print_trace(summary["trace"])
    if any(means for _, means in server_side):
        print("\nserver-side means over each run, ms (the server's histograms, after - before)")
        print(f"{'run':14}" + "".join(f"{label:>14}" for label in SERVER_HISTOGRAMS.values()))
        for name, means in server_side:
            if means:
                print(
                    f"{name:14}"
                    + "".join(f"{means.get(h, float('nan')):14.2f}" for h in SERVER_HISTOGRAMS)
                )
    return 0


def print_trace(trace: dict) -> None:
    """One row per traced variant (late scheduling; eager: without it) and load."""
    print("\nrequest-life trace, the engine core alone under the same loads (trace.json)")
    print(
        f"{'variant load':22} {'client TTFT p50/p99':>20} {'arrival->out p50/p99':>20} "
        f"{'TPOT mean':>9} {'idle':>6}  lag (scheduled - running step at arrival)"
    )
    for variant, loads in trace.items():
        for load, result in loads.items():
            client, summary = result["client"], result["summary"]
            core = summary["segments"]["ttft_ms"]
            print(
                f"{variant + ' ' + load:22} "
                f"{client['ttft_ms']['p50']:9.1f}/{client['ttft_ms']['p99']:<10.1f} "
                f"{core['p50']:9.1f}/{core['p99']:<10.1f} {client['tpot_ms']['mean']:9.2f} "
                f"{100 * summary['device_idle_fraction']:5.1f}%  {summary['lags']}"
            )


# Server histograms (jaxpaged.metrics, vLLM's names) whose means split the client's TTFT:
# arrival at the API process -> scheduled (queue) -> first token (prefill) -> the later tokens.
SERVER_HISTOGRAMS = {
    "time_to_first_token_seconds": "TTFT",
    "request_queue_time_seconds": "queue",
    "request_prefill_time_seconds": "prefill",
    "inter_token_latency_seconds": "ITL",
}


def _sums(path: pathlib.Path) -> dict[str, tuple[float, float]]:
    """``{histogram: (sum, count)}`` over every label set, from Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(path.read_text()):
        for sample in family.samples:
            for histogram in SERVER_HISTOGRAMS:
                for suffix, slot in (("_sum", 0), ("_count", 1)):
                    if sample.name.endswith(histogram + suffix):
                        totals.setdefault(histogram, [0.0, 0.0])[slot] += sample.value
    return {name: (total[0], total[1]) for name, total in totals.items()}


def server_means(out: pathlib.Path, name: str) -> dict[str, float]:
    """Mean ms of each server histogram over one benchmark run (empty if not scraped)."""
    before, after = out / f"{name}.before.prom", out / f"{name}.after.prom"
    if not (before.exists() and after.exists()):
        return {}
    old, new = _sums(before), _sums(after)
    means = {}
    for histogram, (total, count) in new.items():
        total0, count0 = old.get(histogram, (0.0, 0.0))
        if count > count0:
            means[histogram] = 1000 * (total - total0) / (count - count0)
    return means


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
