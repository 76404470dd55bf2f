"""Quantized linears vs bf16 at Llama-3-8B layer shapes: time per layer and what XLA compiled.

(Issue 14's script, kept for the commands in docs/benchmarks.md. The kernels' sweep against the
hardware ceilings is ``benchmarks/quant_kernels.py``.)

One decoder layer's four projections (``qkv_proj`` 4096->6144, ``o_proj`` 4096->4096,
``gate_up_proj`` 4096->28672, ``down_proj`` 14336->4096), applied for ``LAYERS`` distinct
layers in one jitted chain (so weights stream from HBM, not L2), per method and token count T:

- ``bf16``: ``x @ W`` (the floor the others are compared with);
- ``fp8``: FP8 W8A8, dynamic per-token activation scales (``models.quantization.fp8``);
- ``int8``: INT8 W8A8 (``models.quantization.w8a8``);
- ``fp8w`` / ``int8w``: the same FP8 / INT8 weights used weight-only: converted to bf16 inside
  the dot (XLA may fuse the convert into its GEMM) and scaled after, activations unquantized;
- ``fp8gemv`` / ``int8gemv``: the same weights through the weight-only Pallas GEMV
  (``pallas_kernels.w8_gemv``, issue 14; interpret mode on CPU), meant for small T (each token
  tile of 16 reads the weights again); ``--w8-tiling`` sets its tiles;
- ``awq``: AWQ GEMM 4-bit, group 128, unpacked from int32 words in the jitted step
  (``models.quantization.awq``);
- ``int4``: the same values stored as ``jnp.int4 [in, out]`` (XLA's native s4 operand);
- ``pallas``: the AWQ weights repacked once on the host (``repack_awq``) and applied by the
  Pallas W4A16 kernel (``pallas_kernels.w4a16_matmul``; interpret mode on CPU, so ``--small``
  there checks that it runs, not its speed).

Prints a table (µs per layer, ratio to bf16, GB/s of weight bytes) and, for T=1 and T=1024,
the custom calls and the fusions' result shapes of the compiled module, which says whether the
FP8 dot runs as a cuBLASLt FP8 GEMM (``__cublas$lt$matmul$f8``) and whether the int4 unpack
writes a full-size bf16 weight before the dot. ``--small`` runs tiny shapes on any backend.
"""

from __future__ import annotations

import argparse
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from models.quantization.awq import awq_linear
from models.quantization.fp8 import fp8_linear
from models.quantization.w4a16 import repack_awq
from models.quantization.w8a8 import FP8_E4M3_MAX, w8a8_linear
from pallas_kernels.w4a16_matmul import w4a16_matmul
from pallas_kernels.w8_gemv import W8GemvTiling, w8_gemv

FULL = dict(hidden=4096, q=4096, kv=1024, inter=14336, layers=8)
SMALL = dict(hidden=256, q=256, kv=64, inter=512, layers=2)
GROUP = 128
W8_TILING = [None]  # --w8-tiling (None: the kernel's defaults)


def projections(s):
    h = s["hidden"]
    return [(h, s["q"] + 2 * s["kv"]), (s["q"], h), (h, 2 * s["inter"]), (s["inter"], h)]


def words(key, shape):
    """Random int32 words (every bit pattern is eight valid 4-bit values)."""
    return jax.lax.bitcast_convert_type(jax.random.bits(key, shape, jnp.uint32), jnp.int32)


def make_weights(method, shapes, layers, key):
    """Random weights drawn on the device (host-side drawing of 8 layers takes minutes)."""
    out = []
    for _ in range(layers):
        layer = []
        for k, n in shapes:
            key, k1, k2, k3 = jax.random.split(key, 4)
            g = k // GROUP
            if method == "bf16":
                layer.append(jax.random.normal(k1, (k, n), jnp.bfloat16) * 0.02)
            elif method in ("fp8", "fp8w", "fp8gemv"):
                w = jax.random.normal(k1, (n, k), jnp.float32) * 0.02
                scale = jnp.max(jnp.abs(w)) / FP8_E4M3_MAX
                layer.append({"weight": (w / scale).astype(jnp.float8_e4m3fn),
                              "weight_scale": scale.reshape(1)})  # fmt: skip
            elif method in ("int8", "int8w", "int8gemv"):
                layer.append({"weight": jax.random.randint(k1, (n, k), -127, 128, jnp.int8),
                              "weight_scale": jnp.full((n,), 1e-3, jnp.float32)})  # fmt: skip
            elif method in ("awq", "pallas"):
                awq = {"qweight": words(k1, (k, n // 8)), "qzeros": words(k2, (g, n // 8)),
                       "scales": jax.random.uniform(k3, (g, n), jnp.bfloat16) * 1e-3}  # fmt: skip
                if method == "pallas":  # repacked once, at "load", on the host
                    awq = jax.tree.map(jnp.asarray, repack_awq(*map(np.asarray, awq.values())))
                layer.append(awq)
            elif method == "int4":
                layer.append({"w": jax.random.randint(k1, (k, n), -8, 8, jnp.int8).astype(jnp.int4),
                              "scales": jax.random.uniform(k3, (g, n), jnp.bfloat16) * 1e-3})  # fmt: skip
        out.append(layer)
    return jax.block_until_ready(out)


def apply(method, x, w):
    if method == "bf16":
        return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    if method == "fp8":
        return fp8_linear(x, w)
    if method in ("fp8w", "int8w"):
        y = jnp.dot(x, w["weight"].astype(x.dtype).T, preferred_element_type=jnp.float32)
        return (y * w["weight_scale"].astype(jnp.float32)).astype(x.dtype)
    if method in ("fp8gemv", "int8gemv"):
        return w8_gemv(x, w["weight"], w["weight_scale"], tiling=W8_TILING[0],
                       interpret=jax.default_backend() == "cpu")  # fmt: skip
    if method == "int8":
        return w8a8_linear(x, w["weight"], w["weight_scale"])
    if method == "awq":
        return awq_linear(x, w["qweight"], w["qzeros"], w["scales"])
    if method == "pallas":
        return w4a16_matmul(x, w["qweight"], w["scales"], w["zeros"], group_size=GROUP,
                            interpret=jax.default_backend() == "cpu")  # fmt: skip
    k, n = w["w"].shape
    deq = (w["w"].astype(x.dtype).reshape(k // GROUP, GROUP, n) * w["scales"][:, None, :]).reshape(k, n)
    return jnp.dot(x, deq, preferred_element_type=jnp.float32).astype(x.dtype)


def chain(method, s):
    def run(x, weights):
        for qkv, o, gate_up, down in weights:
            a = apply(method, x, qkv)[:, : s["q"]]
            x = x + apply(method, a, o)
            gu = apply(method, x, gate_up)
            m = jax.nn.silu(gu[:, : s["inter"]]) * gu[:, s["inter"] :]
            x = x + apply(method, m, down)
        return x

    return jax.jit(run)


def weight_bytes(weights):
    """Bytes the weights occupy in HBM (``jnp.int4``: half a byte each)."""
    return sum(
        leaf.size // 2 if leaf.dtype == jnp.int4 else leaf.nbytes for leaf in jax.tree.leaves(weights)
    )


def compiled_summary(text: str) -> str:
    calls = sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))
    fusions = re.findall(r"^\s*(\S+) = (\S+) fusion\(.*kind=(\w+)", text, re.M)
    big = [f"{shape} {kind}" for _, shape, kind in fusions if re.search(r"\[\d{4,},\d{4,}\]", shape)]
    return f"custom calls: {calls}\n  full-size fusion results: {big[:6] or 'none'}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--tokens", default="1,256,1024")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--methods", default="bf16,fp8,int8,awq,int4,pallas")
    parser.add_argument("--w8-tiling", default=None,
                        help="fp8gemv/int8gemv tiles: block_n,block_k,split_k(0: auto),num_warps,num_stages")  # fmt: skip
    args = parser.parse_args()
    if args.w8_tiling:
        bn, bk, sk, nw, ns = map(int, args.w8_tiling.split(","))
        W8_TILING[0] = W8GemvTiling(block_n=bn, block_k=bk, split_k=sk or None, num_warps=nw,
                                    num_stages=ns)  # fmt: skip
    s = SMALL if args.small else FULL
    shapes, layers = projections(s), s["layers"]
    rng = np.random.default_rng(0)
    key = jax.random.key(0)
    print(f"backend {jax.default_backend()} {jax.devices()[0].device_kind}; shapes {shapes} x {layers} layers")
    rows, base = [], {}
    for method in args.methods.split(","):
        weights = make_weights(method, shapes, layers, key)
        wb = weight_bytes(weights) / layers
        fn = chain(method, s)
        for t in map(int, args.tokens.split(",")):
            x = jnp.asarray(rng.standard_normal((t, s["hidden"]), np.float32), jnp.bfloat16)
            compiled = fn.lower(x, weights).compile()
            if t in (1, 1024) and method != "bf16":
                print(f"[{method} T={t}] {compiled_summary(compiled.as_text())}", flush=True)
            compiled(x, weights).block_until_ready()
            times = []
            for _ in range(args.iters):
                start = time.perf_counter()
                compiled(x, weights).block_until_ready()
                times.append(time.perf_counter() - start)
            us = float(np.median(times)) / layers * 1e6
            if method == "bf16":
                base[t] = us
            rows.append((method, t, us, us / base.get(t, us), wb / (us * 1e-6) / 1e9, wb / 1e6))
            print(f"{method:5s} T={t:5d} {us:9.1f} us/layer  x{rows[-1][3]:.2f} of bf16  "
                  f"{rows[-1][4]:7.0f} GB/s of weights ({wb / 1e6:.1f} MB/layer)", flush=True)
    print("\n| method | T | µs/layer | time / bf16 | weight GB/s | weight MB/layer |")
    print("|---|---|---|---|---|---|")
    for method, t, us, ratio, gbs, mb in rows:
        print(f"| {method} | {t} | {us:.1f} | {ratio:.2f} | {gbs:.0f} | {mb:.1f} |")


if __name__ == "__main__":
    sys.exit(main())
