"""The table of benchmarks/results/server-split/run.sh: served vs offline and the latency targets
of issue 13. Usage: ``python summarize.py OUT_DIR``."""

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
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
