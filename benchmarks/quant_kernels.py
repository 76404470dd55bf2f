"""Quantized-linear kernels against bf16 and the hardware ceilings, one process.

``python benchmarks/quant_kernels.py --out quant_kernels.json`` (H200: about 4 minutes;
``--budget-s`` bounds the sweep). ``--tiny`` runs tiny shapes on any backend (interpret mode
off a GPU) as a smoke test.

What it measures, in this order:

1. Ceilings: copy bandwidth (``y = x + 1`` over a 2 GiB ``uint32`` array: bytes read plus
   written per second) and the bf16 and FP8 matmul rates (8192^3 ``jnp.dot``, FP8 with a float32
   result: cuBLASLt's FP8 GEMM on Hopper).
2. Llama-3-8B's layer (``qkv`` 4096->6144, ``o`` 4096->4096, ``gate_up`` 4096->28672, ``down``
   14336->4096), applied for ``--layers`` distinct layers in one jitted chain (weights stream
   from HBM: one 4-bit layer is 113 MB, past the 50 MB L2), per kernel and T:

   - ``bf16``: ``x @ W`` by XLA;
   - ``awq-xla``: AutoAWQ GEMM tensors through ``awq_linear`` (XLA fuses the unpack);
   - ``w4a16-xla``: the same weights repacked (``awq_to_kernel``) through ``w4a16_xla_linear``,
     what ``linear_backend="auto"`` runs where its table says ``xla``;
   - ``w4a16``: the same repacked weights through the Pallas kernel, sweeping
     ``W4A16Tiling``s (decode tilings for T <= 32, prefill tilings above);
   - ``w4a16-wgmma``: the same repacked weights through the Hopper tensor-core kernel
     (``pallas_kernels.w4a16_wgmma``, Mosaic GPU; T >= 64), sweeping ``WgmmaTiling``s; its
     first GPU compile and check happen here;
   - ``w8gemv-fp8`` / ``w8gemv-int8``: the weight-only 8-bit GEMV (T <= 32), sweeping
     ``W8GemvTiling``s;
   - ``fp8-w8a8`` / ``int8-w8a8``: XLA's W8A8 (dynamic per-token activation quantization, then
     the 8-bit GEMM: cuBLASLt FP8 / INT8).

Each configuration's first call is checked against its family's plain-JAX reference chain
(``w4a16_matmul_reference`` / ``w8_gemv_reference`` on the same weights, float32): the largest
error relative to the largest output is printed; above 5e-2 the row is marked ``WRONG``
(bf16 activations through 16 projections differ by about 1e-2 from float32; W8A8 also quantizes
the activations, so its error is reported, not judged). A tiling that fails to compile or run
is recorded with its error and skipped.

Prints a table (µs per layer, time / bf16, weight GB/s, fraction of the copy bandwidth at
T <= 32, TFLOP/s at T >= 256, tiling) with the best tiling per (kernel, T), and the line to
paste into ``models.linear_backends.AUTO_BACKENDS``; ``--out`` writes all of it as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from models.quantization.awq import awq_linear
from models.quantization.w4a16 import awq_to_kernel, w4a16_xla_linear
from models.quantization.w8a8 import FP8_E4M3_MAX, quantize_fp8, quantize_int8, scaled_matmul
from pallas_kernels.w4a16_matmul import (
    W4A16Tiling,
    largest_block_k,
    w4a16_matmul,
    w4a16_matmul_reference,
)
from pallas_kernels.w4a16_wgmma import WgmmaTiling, w4a16_wgmma
from pallas_kernels.w8_gemv import W8GemvTiling, w8_gemv, w8_gemv_reference

FULL = dict(hidden=4096, q=4096, kv=1024, inter=14336)
TINY = dict(hidden=256, q=256, kv=64, inter=512)
GROUP = 128  # --tiny: 32, so that a slot's rows (in / 8 = 32) hold whole groups
WRONG = 5e-2
T4, T8 = W4A16Tiling, W8GemvTiling

# Candidates per kernel and T range, best guess first (the first always runs).
# T = 1: the weights must stream at >= 0.70 of the copy bandwidth. Besides the tile sizes the
# candidates vary what a K-step costs (slots3d: 4 loads instead of 25) and whether a K split
# needs XLA's partial-sum kernel (split_k=1 with narrow output tiles: >= 256 programs at
# out = 4096, and the scale / cast fuse into the consumer).
W4A16_DECODE_1 = [
    T4(block_t=1, block_n=64, block_k=32, dot=False, fold=True, defer=True),
    T4(block_t=1, block_n=64, block_k=16, slots3d=True),
    T4(block_t=1, block_n=16, block_k=32, split_k=1, slots3d=True, num_warps=2),
    T4(block_t=1, block_n=128, block_k=16, slots3d=True, num_warps=8),
    T4(block_t=1, block_n=32, block_k=32, slots3d=True, num_stages=4),
    T4(
        block_t=1, block_n=16, block_k=64, split_k=1, dot=False, fold=True, defer=True, num_warps=2
    ),  # fmt: skip
    T4(block_t=1, block_n=64, block_k=32, dot=False, fold=True),
    T4(block_t=1, block_n=128, block_k=32, split_k=8, dot=False, fold=True, defer=True),
    T4(block_t=1, block_n=64, block_k=64, split_k=4, dot=False, fold=True),
    T4(block_t=1, block_n=128, block_k=32, dot=False),
    T4(block_t=1, block_n=256, block_k=16, split_k=8, dot=False, fold=True, num_warps=8),
    T4(block_t=16, block_n=64, block_k=32, fold=True),
    T4(block_t=16, block_n=128, block_k=32, swap=True),
]
W4A16_DECODE = [
    T4(block_t=32, block_n=64, block_k=32),
    T4(block_t=32, block_n=64, block_k=32, fold=True),
    T4(block_t=32, block_n=128, block_k=32, swap=True),
    T4(block_t=32, block_n=128, block_k=32, split_k=8, num_warps=8),
    T4(block_t=32, block_n=64, block_k=64, num_warps=8, num_stages=4),
]
W4A16_PREFILL = [
    T4(block_t=128, block_n=128, block_k=16, split_k=1, num_warps=8),
    T4(block_t=64, block_n=128, block_k=32, split_k=1, num_warps=4),
    T4(block_t=128, block_n=256, block_k=16, split_k=1, num_warps=8),
    T4(block_t=128, block_n=128, block_k=16, split_k=1, num_warps=8, swap=True),
    T4(block_t=64, block_n=256, block_k=16, split_k=1, num_warps=8, num_stages=4),
    T4(block_t=128, block_n=128, block_k=16, num_warps=8),  # K split when programs are few
]
W4A16_WGMMA = [  # T >= 64 (shared memory: the eight planes' activation tiles dominate)
    WgmmaTiling(tile_m=64, tile_n=64, stages=2),
    WgmmaTiling(tile_m=64, tile_n=128, stages=1),
    WgmmaTiling(tile_m=128, tile_n=64, stages=1),
]
WGMMA_MIN_TOKENS = 64
W8_DECODE_1 = [
    T8(),
    # one program per 16 outputs over the whole K (>= 256 programs, no partial-sum kernel)
    T8(
        max_block_t=1, block_n=16, block_k=1024, split_k=1, dot=False, bits=True, reduce_steps=True
    ),  # fmt: skip
    T8(
        max_block_t=1,
        block_n=16,
        block_k=2048,
        split_k=1,
        dot=False,
        bits=True,
        reduce_steps=True,
        num_warps=8,
    ),  # fmt: skip
    T8(
        max_block_t=1,
        block_n=32,
        block_k=1024,
        split_k=2,
        dot=False,
        bits=True,
        reduce_steps=True,
        num_stages=4,
    ),  # fmt: skip
    T8(max_block_t=1, block_n=32, block_k=256, dot=False, bits=True),
    T8(max_block_t=1, block_n=32, block_k=512, split_k=8, dot=False, bits=True),
    T8(block_n=64, block_k=512, num_warps=8, bits=True),
    T8(block_n=128, block_k=256, split_k=8, num_warps=8, num_stages=4, bits=True),
]
W8_DECODE = [
    T8(max_block_t=32),
    T8(max_block_t=32, block_n=64, block_k=256, num_warps=8, num_stages=4, bits=True),
    T8(max_block_t=32, block_n=128, block_k=128, split_k=8, num_warps=8, bits=True),
]


CANDIDATE_LISTS = {
    "W4A16_DECODE_1": T4,
    "W4A16_DECODE": T4,
    "W4A16_PREFILL": T4,
    "W4A16_WGMMA": WgmmaTiling,
    "W8_DECODE_1": T8,
    "W8_DECODE": T8,
}


def select_tilings(spec: str) -> None:
    """Replace candidate lists (``--tilings``): JSON text or a path to a JSON file mapping a
    list's name to a list of tiling field dicts (each list's first entry always runs).

    Raises:
        ValueError: an unknown list name (the message lists the known ones) or field.
    """
    text = open(spec).read() if not spec.lstrip().startswith("{") else spec
    for name, entries in json.loads(text).items():
        if name not in CANDIDATE_LISTS:
            raise ValueError(f"--tilings: unknown list {name!r}; known: {list(CANDIDATE_LISTS)}")
        globals()[name] = [CANDIDATE_LISTS[name](**entry) for entry in entries]


def projections(s):
    h = s["hidden"]
    return [(h, s["q"] + 2 * s["kv"]), (s["q"], h), (h, 2 * s["inter"]), (s["inter"], h)]


def words(key, shape):
    """Random int32 words (every bit pattern is eight valid 4-bit values)."""
    return jax.lax.bitcast_convert_type(jax.random.bits(key, shape, jnp.uint32), jnp.int32)


def make_weights(family, shapes, layers, key):
    """Random weights drawn on the device, per layer a list of per-projection dicts."""
    out = []
    for _ in range(layers):
        layer = []
        for k, n in shapes:
            key, k1, k2, k3 = jax.random.split(key, 4)
            g = k // GROUP
            if family == "bf16":
                layer.append({"w": jax.random.normal(k1, (k, n), jnp.bfloat16) * 0.02})
            elif family == "awq":
                layer.append({"qweight": words(k1, (k, n // 8)), "qzeros": words(k2, (g, n // 8)),
                              "scales": jax.random.uniform(k3, (g, n), jnp.float16, 0.5, 1.5)
                              * 2e-3})  # fmt: skip
            elif family == "fp8":
                w = jax.random.normal(k1, (n, k), jnp.float32) * 0.02
                scale = jnp.max(jnp.abs(w)) / FP8_E4M3_MAX
                layer.append({"weight": (w / scale).astype(jnp.float8_e4m3fn),
                              "weight_scale": scale.reshape(1)})  # fmt: skip
            else:  # int8, per-channel scales
                layer.append({"weight": jax.random.randint(k1, (n, k), -127, 128, jnp.int8),
                              "weight_scale": jnp.full((n,), 1.5e-4, jnp.float32)})  # fmt: skip
        out.append(layer)
    return jax.block_until_ready(out)


def kernel_layout(awq_weights):
    return jax.block_until_ready(
        [
            [awq_to_kernel(p["qweight"], p["qzeros"], p["scales"]) for p in layer]
            for layer in awq_weights
        ]  # fmt: skip
    )


def fit_w4(tiling, k):
    """``tiling`` with ``block_k`` cut to what a layer of ``k`` inputs divides."""
    return dataclasses.replace(tiling, block_k=largest_block_k(k, GROUP, tiling.block_k))


def linear_fn(kernel: str, tiling, interpret: bool) -> Callable:
    """``(x [T, k], params) -> [T, n]`` in ``x.dtype`` for one projection."""
    if kernel == "bf16":
        return lambda x, p: jnp.dot(x, p["w"], preferred_element_type=jnp.float32).astype(x.dtype)
    if kernel == "awq-xla":
        return lambda x, p: awq_linear(x, p["qweight"], p["qzeros"], p["scales"])
    if kernel == "w4a16-xla":
        return w4a16_xla_linear
    if kernel == "w4a16":
        return lambda x, p: w4a16_matmul(
            x, p["qweight"], p["scales"], p["zeros"], group_size=GROUP,
            tiling=fit_w4(tiling, x.shape[1]), interpret=interpret,
        )  # fmt: skip
    if kernel == "w4a16-wgmma":
        return lambda x, p: w4a16_wgmma(
            x, p["qweight"], p["scales"], p["zeros"], group_size=GROUP, tiling=tiling,
            interpret=interpret,
        )  # fmt: skip
    if kernel == "w4a16-ref":
        return lambda x, p: w4a16_matmul_reference(
            x.astype(jnp.float32), p["qweight"], p["scales"], p["zeros"], group_size=GROUP
        )
    if kernel.startswith("w8gemv"):
        return lambda x, p: w8_gemv(
            x, p["weight"], p["weight_scale"], tiling=tiling, interpret=interpret
        )
    if kernel == "w8-ref":
        return lambda x, p: w8_gemv_reference(x.astype(jnp.float32), p["weight"], p["weight_scale"])
    quantize = quantize_fp8 if kernel == "fp8-w8a8" else quantize_int8

    def w8a8(x, p):
        x_q, x_scale = quantize(x, per_token=True)
        return scaled_matmul(x_q, x_scale, p["weight"], p["weight_scale"], x.dtype)

    return w8a8


def chain(linear: Callable, s) -> Callable:
    """One Llama layer's four projections per layer (residual adds, SiLU-gated MLP), jitted."""

    def run(x, weights):
        for qkv, o, gate_up, down in weights:
            a = linear(x, qkv)[:, : s["q"]]
            x = x + linear(a, o).astype(x.dtype)
            gu = linear(x, gate_up)
            m = (jax.nn.silu(gu[:, : s["inter"]]) * gu[:, s["inter"] :]).astype(x.dtype)
            x = x + linear(m, down).astype(x.dtype)
        return x

    return jax.jit(run)


def time_calls(fn, args, iters: int) -> float:
    """Seconds per call: ``iters`` calls dispatched back to back, then one wait."""
    fn(*args).block_until_ready()
    start = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    out.block_until_ready()
    return (time.perf_counter() - start) / iters


def ceilings(tiny: bool, iters: int) -> dict:
    result = {}
    n = (1 << 20) if tiny else (1 << 29)  # uint32 words: 4 MiB / 2 GiB
    x = jnp.zeros((n,), jnp.uint32)
    copy = jax.jit(lambda v: v + jnp.uint32(1))
    result["copy_GBps"] = 2 * x.nbytes / time_calls(copy, (x,), iters) / 1e9
    del x
    m = 256 if tiny else 8192
    for name, dtype in (("bf16", jnp.bfloat16), ("fp8", jnp.float8_e4m3fn)):
        try:
            a = jax.random.normal(jax.random.key(1), (m, m), jnp.float32).astype(dtype)
            mm = jax.jit(lambda u, v: jnp.dot(u, v, preferred_element_type=jnp.float32))
            result[f"{name}_TFLOPs"] = 2 * m**3 / time_calls(mm, (a, a), iters) / 1e12
        except Exception as e:  # noqa: BLE001 - a ceiling the backend lacks is recorded
            result[f"{name}_TFLOPs"] = None
            result[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    parser.add_argument("--tokens", default=None, help="T values, default 1,16,32,256,1024")
    parser.add_argument("--layers", type=int, default=None, help="distinct layers (default 4)")
    parser.add_argument("--iters", type=int, default=None, help="timed calls (default 10)")
    parser.add_argument("--budget-s", type=float, default=170.0,
                        help="the sweep's other candidates start only before this many seconds; "
                        "after 1.3x it nothing more starts")  # fmt: skip
    parser.add_argument("--max-candidates", type=int, default=None)
    parser.add_argument("--kernels", default=None,
                        help="comma list of kernels to run (default all; bf16 always runs)")  # fmt: skip
    parser.add_argument("--tilings", default=None,
                        help="JSON (or a path to it) replacing candidate lists, e.g. "
                        '\'{"W4A16_DECODE_1": [{"block_t": 1, "block_n": 64, "block_k": 16, '
                        '"slots3d": true}]}\'; lists: ' + ", ".join(CANDIDATE_LISTS))  # fmt: skip
    parser.add_argument("--out", default=None, help="JSON results path")
    args = parser.parse_args()
    if args.tilings:
        select_tilings(args.tilings)
    t_start = time.perf_counter()
    s = TINY if args.tiny else FULL
    if args.tiny:
        globals()["GROUP"] = 32
    tokens = [int(t) for t in (args.tokens or ("1,16,64" if args.tiny else "1,16,32,256,1024")).split(",")]  # fmt: skip
    layers = args.layers or (2 if args.tiny else 4)
    iters = args.iters or (2 if args.tiny else 10)
    max_candidates = args.max_candidates or (2 if args.tiny else 99)
    interpret = jax.default_backend() != "gpu"
    shapes = projections(s)
    device = f"{jax.default_backend()} {jax.devices()[0].device_kind}"
    print(f"device {device}; shapes {shapes} x {layers} layers; T {tokens}", flush=True)
    report = {"device": device, "shapes": shapes, "layers": layers, "tokens": tokens,
              "group_size": GROUP, "rows": []}  # fmt: skip
    report["ceilings"] = ceil = ceilings(args.tiny, iters)
    print("ceilings:", json.dumps(ceil), flush=True)

    key = jax.random.key(0)
    weights = {"bf16": make_weights("bf16", shapes, layers, key)}
    weights["awq"] = make_weights("awq", shapes, layers, key)
    weights["w4"] = kernel_layout(weights["awq"])
    weights["fp8"] = make_weights("fp8", shapes, layers, key)
    weights["int8"] = make_weights("int8", shapes, layers, key)
    layer_bytes = {f: sum(leaf.nbytes for leaf in jax.tree.leaves(w)) / layers
                   for f, w in weights.items()}  # fmt: skip
    flops_per_token = 2 * sum(k * n for k, n in shapes)
    rng = np.random.default_rng(0)
    xs = {t: jnp.asarray(rng.standard_normal((t, s["hidden"])), jnp.bfloat16) for t in tokens}
    refs: dict = {}

    def reference(family, t):
        if (family, t) not in refs:
            kernel, w = ("w4a16-ref", "w4") if family == "w4" else ("w8-ref", family)
            refs[family, t] = np.asarray(chain(linear_fn(kernel, None, interpret), s)(
                xs[t].astype(jnp.float32), weights[w]), np.float32)  # fmt: skip
        return refs[family, t]

    base: dict[int, float] = {}

    only = None if args.kernels is None else set(args.kernels.split(",")) | {"bf16"}

    def measure(kernel, t, family, tiling=None, ref_family=None, first=True):
        if only is not None and kernel not in only:
            return None
        elapsed = time.perf_counter() - t_start
        if elapsed > 1.3 * args.budget_s or (not first and elapsed > args.budget_s):
            return None
        row = {"kernel": kernel, "T": t, "tiling": None if tiling is None else
               dataclasses.asdict(tiling)}  # fmt: skip
        try:
            fn = chain(linear_fn(kernel, tiling, interpret), s)
            out = np.asarray(fn(xs[t], weights[family]), np.float32)  # compiles; first call
            if ref_family is not None:
                want = reference(ref_family, t)
                err = float(np.max(np.abs(out - want)) / max(np.max(np.abs(want)), 1e-30))
                row["max_rel_err"] = err
                judged = kernel not in ("fp8-w8a8", "int8-w8a8")
                row["status"] = "WRONG" if judged and not err <= WRONG else "ok"
            else:
                row["status"] = "ok"
            sec = time_calls(fn, (xs[t], weights[family]), iters) / layers
        except Exception as e:  # noqa: BLE001 - a failing tiling is recorded and skipped
            row.update(status="FAILED", error=f"{type(e).__name__}: {e}"[:500])
            print(f"{kernel:12s} T={t:5d} FAILED {row['error'][:200]}", flush=True)
            if args.tiny:
                traceback.print_exc()
            report["rows"].append(row)
            return row
        us = sec * 1e6
        if kernel == "bf16":
            base[t] = us
        gbps = layer_bytes[family] / sec / 1e9
        row.update(us_per_layer=us, vs_bf16=us / base[t] if t in base else None,
                   weight_GBps=gbps, frac_copy=gbps / ceil["copy_GBps"],
                   TFLOPs=flops_per_token * t / sec / 1e12)  # fmt: skip
        report["rows"].append(row)
        print(f"{kernel:12s} T={t:5d} {us:9.1f} us/layer x{row['vs_bf16'] or 0:.2f} of bf16 "
              f"{gbps:7.0f} GB/s ({row['frac_copy']:.2f} of copy) {row['TFLOPs']:6.1f} TFLOP/s "
              f"err {row.get('max_rel_err', float('nan')):.1e} {row['status']} "
              f"{'' if tiling is None else tiling}", flush=True)  # fmt: skip
        return row

    # Pass 1: every kernel's first candidate and the XLA paths (always run, up to the hard
    # limit); pass 2: the other candidates, round by round (each kernel and T's second, then
    # third, ...; W4A16 first in each round), while the budget lasts.
    for t in tokens:
        measure("bf16", t, "bf16")
    later = []
    for t in tokens:  # the main subject first: the W4A16 kernel, then its XLA alternatives
        cands = W4A16_DECODE_1 if t == 1 else W4A16_DECODE if t <= 32 else W4A16_PREFILL
        measure("w4a16", t, "w4", cands[0], "w4")
        later += [
            (i, 0, ("w4a16", t, "w4", c, "w4")) for i, c in enumerate(cands[1:max_candidates])
        ]
        if t >= WGMMA_MIN_TOKENS and not args.tiny:  # tiny shapes: a plane is < one group
            measure("w4a16-wgmma", t, "w4", W4A16_WGMMA[0], "w4")
            later += [(i, 0, ("w4a16-wgmma", t, "w4", c, "w4"))
                      for i, c in enumerate(W4A16_WGMMA[1:max_candidates])]  # fmt: skip
        measure("w4a16-xla", t, "w4", None, "w4")
        measure("awq-xla", t, "awq", None, "w4")
    for t in tokens:
        if t <= 32:
            for fam in ("fp8", "int8"):
                cands = W8_DECODE_1 if t == 1 else W8_DECODE
                measure(f"w8gemv-{fam}", t, fam, cands[0], fam)
                later += [(i, 1, (f"w8gemv-{fam}", t, fam, c, fam))
                          for i, c in enumerate(cands[1:max_candidates])]  # fmt: skip
        # W8A8 quantizes the activations: its error is reported where the weight-only
        # reference exists anyway (T <= 32), not judged.
        measure("fp8-w8a8", t, "fp8", None, "fp8" if t <= 32 else None)
        measure("int8-w8a8", t, "int8", None, "int8" if t <= 32 else None)
    for _, _, job in sorted(later, key=lambda j: j[:2]):  # every kernel's 2nd, then 3rd, ...
        measure(*job, first=False)

    summarize(report)
    print(f"total {time.perf_counter() - t_start:.0f} s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if any(r["status"] == "WRONG" for r in report["rows"]) else 0


def summarize(report: dict) -> None:
    """The best row per (kernel, T), the markdown table, and ``auto``'s table."""
    best: dict[tuple[str, int], dict] = {}
    for r in report["rows"]:
        if r["status"] != "ok":
            continue
        k = (r["kernel"], r["T"])
        if k not in best or r["us_per_layer"] < best[k]["us_per_layer"]:
            best[k] = r
    report["best"] = [dict(r) for r in best.values()]
    print("\n| kernel | T | µs/layer | / bf16 | weight GB/s | of copy BW | TFLOP/s | max rel err "
          "| best tiling |\n|---|---:|---:|---:|---:|---:|---:|---:|---|")  # fmt: skip
    for (kernel, t), r in sorted(best.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        til = "" if r["tiling"] is None else ", ".join(f"{k}={v}" for k, v in r["tiling"].items())
        frac = f"{r['frac_copy']:.2f}" if t <= 32 else ""
        tf = f"{r['TFLOPs']:.1f}" if t >= 256 else ""
        print(f"| {kernel} | {t} | {r['us_per_layer']:.1f} | {r['vs_bf16'] or 0:.2f} | "
              f"{r['weight_GBps']:.0f} | {frac} | {tf} | {r.get('max_rel_err', float('nan')):.1e} "
              f"| {til} |")  # fmt: skip
    failed = [r for r in report["rows"] if r["status"] != "ok"]
    for r in failed:
        print(f"{r['status']}: {r['kernel']} T={r['T']} {r['tiling']} {r.get('error', '')[:200]}")
    auto = {}
    for family, pallas, xla in (("w4a16", ["w4a16"], ["w4a16-xla"]),
                                ("w8", ["w8gemv-fp8"], ["fp8-w8a8"])):  # fmt: skip
        picks = []
        for t in report["tokens"]:
            mine = [best[k, t]["us_per_layer"] for k in pallas if (k, t) in best]
            theirs = [best[k, t]["us_per_layer"] for k in xla if (k, t) in best]
            if mine or theirs:
                win = "pallas" if mine and (not theirs or min(mine) < min(theirs)) else "xla"
                picks.append((t, win))
        entries: list[list] = []
        for t, win in picks:  # merge runs: (largest T measured with this winner, winner)
            if entries and entries[-1][1] == win:
                entries[-1][0] = t
            else:
                entries.append([t, win])
        if entries:
            entries[-1][0] = None
        auto[family] = [tuple(e) for e in entries] or [(None, "xla")]
    report["auto_table"] = auto
    print("\nbest tilings (for DEFAULT_TILINGS / W8GemvTiling's defaults):")
    for (kernel, t), r in sorted(best.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        if r["tiling"] is not None and kernel in ("w4a16", "w8gemv-fp8", "w8gemv-int8"):
            cls = "W4A16Tiling" if kernel == "w4a16" else "W8GemvTiling"
            fields = ", ".join(f"{k}={v!r}" for k, v in r["tiling"].items())
            print(f"    {kernel} T={t}: {cls}({fields})")
    print("\nauto table (models/linear_backends.py AUTO_BACKENDS):")
    print("    " + ",\n    ".join(f"{f!r}: {tuple(v)!r}" for f, v in auto.items()))


if __name__ == "__main__":
    sys.exit(main())
