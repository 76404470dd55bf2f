"""LoRA cost in one decoder layer's four projections: base vs +LoRA by each path of
``models.lora.lora_delta`` (dense, gather, and bgmv: the fused Pallas kernel
``pallas_kernels.lora_bgmv``) and by the fold layout (``models.lora``: the shrink's columns
appended to the base kernel, ``x @ [W | a]``, then ``models.lora.fold_lora_output``), no engine
or server.

One "layer" is Llama's projection chain without attention and norms' weights: ``x [T, hidden]
-> qkv_proj`` (its q columns stand in for the attention output) ``-> o_proj -> gate_up_proj ->
silu(gate) * up -> down_proj``, plus a residual and an RMS normalisation so that the values
stay bounded when the output feeds the next iteration. Each variant runs ``--iters`` layers in
one jitted ``lax.fori_loop`` (the output is the next input, so nothing is hoisted and there is
one dispatch per timing), timed over ``--reps`` calls after a warm-up, with
``block_until_ready``; the table gives the best of the reps, in microseconds per layer, and
each LoRA variant's overhead over the base. LoRA: ``--max-loras`` slots of rank
``--rank`` on all four projections (all seven HF modules), every slot filled; at T=1 the token
uses slot 0 (a batch-1 decode), at larger T tokens cycle over all slots.

Usage (the default shapes are Llama-3-8B's, bf16)::

    python benchmarks/lora_layer.py            # on the GPU
    python benchmarks/lora_layer.py --small    # tiny shapes, any device (a check)
    python benchmarks/lora_layer.py --kernels  # also count each variant's kernels

``--kernels`` adds a second table: the top-level instructions (fusions, GEMMs / dots, custom
calls; parameters, constants, tuples and bitcasts not counted) of one layer's compiled HLO per
variant, i.e. the kernels a step launches per layer on that backend. On a CPU it is only a
proxy for the GPU's count (the CPU backend converts bf16 weights to float32 in extra fusions;
use ``--dtype float32`` there).

Before timing, every path's layer output is checked against the dense path's (same sums,
tolerance of the dtype) so a broken path cannot report a good time. Off a GPU the bgmv path runs
the kernel in Pallas interpret mode: its ``--small`` time there means nothing.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from models.lora import LORA_PATHS, fold_lora_output, lora_delta

LLAMA3_8B = dict(hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128)
SMALL = dict(hidden=64, intermediate=160, heads=4, kv_heads=2, head_dim=16)
LORA_VARIANTS = (*LORA_PATHS, "fold")
VARIANTS = ("base", *LORA_VARIANTS)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU check)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 256], help="T values")
    parser.add_argument("--max-loras", type=int, default=8, help="slots S")
    parser.add_argument("--rank", type=int, default=16, help="max_lora_rank")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--iters", type=int, default=100, help="layers per jitted call")
    parser.add_argument("--reps", type=int, default=10, help="timed calls (best is reported)")
    parser.add_argument("--kernels", action="store_true", help="count kernels per layer")
    return parser


def make_weights(shape: dict, max_loras: int, rank: int, dtype) -> dict:
    """Random base kernels ``[in, out]`` and slot arrays (``models.lora`` layout) per
    projection: ``(w, a [in, S * P * rank], b [S * P * rank, out], [w | a])``, ``P`` its
    parts, the last the fold layout's kernel."""
    hidden, inter = shape["hidden"], shape["intermediate"]
    q, kv = shape["heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"]
    sizes = {  # projection: (in, out, parts)
        "qkv_proj": (hidden, q + 2 * kv, 3),
        "o_proj": (q, hidden, 1),
        "gate_up_proj": (hidden, 2 * inter, 2),
        "down_proj": (inter, hidden, 1),
    }
    keys = iter(jax.random.split(jax.random.key(0), 3 * len(sizes)))
    weights = {}
    for name, (n_in, n_out, parts) in sizes.items():
        cols = max_loras * parts * rank

        def normal(shape, std):
            return (jax.random.normal(next(keys), shape, jnp.float32) * std).astype(dtype)

        w, a = normal((n_in, n_out), n_in**-0.5), normal((n_in, cols), n_in**-0.5)
        weights[name] = (w, a, normal((cols, n_out), 0.5 * cols**-0.5), jnp.concatenate([w, a], 1))
    return weights


def layer(x, slots, weights, *, shape: dict, max_loras: int, path: str | None):
    """One layer's projection chain (module docstring); ``path``: one of
    :data:`LORA_VARIANTS`, None: no LoRA."""

    def project(name, h):
        w, a, b, folded = weights[name]
        y = jnp.dot(h, folded if path == "fold" else w, preferred_element_type=jnp.float32)
        y = y.astype(h.dtype)
        if path is None:
            return y
        if path == "fold":
            return fold_lora_output(y, slots, b, max_loras=max_loras)
        return y + lora_delta(h, slots, a, b, max_loras=max_loras, path=path)

    q = project("qkv_proj", x)[:, : shape["heads"] * shape["head_dim"]]
    h = x + project("o_proj", q)
    gate, up = jnp.split(project("gate_up_proj", h), 2, axis=-1)
    h = h + project("down_proj", jax.nn.silu(gate) * up)
    h32 = h.astype(jnp.float32)
    return (h32 * jax.lax.rsqrt(jnp.mean(h32 * h32, axis=-1, keepdims=True) + 1e-6)).astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("iters", "shape_items", "max_loras", "path"))
def run_layers(x, slots, weights, *, iters: int, shape_items: tuple, max_loras: int, path):
    step = functools.partial(layer, shape=dict(shape_items), max_loras=max_loras, path=path)
    return jax.lax.fori_loop(0, iters, lambda _, h: step(h, slots, weights), x)


def time_variant(x, slots, weights, args, shape, path) -> float:
    """Best seconds per layer over ``args.reps`` jitted calls of ``args.iters`` layers."""
    fn = functools.partial(
        run_layers,
        iters=args.iters,
        shape_items=tuple(sorted(shape.items())),
        max_loras=args.max_loras,
        path=path,
    )
    fn(x, slots, weights).block_until_ready()  # compile and warm up
    best = float("inf")
    for _ in range(args.reps):
        start = time.perf_counter()
        fn(x, slots, weights).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best / args.iters


def check_paths_agree(x, slots, weights, shape, max_loras: int, dtype) -> None:
    """One layer through each LoRA path: the same sums as the dense path's up to the dtype's
    rounding.

    Raises:
        RuntimeError: a path differs from the dense one beyond the tolerance (bf16: 2e-2
            relative to the output's scale, a few bf16 ulps after four projections; float32:
            1e-4).
    """
    outs = {
        p: np.asarray(
            layer(x, slots, weights, shape=shape, max_loras=max_loras, path=p), np.float32
        )
        for p in LORA_VARIANTS
    }
    tol = 1e-4 if jnp.dtype(dtype) == jnp.float32 else 2e-2
    scale = float(np.abs(outs["dense"]).max())
    for path, out in outs.items():
        err = float(np.abs(out - outs["dense"]).max())
        if err > tol * scale:
            raise RuntimeError(f"dense and {path} paths differ: {err} > {tol} * {scale}")


# Top-level HLO instructions that launch nothing.
_NOT_KERNELS = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast"})


def count_kernels(x, slots, weights, shape: dict, max_loras: int, path) -> int:
    """Top-level instructions of one layer's compiled HLO entry computation, less
    :data:`_NOT_KERNELS` (module docstring)."""
    fn = jax.jit(functools.partial(layer, shape=shape, max_loras=max_loras, path=path))
    text = fn.lower(x, slots, weights).compile().as_text()
    entry = text[text.index("\nENTRY") :].split("\n}", 1)[0].splitlines()[2:]
    ops = [re.match(r"\s*(?:ROOT )?\S+ = \S+ ([\w-]+)\(", line) for line in entry]
    return sum(1 for op in ops if op is not None and op.group(1) not in _NOT_KERNELS)


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark, print the table(s), return its rows (µs per layer per variant; with
    ``--kernels`` also ``"<variant> kernels"``: :func:`count_kernels`)."""
    args = build_parser().parse_args(argv)
    shape = SMALL if args.small else LLAMA3_8B
    dtype = jnp.dtype(args.dtype)
    weights = make_weights(shape, args.max_loras, args.rank, dtype)
    print(
        f"device: {jax.devices()[0].device_kind}; shapes {shape}; {args.max_loras} slots x rank "
        f"{args.rank}, {dtype.name}; {args.iters} layers per call, best of {args.reps}",
        flush=True,
    )
    rows = []
    for num_tokens in args.tokens:
        x = jax.random.normal(jax.random.key(1), (num_tokens, shape["hidden"])).astype(dtype)
        slots = jnp.asarray(np.arange(num_tokens) % args.max_loras, jnp.int32)
        check_paths_agree(x, slots, weights, shape, args.max_loras, dtype)
        row = {"tokens": num_tokens}
        for variant in VARIANTS:
            path = None if variant == "base" else variant
            row[variant] = 1e6 * time_variant(x, slots, weights, args, shape, path)
            if args.kernels:
                count = count_kernels(x, slots, weights, shape, args.max_loras, path)
                row[f"{variant} kernels"] = count
        rows.append(row)
    header = f"{'T':>5} {'base us':>10} " + " ".join(
        f"{'+' + p + ' us':>12} {p + ' x':>9}" for p in LORA_VARIANTS
    )
    print(header)
    for row in rows:
        cells = " ".join(f"{row[p]:>12.1f} {row[p] / row['base']:>8.3f}x" for p in LORA_VARIANTS)
        print(f"{row['tokens']:>5} {row['base']:>10.1f} {cells}")
    if args.kernels:
        print(f"kernels per layer ({jax.default_backend()} compiled HLO)")
        print(f"{'T':>5} " + " ".join(f"{v:>8}" for v in VARIANTS))
        for row in rows:
            counts = " ".join(f"{row[v + ' kernels']:>8}" for v in VARIANTS)
            print(f"{row['tokens']:>5} {counts}")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
