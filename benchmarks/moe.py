"""The MoE layer's grouped expert matmuls at a real config's shapes, against the H200's ceiling.

For each token count ``T`` and each ``pallas_kernels.grouped_matmul`` backend (``xla``: XLA's
ragged dot, which XLA:GPU expands densely; ``mosaic_gpu``: JAX's Hopper grouped GEMM, the one
the model uses on GPU in bf16): one ``models.moe`` layer (router, top-k, sort by expert, grouped
gate/up and down, un-sort, weighted sum) on random bf16 inputs and weights, timed on the device.
Its matmul work is ``2 * T * k * 3 * hidden * I`` FLOPs (the active parameters' ceiling: only
the chosen experts count), reported as TFLOP/s and as a fraction of the dense bf16 peak
(``--peak-tflops``, 716 for what the H200 reaches on large GEMMs). Next to it, the same FLOPs
as two plain GEMMs (``[T * k, hidden] x [hidden, 2I]`` and ``[T * k, I] x [I, hidden]``, as if
every row went to one expert): what XLA's best GEMM does at that shape. The two backends'
outputs are compared (max |difference| / max |output|) at every ``T``.

``--smoke`` runs a tiny config on CPU with the ``xla`` and (interpreted) ``gemv`` backends only
(checks the script).

``--sweep`` (GPU; ``--smoke --sweep`` runs its code paths on CPU with stand-ins) times the
grouped GEMM's tiles (``pallas_kernels.grouped_matmul.MosaicTiles``) on the model's two grouped
matmuls as the model calls them (``[M, hidden] x [E, hidden, 2I]`` and ``[M, I] x [E, I,
hidden]``, ``transpose_rhs=False``, ``M = T * k`` rows sorted by expert from a random routing),
all within ``--budget-s`` seconds (compiles included; the stages run in priority order and stop
launching configs at the deadline):

1. T = 1024: every tile config of the grid that fits in shared memory (``grid_block_n`` 1);
   a config that fails to compile prints one line and is skipped.
2. T = 1024: ``grid_block_n`` 2, 4, 8 on the best three of each matmul.
3. Decode, T = 1, 4, 16, 64: the whole MoE layer through the grouped GEMM against
   ``"gemv"`` (``pallas_kernels.expert_gemv``, chosen experts' weights only) and a few of its
   tilings, with the active-weight floor at ``--hbm-tbps``.
4. The whole layer at T = 1024 with the winners pasted into the tile table, against the
   default tiles and plain GEMMs.
5. T = 256 and 4096: the best three of step 1/2 and the default; then the whole layer there.

Every config's output is compared with XLA's ragged dot on the same inputs (max |difference| /
max |reference|); one above 2e-2 is marked wrong and never wins. The end prints sorted tables
(% of ``--peak-tflops`` on that matmul's FLOPs, ``2 * M * K * N``), ``TILE_TABLE`` entries to
paste into ``pallas_kernels/grouped_matmul.py``, and writes everything to ``--output-json``.
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
    parser.add_argument(
        "--backends",
        nargs="+",
        default=["xla", "mosaic_gpu"],
        help="of models.moe.grouped_swiglu: xla, mosaic_gpu, gemv",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny config on CPU")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--sweep", action="store_true", help="tile sweep (module docstring)")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=125.0,
        help="--sweep's time budget, compiles included (JAX start-up not)",
    )
    parser.add_argument("--hbm-tbps", type=float, default=4.3, help="for the decode floor")
    args = parser.parse_args()
    if args.sweep:
        from benchmarks.moe_sweep import sweep  # noqa: PLC0415 - only the sweep needs it

        sweep(args, _shapes(args))
        return
    cfg = _shapes(args)
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    num_experts, top_k = cfg["num_local_experts"], cfg["num_experts_per_tok"]
    dtype = jnp.float32 if args.smoke else jnp.bfloat16
    keys = jax.random.split(jax.random.key(0), 6)
    gate_up = (0.02 * jax.random.normal(keys[0], (num_experts, hidden, 2 * inter))).astype(dtype)
    down = (0.02 * jax.random.normal(keys[1], (num_experts, inter, hidden))).astype(dtype)
    router = (0.02 * jax.random.normal(keys[2], (hidden, num_experts))).astype(dtype)
    precision = jax.lax.Precision.DEFAULT

    def make_moe(backend):
        @jax.jit
        def moe(x, router, gate_up, down):
            weights, ids = route(x @ router, top_k)
            return grouped_swiglu(x, weights, ids, gate_up, down, precision=precision,
                                  backend=backend, interpret=args.smoke)  # fmt: skip

        return moe

    @jax.jit
    def dense(rows, w_gate_up, w_down):
        h = rows @ w_gate_up
        g, u = jnp.split(h, 2, axis=-1)
        return (jax.nn.silu(g) * u) @ w_down

    backends = ["xla", "gemv"] if args.smoke else args.backends
    results = []
    print(f"device: {jax.devices()[0].device_kind}; hidden {hidden}, I {inter}, "
          f"E {num_experts}, k {top_k}, dtype {jnp.dtype(dtype).name}")  # fmt: skip
    print(f"{'T':>6} {'backend':>11} {'ms':>9} {'TFLOP/s':>8} {'of peak':>8} {'vs xla':>8}")
    for num_tokens in args.batch_sizes:
        x = jax.random.normal(jax.random.fold_in(keys[3], num_tokens), (num_tokens, hidden))
        x = x.astype(dtype)
        flops = 2.0 * num_tokens * top_k * 3 * hidden * inter
        outputs = {}
        for backend in backends:
            try:
                moe = make_moe(backend)
                outputs[backend] = np.asarray(moe(x, router, gate_up, down), np.float32)
                seconds = _time(moe, x, router, gate_up, down, iters=args.iters)
            except Exception as e:  # noqa: BLE001 - a failing backend is a result too
                print(f"{num_tokens:>6} {backend:>11} failed: {str(e)[:400]}")
                results.append(dict(num_tokens=num_tokens, backend=backend, error=str(e)[:2000]))
                continue
            diff = None
            if backend != "xla" and "xla" in outputs:
                ref = outputs["xla"]
                diff = float(np.max(np.abs(outputs[backend] - ref)) / np.max(np.abs(ref)))
            tflops = flops / seconds / 1e12
            results.append(dict(num_tokens=num_tokens, backend=backend, seconds=seconds,
                                tflops=tflops, fraction_of_peak=tflops / args.peak_tflops,
                                relative_diff_vs_xla=diff))  # fmt: skip
            print(f"{num_tokens:>6} {backend:>11} {seconds * 1e3:>9.3f} {tflops:>8.1f} "
                  f"{tflops / args.peak_tflops:>8.1%} "
                  f"{'' if diff is None else format(diff, '.1e'):>8}")  # fmt: skip
        rows = jnp.tile(x, (top_k, 1))
        seconds = _time(dense, rows, gate_up[0], down[0], iters=args.iters)
        tflops = flops / seconds / 1e12
        results.append(dict(num_tokens=num_tokens, backend="plain GEMMs", seconds=seconds,
                            tflops=tflops, fraction_of_peak=tflops / args.peak_tflops))  # fmt: skip
        print(f"{num_tokens:>6} {'plain GEMMs':>11} {seconds * 1e3:>9.3f} {tflops:>8.1f} "
              f"{tflops / args.peak_tflops:>8.1%}")  # fmt: skip
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(dict(config=cfg, results=results), f, indent=1)


if __name__ == "__main__":
    main()
