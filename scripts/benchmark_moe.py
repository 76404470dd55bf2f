"""The MoE layer's grouped expert matmuls at a real config's shapes, against the H200's ceiling.

For each token count ``T``: one ``models.moe`` layer (router, top-k, sort by expert,
``jax.lax.ragged_dot`` gate/up and down, un-sort, weighted sum) on random bf16 inputs and
weights, timed on the device; its matmul work is ``2 * T * k * 3 * hidden * I`` FLOPs (the
active parameters' ceiling: only the chosen experts count), reported as TFLOP/s and as a
fraction of the dense bf16 peak (``--peak-tflops``, 716 for what the H200 reaches on large
GEMMs). Next to it, the same FLOPs as two plain GEMMs (``[T * k, hidden] x [hidden, 2I]`` and
``[T * k, I] x [I, hidden]``, as if every row went to one expert): what XLA's best GEMM does at
that shape. On GPU, ``--try-mgpu`` also times JAX's Mosaic GPU grouped GEMM
(``jax.experimental.pallas.ops.gpu.ragged_dot_mgpu``) on the gate/up matmul.

``--smoke`` runs a tiny config on CPU (checks the script, measures nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from models.moe import grouped_swiglu, route  # noqa: E402


def _time(fn, *args, iters: int) -> float:
    """Median seconds of ``fn(*args)`` over ``iters`` runs after two warm-up runs."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _shapes(args) -> dict:
    if args.smoke:
        return dict(hidden_size=64, intermediate_size=96, num_local_experts=8,
                    num_experts_per_tok=2, num_hidden_layers=2)  # fmt: skip
    with open(os.path.join(args.model, "config.json")) as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="benchmarks/configs/mixtral-8x7b-instruct-v0.1")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256, 1024, 4096])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--peak-tflops", type=float, default=716.0)
    parser.add_argument("--try-mgpu", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny config on CPU")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    cfg = _shapes(args)
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    num_experts, top_k = cfg["num_local_experts"], cfg["num_experts_per_tok"]
    dtype = jnp.float32 if args.smoke else jnp.bfloat16
    keys = jax.random.split(jax.random.key(0), 6)
    gate_up = (0.02 * jax.random.normal(keys[0], (num_experts, hidden, 2 * inter))).astype(dtype)
    down = (0.02 * jax.random.normal(keys[1], (num_experts, inter, hidden))).astype(dtype)
    router = (0.02 * jax.random.normal(keys[2], (hidden, num_experts))).astype(dtype)
    precision = jax.lax.Precision.DEFAULT

    @jax.jit
    def moe(x, router, gate_up, down):
        weights, ids = route(x @ router, top_k)
        return grouped_swiglu(x, weights, ids, gate_up, down, precision=precision)

    @jax.jit
    def dense(rows, w_gate_up, w_down):
        h = rows @ w_gate_up
        g, u = jnp.split(h, 2, axis=-1)
        return (jax.nn.silu(g) * u) @ w_down

    results = []
    print(f"device: {jax.devices()[0].device_kind}; hidden {hidden}, I {inter}, "
          f"E {num_experts}, k {top_k}, dtype {jnp.dtype(dtype).name}")  # fmt: skip
    header = (f"{'T':>6} {'moe ms':>9} {'TFLOP/s':>8} {'of peak':>8} {'dense ms':>9} "
              f"{'TFLOP/s':>8} {'moe/dense':>9}")  # fmt: skip
    print(header)
    for num_tokens in args.batch_sizes:
        x = jax.random.normal(jax.random.fold_in(keys[3], num_tokens), (num_tokens, hidden))
        x = x.astype(dtype)
        flops = 2.0 * num_tokens * top_k * 3 * hidden * inter
        t_moe = _time(moe, x, router, gate_up, down, iters=args.iters)
        rows = jnp.tile(x, (top_k, 1))
        t_dense = _time(dense, rows, gate_up[0], down[0], iters=args.iters)
        row = dict(
            num_tokens=num_tokens,
            moe_seconds=t_moe,
            moe_tflops=flops / t_moe / 1e12,
            moe_fraction_of_peak=flops / t_moe / 1e12 / args.peak_tflops,
            dense_seconds=t_dense,
            dense_tflops=flops / t_dense / 1e12,
        )
        results.append(row)
        print(f"{num_tokens:>6} {t_moe * 1e3:>9.3f} {row['moe_tflops']:>8.1f} "
              f"{row['moe_fraction_of_peak']:>8.1%} {t_dense * 1e3:>9.3f} "
              f"{row['dense_tflops']:>8.1f} {t_moe / t_dense:>9.2f}")  # fmt: skip

    if args.try_mgpu and jax.devices()[0].platform == "gpu":
        _try_mgpu(gate_up, hidden, inter, num_experts, top_k, keys[4], args, results)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(dict(config=cfg, results=results), f, indent=1)


def _try_mgpu(gate_up, hidden, inter, num_experts, top_k, key, args, results) -> None:
    """JAX's Mosaic GPU grouped GEMM on the gate/up matmul at the largest T (information for
    choosing a kernel; failures are printed, not raised)."""
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    except Exception as e:  # noqa: BLE001 - report and go on
        print(f"mgpu ragged_dot unavailable: {e!r}")
        return
    num_tokens = max(args.batch_sizes)
    m = num_tokens * top_k
    lhs = jax.random.normal(key, (m, hidden)).astype(jnp.bfloat16)
    ids = jax.random.randint(jax.random.fold_in(key, 1), (m,), 0, num_experts)
    group_sizes = jnp.bincount(ids, length=num_experts).astype(jnp.int32)
    flops = 2.0 * m * hidden * 2 * inter
    ref = _time(jax.jit(lambda a, b, g: jax.lax.ragged_dot(a, b, g)), lhs, gate_up, group_sizes,
                iters=args.iters)  # fmt: skip
    print(f"gate/up only, T={num_tokens}: lax.ragged_dot {ref * 1e3:.3f} ms "
          f"({flops / ref / 1e12:.1f} TFLOP/s)")  # fmt: skip
    for block_m, block_n, steps, grid_n in [(128, 128, 4, 1), (128, 256, 4, 1), (64, 128, 4, 2)]:
        try:
            fn = jax.jit(lambda a, b, g, bm=block_m, bn=block_n, s=steps, gn=grid_n:
                         ragged_dot_mgpu.ragged_dot(a, b, group_sizes=g, block_m=bm, block_n=bn,
                                                    block_k=64, max_concurrent_steps=s,
                                                    grid_block_n=gn))  # fmt: skip
            t = _time(fn, lhs, gate_up, group_sizes, iters=args.iters)
            print(f"  mgpu block_m={block_m} block_n={block_n} steps={steps} grid_n={grid_n}: "
                  f"{t * 1e3:.3f} ms ({flops / t / 1e12:.1f} TFLOP/s)")  # fmt: skip
            results.append(dict(mgpu=[block_m, block_n, steps, grid_n], seconds=t,
                                tflops=flops / t / 1e12, ragged_dot_seconds=ref))  # fmt: skip
        except Exception as e:  # noqa: BLE001 - one failing configuration is information
            print(f"  mgpu block_m={block_m} block_n={block_n}: failed: {str(e)[:300]}")


if __name__ == "__main__":
    main()
