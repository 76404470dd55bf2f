"""The table of ``benchmarks/quantization.sh``: each configuration's figures, its ratio to bf16 and issue 14's targets.

    python benchmarks/lib/quantization_summary.py OUT       # reads OUT/<row>/suite.json
    python benchmarks/lib/quantization_summary.py --smoke-configs DIR   # quantization.sh --smoke

``--smoke-configs`` writes the CPU smoke run's config-only directories: ``tiny`` (a 2-layer
Llama, 128 wide, so the W4A16 kernel tiles every layer with groups of 32) and ``tiny-awq`` /
``tiny-gptq`` / ``tiny-w8a8-int8`` with the ``quantization_config`` of
``benchmarks/configs/llama-3-8b-awq`` / ``-gptq`` / ``-w8a8-int8`` (4-bit group size 32).
"""

from __future__ import annotations

import json
import pathlib
import sys

ROWS = {  # row -> label
    "bf16": "bf16",
    "fp8": "FP8 W8A8 (online) + FP8 KV",
    "int8": "INT8 W8A8 (compressed-tensors)",
    "awq-xla": "W4A16 AWQ, XLA",
    "awq-pallas": "W4A16 AWQ, Pallas kernel",
}
# Issue 14's H200 targets: (row, metric) -> (kind, value); kind "min"/"max" absolute,
# "ratio" at least this multiple of bf16's figure.
TARGETS = {
    ("fp8", "random"): ("min", 28_000),
    ("fp8", "sharegpt-synthetic"): ("min", 15_000),
    ("fp8", "tpot_ms"): ("max", 2.4),
    ("int8", "random"): ("ratio", 1.4),
    ("awq-xla", "random"): ("ratio", 0.9),
    ("awq-xla", "tpot_ms"): ("max", 1.6),
    ("awq-pallas", "random"): ("ratio", 0.9),
    ("awq-pallas", "tpot_ms"): ("max", 1.6),
}
METRICS = {
    "random": "1000x128/128 output tok/s",
    "sharegpt-synthetic": "ShareGPT-like output tok/s",
    "tpot_ms": "batch-1 TPOT ms",
}


def figures(suite: dict) -> dict:
    out = {}
    for workload in ("random", "sharegpt-synthetic"):
        if workload in suite:
            out[workload] = suite[workload]["output_tokens_per_second"]
    if "latency" in suite:
        out["tpot_ms"] = 1e3 * suite["latency"]["avg_tpot_seconds"]
    return out


def check(row: str, metric: str, value: float, base: dict) -> str:
    if (row, metric) not in TARGETS:
        return ""
    kind, target = TARGETS[row, metric]
    if kind == "ratio":
        if metric not in base:
            return f">= {target}x bf16: no bf16 figure"
        ok = value >= target * base[metric]
        return f">= {target}x bf16: {'yes' if ok else 'NO'}"
    ok = value >= target if kind == "min" else value <= target
    return f"{'>=' if kind == 'min' else '<='} {target:,}: {'yes' if ok else 'NO'}"


def summarize(out_dir: pathlib.Path) -> None:
    results = {}
    for row in ROWS:
        path = out_dir / row / "suite.json"
        if path.exists():
            results[row] = json.loads(path.read_text())
    base = figures(results["bf16"]) if "bf16" in results else {}
    print(f"{'configuration':<32} {'metric':<28} {'value':>10} {'/ bf16':>7}  target")
    for row, label in ROWS.items():
        if row not in results:
            print(f"{label:<32} (no result: see {row}.log)")
            continue
        suite = results[row]
        got = figures(suite)
        for metric, name in METRICS.items():
            if metric not in got:
                continue
            value = got[metric]
            ratio = f"{value / base[metric]:.2f}x" if base.get(metric) else ""
            shown = f"{value:,.0f}" if metric != "tpot_ms" else f"{value:.3f}"
            print(f"{label:<32} {name:<28} {shown:>10} {ratio:>7}  {check(row, metric, value, base)}")
        print(f"{'':<32} start-up {suite.get('startup_seconds', 0):.1f} s (compile "
              f"{suite.get('compile_seconds') or 0:.1f} s, {suite.get('num_buckets')} buckets); "
              f"{suite.get('kv_cache', {}).get('report', '')}")


def smoke_configs(root: pathlib.Path) -> None:
    repo = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "configs"
    tiny = json.loads((repo / "llama-3-8b" / "config.json").read_text())
    tiny.update(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512,
                bos_token_id=1, eos_token_id=2, max_position_embeddings=256)  # fmt: skip
    for name, source in (("tiny", None), ("tiny-awq", "llama-3-8b-awq"),
                         ("tiny-gptq", "llama-3-8b-gptq"),
                         ("tiny-w8a8-int8", "llama-3-8b-w8a8-int8")):  # fmt: skip
        config = dict(tiny)
        if source is not None:
            quant = json.loads((repo / source / "config.json").read_text())["quantization_config"]
            if "group_size" in quant:
                quant = {**quant, "group_size": 32}
            config["quantization_config"] = quant
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / "config.json").write_text(json.dumps(config, indent=1))


if __name__ == "__main__":
    if sys.argv[1] == "--smoke-configs":
        smoke_configs(pathlib.Path(sys.argv[2]))
    else:
        summarize(pathlib.Path(sys.argv[1]))
