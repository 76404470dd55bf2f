"""One table for the model-family benchmarks: throughput and batch-1 TPOT next to weight-read floors.

For each ``--run NAME MODEL_DIR SUITE_JSON`` (``SUITE_JSON`` written by
``benchmarks/e2e_suite.py --workloads random latency``): parameter count and bf16 weight
bytes from the model built abstractly (``nnx.eval_shape``: exact shapes, nothing allocated);
for a mixture of experts also the *active* bytes (every non-expert parameter plus ``k / E`` of
the expert weights: what one token reads). Floors at ``--bandwidth`` (4.3 TB/s, the H200's
measured copy bandwidth):

- batch-1 TPOT floor: active weight bytes / bandwidth (a decode step must read every weight
  the token uses at least once; KV reads at 128 + 128 tokens are negligible);
- throughput run: its mean step time next to the all-weights read time (at ~1000 sequences
  every expert is read each step).

``--moe-json`` (``benchmarks/moe.py``) adds the MoE layer's utilisation per backend at
each token count against the active-parameter ceiling ``2 * T * k * 3 * hidden * I / peak``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from models.registry import get_model_class  # noqa: E402
from models.weights import is_expert_param, load_config  # noqa: E402

BF16_BYTES = 2


def weight_counts(model_dir: str) -> tuple[int, int]:
    """``(all parameters, parameters one token uses)`` of the model in ``model_dir``."""
    config = load_config(model_dir)
    cls = get_model_class(config)
    model = nnx.eval_shape(
        lambda: cls(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    )
    total = active = 0
    num_experts = int(getattr(config, "num_local_experts", 0) or 0)
    top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        n = math.prod(variable.get_value().shape)
        total += n
        active += n * top_k // num_experts if is_expert_param(path) else n
    return total, active


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", nargs=3, action="append", default=[],
                        metavar=("NAME", "MODEL_DIR", "SUITE_JSON"))  # fmt: skip
    parser.add_argument("--moe-json", default=None)
    parser.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s")
    parser.add_argument("--peak-tflops", type=float, default=716.0)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    rows = []
    print("| model | params | weights GB (active) | output tok/s | ms/step (floor) | "
          "batch-1 TPOT ms (floor) | TPOT / floor |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, model_dir, suite_json in args.run:
        total, active = weight_counts(model_dir)
        row = dict(name=name, params=total, active_params=active)
        floor_all = total * BF16_BYTES / args.bandwidth
        floor_active = active * BF16_BYTES / args.bandwidth
        row.update(step_floor_ms=floor_all * 1e3, tpot_floor_ms=floor_active * 1e3)
        suite = {}
        if os.path.isfile(suite_json):
            with open(suite_json) as f:
                suite = json.load(f)
        random_run, latency = suite.get("random", {}), suite.get("latency", {})
        tok_s = random_run.get("output_tokens_per_second")
        steps = random_run.get("num_steps")
        step_ms = random_run["elapsed_time"] / steps * 1e3 if steps else None
        tpot = latency.get("avg_tpot_seconds") or latency.get("time_per_output_token")
        tpot_ms = tpot * 1e3 if tpot else None
        row.update(output_tokens_per_second=tok_s, step_ms=step_ms, tpot_ms=tpot_ms)
        rows.append(row)

        def fmt(x, spec):
            return "n/a" if x is None else format(x, spec)

        active_gb = "" if active == total else f" ({active * BF16_BYTES / 1e9:.1f})"
        ratio = None if tpot_ms is None else tpot_ms / row["tpot_floor_ms"]
        print(f"| {name} | {total / 1e9:.2f} B | {total * BF16_BYTES / 1e9:.1f}{active_gb} | "
              f"{fmt(tok_s, ',.0f')} | {fmt(step_ms, '.1f')} ({floor_all * 1e3:.1f}) | "
              f"{fmt(tpot_ms, '.2f')} ({floor_active * 1e3:.2f}) | {fmt(ratio, '.2f')} |")  # fmt: skip

    if args.moe_json and os.path.isfile(args.moe_json):
        with open(args.moe_json) as f:
            moe = json.load(f)
        print("\nMoE layer (router + sort + grouped gate/up + down), bf16, "
              f"vs {args.peak_tflops:.0f} TFLOP/s:")  # fmt: skip
        print("| T | backend | ms | TFLOP/s | of ceiling | rel. diff vs xla |")
        print("|---|---|---|---|---|---|")
        for r in moe["results"]:
            if "error" in r:
                print(f"| {r['num_tokens']} | {r['backend']} | failed | | | |")
                continue
            diff = r.get("relative_diff_vs_xla")
            print(f"| {r['num_tokens']} | {r['backend']} | {r['seconds'] * 1e3:.3f} | "
                  f"{r['tflops']:.1f} | {r['fraction_of_peak']:.1%} | "
                  f"{'' if diff is None else format(diff, '.1e')} |")  # fmt: skip
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
