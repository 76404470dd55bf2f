"""Paged-attention kernel benchmark on one GPU: ceilings, decode sweep, ragged prefill rate.

One run measures, in this order:

1. Ceilings: the copy bandwidth (a 4 GiB device-to-device copy through ``torch`` when it is
   installed, and a 4 GiB streaming negate through XLA; bytes read + written; the larger is the
   ceiling) and the bf16 matmul rate (8192 x 8192 x 8192, random data).
2. ``--tune`` only: decode tilings, split targets and the two KV layouts at Llama-3-8B heads,
   batch 64, context 2048; ragged tilings on 2048-token prompts. The sweep below then uses the
   fastest; ``pallas_kernels`` keeps its defaults in ``_TILING`` (docs/kernels.md).
3. Decode sweep: Llama-3-8B heads (Hq 32, Hkv 8, D 128) and Qwen2.5-7B heads (28 / 4 / 128),
   batch {1, 8, 64, 256}, context {512, 2048, 8192}, block size {16, 32}, bf16, every sequence at
   the full context. For each: ``pallas_kernels.paged_attention``, the plain-JAX reference
   (``models.attention.gather_kv`` + ``paged_attention_reference``) and JAX's own
   ``jax.experimental.pallas.ops.gpu.paged_attention`` (heads-major copy of the cache made
   outside the timed region). Each is checked against the reference on random data first, then
   timed: time per call, K+V bytes read per second, and % of the copy ceiling.
4. Ragged prefill: 4 prompts of 2048 tokens from scratch, FLOP rate over the matmul ceiling.

Timing: ``jax.block_until_ready`` after warm-up, median of ``REPS`` repetitions. Each repetition
cycles through several block tables over one cache pool, so that the K/V read per repetition
is well over the 60 MB L2 (``ROTATE_BYTES``).

Usage (repository root, on the GPU)::

    PYTHONPATH=. python benchmarks/attention_kernels.py --out DIR [--tune] [--quick]

Writes ``DIR/kernels.json`` and ``DIR/kernels.png`` and prints a table.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import importlib
import json
import math
import pathlib
import platform
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from models.attention import gather_kv  # noqa: E402
from pallas_kernels import (  # noqa: E402
    paged_attention_reference,
    ragged_paged_attention_reference,
)

# The kernel modules (the package exports functions of the same names): their private launchers
# take a tiling, which --tune varies.
decode_module = importlib.import_module("pallas_kernels.paged_attention")
ragged_module = importlib.import_module("pallas_kernels.ragged_paged_attention")

HEADS = {"llama-3-8b": (32, 8, 128), "qwen2.5-7b": (28, 4, 128)}
BATCHES = (1, 8, 64, 256)
CONTEXTS = (512, 2048, 8192)
BLOCK_SIZES = (16, 32)
KEY_SHAPE = dict(heads="llama-3-8b", batch=64, context=2048, block_size=16)
REPS = 5
ROTATE_BYTES = 512 * 2**20  # K+V read per repetition at least this (L2 is 60 MB)
MAX_SETS = 64
REP_SECONDS = 0.02  # calls per repetition: enough for ~20 ms, so the final sync is < 0.5%
DTYPE = jnp.bfloat16
# bf16 inputs, float32 softmax/accumulation: the kernel rounds P to bf16 before P.V and its
# output to bf16, ~2**-8 relative each; 1e-2 relative L2 error leaves room for both.
REL_TOL = 1e-2
PREFILL_PROMPTS = 4
PREFILL_LEN = 2048
CHECK_TOKENS = 64  # ragged check: first and last CHECK_TOKENS tokens of each prompt


def log(*args):
    print(*args, flush=True)


# ------------------------------------------------------------------------------------------
# Timing and ceilings


def time_calls(fn, arg_sets, *, reps=REPS):
    """Median seconds per call of ``fn`` cycling over ``arg_sets`` (each a tuple of args).

    Each repetition dispatches about REP_SECONDS of calls back to back and waits once, so the
    GPU never waits for the host on kernels longer than the dispatch time (the dispatch floor
    is reported separately) and the one synchronisation per repetition costs < 0.5%.
    """
    jax.block_until_ready([fn(*args) for args in arg_sets])  # warm-up, every set once
    start = time.perf_counter()
    jax.block_until_ready([fn(*args) for args in arg_sets])
    estimate = (time.perf_counter() - start) / len(arg_sets)
    per_rep = int(min(4000, max(1, math.ceil(REP_SECONDS / estimate / len(arg_sets)))))
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        outs = [fn(*args) for _ in range(per_rep) for args in arg_sets]
        jax.block_until_ready(outs)
        samples.append((time.perf_counter() - start) / (per_rep * len(arg_sets)))
    return statistics.median(samples)


def copy_ceiling() -> dict:
    """Copy bandwidth in bytes/s (read + written) through torch (cudaMemcpy) and XLA."""
    nbytes = 4 * 2**30
    result = {}
    try:
        import torch

        if torch.cuda.is_available():
            src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda")
            dst = torch.empty_like(src)
            for _ in range(3):
                dst.copy_(src)
            torch.cuda.synchronize()
            samples = []
            for _ in range(10):
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                dst.copy_(src)
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end) / 1e3)
            result["torch_copy_bytes_per_s"] = 2 * nbytes / statistics.median(samples)
            del src, dst
            torch.cuda.empty_cache()
    except ImportError:
        pass
    x = jax.random.normal(jax.random.key(0), (nbytes // 2,), DTYPE)
    negate = jax.jit(lambda a: -a)
    seconds = time_calls(negate, [(x,)], reps=10)
    result["xla_negate_bytes_per_s"] = 2 * nbytes / seconds
    del x
    result["copy_bytes_per_s"] = max(v for k, v in result.items() if k.endswith("_per_s"))
    return result


def dispatch_floor() -> float:
    """Seconds per call of a trivial jitted function with decode's argument count: calls
    that take less than this on the GPU are timed at this host-dispatch rate."""
    args = tuple(jnp.zeros((8,), jnp.float32) + i for i in range(5))
    fn = jax.jit(lambda a, b, c, d, e: a + e).lower(*args).compile()
    return time_calls(fn, [args])


def matmul_ceiling() -> dict:
    n = 8192
    a = jax.random.normal(jax.random.key(1), (n, n), DTYPE)
    b = jax.random.normal(jax.random.key(2), (n, n), DTYPE)
    seconds = time_calls(jax.jit(jnp.matmul), [(a, b)], reps=10)
    return {"matmul_flops_per_s": 2 * n**3 / seconds, "matmul_shape": [n, n, n]}


# ------------------------------------------------------------------------------------------
# Decode problems


@dataclasses.dataclass(frozen=True)
class DecodeShape:
    heads: str
    batch: int
    context: int
    block_size: int

    @property
    def num_q_heads(self):
        return HEADS[self.heads][0]

    @property
    def num_kv_heads(self):
        return HEADS[self.heads][1]

    @property
    def head_dim(self):
        return HEADS[self.heads][2]

    @property
    def kv_bytes(self) -> int:
        """K + V bytes one call must read."""
        return 2 * self.batch * self.context * self.num_kv_heads * self.head_dim * 2

    @property
    def num_sets(self) -> int:
        return int(min(MAX_SETS, max(1, math.ceil(ROTATE_BYTES / self.kv_bytes))))

    @property
    def max_blocks(self) -> int:
        return self.context // self.block_size

    def label(self) -> str:
        return f"{self.heads} B{self.batch} ctx{self.context} bs{self.block_size}"


def make_decode_inputs(shape: DecodeShape, seed: int = 0):
    """One cache pool and per-set (q, block_tables); every sequence at the full context."""
    sets = shape.num_sets
    blocks_per_set = shape.batch * shape.max_blocks
    num_blocks = sets * blocks_per_set + 1
    key = jax.random.key(seed)
    kk, kv, kq = jax.random.split(key, 3)
    cache_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    k_cache = jax.random.normal(kk, cache_shape, DTYPE)
    v_cache = jax.random.normal(kv, cache_shape, DTYPE)
    rng = np.random.default_rng(seed)
    seq_lens = jnp.full((shape.batch,), shape.context, jnp.int32)
    qs = jax.random.normal(kq, (sets, shape.batch, shape.num_q_heads, shape.head_dim), DTYPE)
    arg_sets = []
    for i in range(sets):
        ids = rng.permutation(blocks_per_set) + i * blocks_per_set
        tables = jnp.asarray(ids.reshape(shape.batch, shape.max_blocks).astype(np.int32))
        arg_sets.append((qs[i], tables))
    return k_cache, v_cache, seq_lens, arg_sets


def ours_fn(shape: DecodeShape, tiling, heads_major=False):
    scale = shape.head_dim**-0.5
    return jax.jit(
        functools.partial(
            decode_module._paged_attention,
            scale=scale,
            soft_cap=None,
            sliding_window=None,
            interpret=False,
            tiling=tiling,
            heads_major=heads_major,
        )
    )


def reference_fn(shape: DecodeShape):
    scale = shape.head_dim**-0.5

    def run(q, k_cache, v_cache, tables, seq_lens):
        return paged_attention_reference(
            q, gather_kv(k_cache, tables), gather_kv(v_cache, tables), seq_lens, scale=scale
        )

    return jax.jit(run)


def builtin_fn(shape: DecodeShape):
    """JAX's own Triton paged kernel with its defaults; takes [Hkv, pages, page_size, D] and
    has no scale argument (its q arrives pre-scaled, outside the timed region)."""
    del shape
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

    return jax.jit(jax_paged.paged_attention)


HEADS_MAJOR = ("builtin", "ours_heads_major")  # implementations that take [Hkv, blocks, ...]


def abstract_args(shape: DecodeShape, heads_major: bool):
    num_blocks = shape.num_sets * shape.batch * shape.max_blocks + 1
    cache = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    if heads_major:
        cache = (cache[2], cache[0], cache[1], cache[3])
    sds = jax.ShapeDtypeStruct
    return (
        sds((shape.batch, shape.num_q_heads, shape.head_dim), DTYPE),
        sds(cache, DTYPE),
        sds(cache, DTYPE),
        sds((shape.batch, shape.max_blocks), jnp.int32),
        sds((shape.batch,), jnp.int32),
    )


def compile_ahead(pool, shape: DecodeShape, impls: dict) -> dict:
    """Futures of the compiled executables (compiles run in the pool's threads)."""

    def build(name, fn):
        heads_major = name in HEADS_MAJOR or name.startswith("hm")
        return fn.lower(*abstract_args(shape, heads_major)).compile()

    return {name: pool.submit(build, name, fn) for name, fn in impls.items()}


def resolve(futures: dict, impls: dict) -> dict:
    """Compiled executables; an implementation whose ahead-of-time compile failed falls back
    to its jitted function (which then reports the error itself)."""
    out = {}
    for name, future in futures.items():
        try:
            out[name] = future.result()
        except Exception:  # noqa: BLE001
            out[name] = impls[name]
    return out


def rel_error(out, ref) -> float:
    out = np.asarray(out, np.float32)
    ref = np.asarray(ref, np.float32)
    if not np.all(np.isfinite(out)):
        return float("nan")
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def measure_decode(shape: DecodeShape, impls: dict, copy_bps: float) -> dict:
    """Check every implementation against the reference on set 0, then time each."""
    k_cache, v_cache, seq_lens, arg_sets = make_decode_inputs(shape)
    row = {"shape": dataclasses.asdict(shape), "kv_bytes": shape.kv_bytes, "sets": len(arg_sets)}
    q0, tables0 = arg_sets[0]
    reference = None
    if "reference" in impls:
        ref_fn = impls["reference"]
        reference = ref_fn(q0, k_cache, v_cache, tables0, seq_lens)
    for name, fn in impls.items():
        entry = {}
        try:
            if name in HEADS_MAJOR or name.startswith("hm"):  # copies outside the timed region
                k_in = jnp.transpose(k_cache, (2, 0, 1, 3))
                v_in = jnp.transpose(v_cache, (2, 0, 1, 3))
            else:
                k_in, v_in = k_cache, v_cache
            scale = shape.head_dim**-0.5 if name == "builtin" else 1.0
            sets = [((q * scale).astype(q.dtype), k_in, v_in, t, seq_lens) for q, t in arg_sets]
            if reference is not None and name != "reference":
                entry["rel_error"] = rel_error(fn(*sets[0]), reference)
                entry["correct"] = bool(entry["rel_error"] <= REL_TOL)
            seconds = time_calls(fn, sets, reps=REPS if name != "reference" else 3)
            entry.update(
                seconds=seconds,
                bytes_per_s=shape.kv_bytes / seconds,
                pct_copy=100 * shape.kv_bytes / seconds / copy_bps,
            )
            del k_in, v_in, sets
        except Exception as error:  # noqa: BLE001 - record and continue the sweep
            entry["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        row[name] = entry
    return row


# ------------------------------------------------------------------------------------------
# Ragged prefill


def make_prefill_inputs(num_heads, block_size, seed=0):
    num_q_heads, num_kv_heads, head_dim = num_heads
    tokens = PREFILL_PROMPTS * PREFILL_LEN
    max_blocks = PREFILL_LEN // block_size
    num_blocks = PREFILL_PROMPTS * max_blocks + 1
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = jax.random.normal(kk, cache_shape, DTYPE)
    v_cache = jax.random.normal(kv, cache_shape, DTYPE)
    q = jax.random.normal(kq, (tokens, num_q_heads, head_dim), DTYPE)
    ids = np.random.default_rng(seed).permutation(PREFILL_PROMPTS * max_blocks)
    tables = jnp.asarray(ids.reshape(PREFILL_PROMPTS, max_blocks).astype(np.int32))
    seq_lens = jnp.full((PREFILL_PROMPTS,), PREFILL_LEN, jnp.int32)
    cu_q_lens = jnp.arange(PREFILL_PROMPTS + 1, dtype=jnp.int32) * PREFILL_LEN
    return q, k_cache, v_cache, tables, seq_lens, cu_q_lens


def prefill_flops(num_q_heads, head_dim) -> float:
    # Causal: query i sees i + 1 keys; QK^T and PV are 2 FLOPs per multiply-add each.
    pairs = PREFILL_LEN * (PREFILL_LEN + 1) / 2
    return PREFILL_PROMPTS * pairs * num_q_heads * head_dim * 4


def ragged_fn(scale, tiling):
    return jax.jit(
        functools.partial(
            ragged_module._ragged_paged_attention,
            scale=scale,
            soft_cap=None,
            sliding_window=None,
            interpret=False,
            tiling=tiling,
        )
    )


def check_prefill(out, q, k_cache, v_cache, tables, scale) -> float:
    """Rel. error of the first and last CHECK_TOKENS tokens of each prompt vs the reference."""
    k = gather_kv(k_cache, tables)
    v = gather_kv(v_cache, tables)
    errors = []
    for first in (True, False):
        idx = []
        for b in range(PREFILL_PROMPTS):
            start = b * PREFILL_LEN + (0 if first else PREFILL_LEN - CHECK_TOKENS)
            idx.extend(range(start, start + CHECK_TOKENS))
        idx = np.asarray(idx)
        seq = CHECK_TOKENS if first else PREFILL_LEN
        seq_lens = jnp.full((PREFILL_PROMPTS,), seq, jnp.int32)
        cu = jnp.arange(PREFILL_PROMPTS + 1, dtype=jnp.int32) * CHECK_TOKENS
        ref = ragged_paged_attention_reference(q[idx], k, v, seq_lens, cu, scale=scale)
        errors.append(rel_error(out[idx], ref))
    return max(errors)


def measure_prefill(heads: str, block_size: int, tiling, matmul_fps: float, fn=None) -> dict:
    num_q_heads, _, head_dim = HEADS[heads]
    scale = head_dim**-0.5
    q, k_cache, v_cache, tables, seq_lens, cu = make_prefill_inputs(HEADS[heads], block_size)
    fn = fn or ragged_fn(scale, tiling)
    entry = {
        "heads": heads,
        "block_size": block_size,
        "prompts": PREFILL_PROMPTS,
        "prompt_len": PREFILL_LEN,
        "tiling": dataclasses.asdict(tiling),
    }
    try:
        out = fn(q, k_cache, v_cache, tables, seq_lens, cu)
        entry["rel_error"] = check_prefill(out, q, k_cache, v_cache, tables, scale)
        entry["correct"] = bool(entry["rel_error"] <= REL_TOL)
        seconds = time_calls(fn, [(q, k_cache, v_cache, tables, seq_lens, cu)])
        flops = prefill_flops(num_q_heads, head_dim)
        entry.update(
            seconds=seconds,
            flops=flops,
            flops_per_s=flops / seconds,
            pct_matmul=100 * flops / seconds / matmul_fps,
            tokens_per_s=PREFILL_PROMPTS * PREFILL_LEN / seconds,
        )
    except Exception as error:  # noqa: BLE001
        entry["error"] = f"{type(error).__name__}: {str(error)[:300]}"
    return entry


# ------------------------------------------------------------------------------------------
# Tuning


def tune_decode(pool, copy_bps: float) -> tuple[object, list]:
    """Tilings at the key shape, then split targets at long/short shapes; returns the best."""
    rows = []
    key = DecodeShape(**KEY_SHAPE)
    candidates = [
        decode_module.DecodeTiling(block_k=bk, num_warps=w, num_stages=s, target_programs=1)
        for bk in (64, 128)
        for w, s in ((4, 3), (4, 5), (8, 3))
    ] + [decode_module.DecodeTiling(block_k=256, num_warps=8, num_stages=3, target_programs=1)]
    impls = {f"t{i}": ours_fn(key, t) for i, t in enumerate(candidates)}
    impls["reference"] = reference_fn(key)
    result = measure_decode(key, resolve(compile_ahead(pool, key, impls), impls), copy_bps)
    log(f"tune: {len(candidates)} tilings timed")
    scored = []
    for i, t in enumerate(candidates):
        entry = result[f"t{i}"]
        rows.append(
            {"phase": "tiling", "shape": key.label(), "tiling": dataclasses.asdict(t), **entry}
        )
        if entry.get("correct") and "seconds" in entry:
            scored.append((entry["seconds"], t))
    scored.sort(key=lambda x: x[0])
    if not scored:
        return decode_module._TILING, rows
    best = scored[0][1]
    # Layout: the best two tilings on a heads-major cache.
    impls = {f"hm{i}": ours_fn(key, t, heads_major=True) for i, (_, t) in enumerate(scored[:2])}
    impls["reference"] = reference_fn(key)
    result = measure_decode(key, resolve(compile_ahead(pool, key, impls), impls), copy_bps)
    for i, (_, t) in enumerate(scored[:2]):
        rows.append(
            {
                "phase": "layout_heads_major",
                "shape": key.label(),
                "tiling": dataclasses.asdict(t),
                **result[f"hm{i}"],
            }
        )
    log("tune: layouts timed")
    # Split target: long contexts at small batch need splits, large batches do not.
    targets = (256, 512, 1024, 2048)
    totals = dict.fromkeys(targets, 0.0)
    split_shapes = [
        DecodeShape("llama-3-8b", 1, 8192, 16),
        DecodeShape("llama-3-8b", 8, 8192, 16),
        DecodeShape("qwen2.5-7b", 64, 2048, 16),
        key,
    ]
    tilings = {t: dataclasses.replace(best, target_programs=t) for t in targets}
    pending = []
    for shape in split_shapes:
        impls = {f"s{t}": ours_fn(shape, tl) for t, tl in tilings.items()}
        impls["reference"] = reference_fn(shape)
        pending.append((shape, impls, compile_ahead(pool, shape, impls)))
    for shape, impls, futures in pending:
        result = measure_decode(shape, resolve(futures, impls), copy_bps)
        for t in targets:
            entry = result[f"s{t}"]
            rows.append(
                {
                    "phase": "split_target",
                    "shape": shape.label(),
                    "tiling": dataclasses.asdict(tilings[t]),
                    **entry,
                }
            )
            totals[t] += math.log(entry.get("seconds", float("inf")))
    best_target = min(totals, key=totals.get)
    log("tune: split targets timed")
    return dataclasses.replace(best, target_programs=best_target), rows


def tune_ragged(pool, matmul_fps: float) -> tuple[object, list]:
    rows = []
    candidates = [
        ragged_module.RaggedTiling(rows=r, block_k=bk, num_warps=w, num_stages=3)
        for r, bk, w in ((128, 64, 4), (128, 64, 8), (64, 64, 4), (128, 128, 8))
    ]
    best = (float("inf"), ragged_module._TILING)
    inputs = make_prefill_inputs(HEADS["llama-3-8b"], 16)
    futures = [
        pool.submit(lambda t: ragged_fn(128**-0.5, t).lower(*inputs).compile(), t)
        for t in candidates
    ]
    for t, future in zip(candidates, futures, strict=True):
        try:
            compiled = future.result()
        except Exception:  # noqa: BLE001 - measure_prefill reports the error
            compiled = None
        entry = measure_prefill("llama-3-8b", 16, t, matmul_fps, fn=compiled)
        rows.append({"phase": "ragged_tiling", **entry})
        if entry.get("correct") and entry.get("seconds", float("inf")) < best[0]:
            best = (entry["seconds"], t)
    return best[1], rows


# ------------------------------------------------------------------------------------------
# Report


def fmt_entry(entry: dict) -> str:
    if "error" in entry:
        return "error"
    if "seconds" not in entry:
        return "-"
    flag = "" if entry.get("correct", True) else " WRONG"
    return (
        f"{entry['seconds'] * 1e6:9.1f}us {entry['bytes_per_s'] / 1e12:5.2f}TB/s "
        f"{entry['pct_copy']:5.1f}%{flag}"
    )


def print_table(rows):
    log(f"{'shape':34s} | {'ours':32s} | {'JAX built-in':32s} | {'reference':32s} | x built-in")
    for row in rows:
        s = DecodeShape(**row["shape"])
        ours, builtin = row.get("ours", {}), row.get("builtin", {})
        ratio = (
            f"{builtin['seconds'] / ours['seconds']:.2f}"
            if "seconds" in ours and "seconds" in builtin
            else "-"
        )
        log(
            f"{s.label():34s} | {fmt_entry(ours):32s} | {fmt_entry(builtin):32s} | "
            f"{fmt_entry(row.get('reference', {})):32s} | {ratio}"
        )


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plot")
        return
    fig, axes = plt.subplots(1, len(HEADS), figsize=(7 * len(HEADS), 4.5), sharey=True)
    styles = {"ours": "C0", "builtin": "C1", "reference": "C2"}
    names = {
        "ours": "pallas_kernels.paged_attention",
        "builtin": "JAX built-in (Triton)",
        "reference": "gather + plain JAX",
    }
    for ax, heads in zip(axes, HEADS, strict=True):
        for block_size, marker in zip(BLOCK_SIZES, ("o-", "s--"), strict=True):
            sel = sorted(
                (
                    r
                    for r in rows
                    if r["shape"]["heads"] == heads and r["shape"]["block_size"] == block_size
                ),
                key=lambda r: (r["shape"]["batch"], r["shape"]["context"]),
            )
            labels = [f"B{r['shape']['batch']}\nctx{r['shape']['context']}" for r in sel]
            for impl, color in styles.items():
                ys = [r.get(impl, {}).get("pct_copy", np.nan) for r in sel]
                ax.plot(
                    range(len(sel)),
                    ys,
                    marker,
                    color=color,
                    markersize=4,
                    label=f"{names[impl]}, block {block_size}",
                )
            ax.set_xticks(range(len(sel)), labels, fontsize=7)
        ax.axhline(100, color="k", lw=0.5)
        ax.axhline(85, color="k", lw=0.5, ls=":")
        ax.set_title(f"decode, {heads} heads {HEADS[heads]}, bf16")
        ax.set_ylabel("K+V read / copy ceiling (%)")
    axes[0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def environment() -> dict:
    device = jax.devices()[0]
    env = {
        "jax": jax.__version__,
        "jaxlib": jax.lib.__version__,
        "device": device.device_kind,
        "platform": device.platform,
        "python": platform.python_version(),
    }
    try:
        import jaxlib.version

        env["jaxlib"] = jaxlib.version.__version__
    except ImportError:
        pass
    return env


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for kernels.json / kernels.png")
    parser.add_argument("--tune", action="store_true", help="tune tilings first and use the best")
    parser.add_argument("--quick", action="store_true", help="only the key shape, no sweep")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=240.0,
        help="stop starting new sweep shapes after this many seconds",
    )
    args = parser.parse_args()
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
    started = time.perf_counter()
    report = {"env": environment(), "command": " ".join(sys.argv)}
    log(report["env"])

    report["ceilings"] = {**copy_ceiling(), **matmul_ceiling()}
    copy_bps = report["ceilings"]["copy_bytes_per_s"]
    matmul_fps = report["ceilings"]["matmul_flops_per_s"]
    log(
        f"copy ceiling {copy_bps / 1e12:.3f} TB/s ({report['ceilings']}); "
        f"matmul ceiling {matmul_fps / 1e12:.1f} TFLOP/s"
    )

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=8)
    decode_tiling, ragged_tiling = decode_module._TILING, ragged_module._TILING
    if args.tune:
        try:
            decode_tiling, report["tune_decode"] = tune_decode(pool, copy_bps)
            ragged_tiling, report["tune_ragged"] = tune_ragged(pool, matmul_fps)
        except Exception as error:  # noqa: BLE001 - keep the defaults, still run the sweep
            log(f"tuning failed, defaults kept: {type(error).__name__}: {error}")
            report.setdefault("tune_decode", [])
            report.setdefault("tune_ragged", [])
        (out_dir / "kernels.json").write_text(json.dumps(report, indent=1))
        for row in report["tune_decode"] + report["tune_ragged"]:
            value = (
                f"{row['seconds'] * 1e6:8.1f}us" if "seconds" in row else row.get("error", "-")[:80]
            )
            extra = (
                f"{row['pct_copy']:5.1f}% copy"
                if "pct_copy" in row
                else f"{row['pct_matmul']:5.1f}% matmul"
                if "pct_matmul" in row
                else ""
            )
            log(
                f"tune {row['phase']:18s} {row.get('shape', ''):28s} {row['tiling']} {value} "
                f"{extra} err={row.get('rel_error', float('nan')):.2e}"
            )
        log(f"tuned decode {decode_tiling}; ragged {ragged_tiling}")
    report["decode_tiling"] = dataclasses.asdict(decode_tiling)
    report["ragged_tiling"] = dataclasses.asdict(ragged_tiling)

    shapes = [DecodeShape(**KEY_SHAPE)]
    if not args.quick:
        shapes += [
            DecodeShape(h, b, c, bs)
            for h in HEADS
            for bs in BLOCK_SIZES
            for b in BATCHES
            for c in CONTEXTS
            if DecodeShape(h, b, c, bs) != shapes[0]
        ]
    # Compile everything first, several at a time: compiling threads hold the GIL and would
    # slow the timing loop's dispatch.
    impls = {
        shape: {
            "ours": ours_fn(shape, decode_tiling),
            "builtin": builtin_fn(shape),
            "reference": reference_fn(shape),
        }
        for shape in shapes
    }
    futures = {shape: compile_ahead(pool, shape, impls[shape]) for shape in shapes}
    concurrent.futures.wait([f for fs in futures.values() for f in fs.values()])
    log(f"compiled {len(shapes)} shapes x 3 in {time.perf_counter() - started:.0f} s (so far)")
    report["dispatch_floor_s"] = dispatch_floor()
    log(f"host dispatch floor {report['dispatch_floor_s'] * 1e6:.1f} us per call")
    rows = []
    for shape in shapes:
        if time.perf_counter() - started > args.budget_s:
            rows.append({"shape": dataclasses.asdict(shape), "skipped": "time budget"})
            for future in futures[shape].values():
                future.cancel()
            continue
        row = measure_decode(shape, resolve(futures[shape], impls[shape]), copy_bps)
        rows.append(row)
        report["decode"] = rows
        (out_dir / "kernels.json").write_text(json.dumps(report, indent=1))
        ours = row.get("ours", {})
        log(
            f"{shape.label():34s} ours {fmt_entry(ours)}  builtin {fmt_entry(row['builtin'])}  "
            f"reference {fmt_entry(row['reference'])}  err {ours.get('rel_error')}"
        )
    pool.shutdown()
    report["decode"] = rows

    report["prefill"] = [
        measure_prefill(h, bs, ragged_tiling, matmul_fps) for h in HEADS for bs in BLOCK_SIZES
    ]
    report["seconds"] = time.perf_counter() - started
    (out_dir / "kernels.json").write_text(json.dumps(report, indent=1))
    plot([r for r in rows if "skipped" not in r], out_dir / "kernels.png")

    log("\n== decode (bf16, every sequence at the full context) ==")
    print_table([r for r in rows if "skipped" not in r])
    log(f"\n== ragged prefill ({PREFILL_PROMPTS} prompts x {PREFILL_LEN} tokens from scratch) ==")
    for e in report["prefill"]:
        if "seconds" in e:
            log(
                f"{e['heads']:12s} bs{e['block_size']}: {e['seconds'] * 1e3:.3f} ms, "
                f"{e['flops_per_s'] / 1e12:.1f} TFLOP/s = {e['pct_matmul']:.1f}% of matmul "
                f"ceiling, {e['tokens_per_s']:.0f} tok/s, err {e['rel_error']:.1e}"
            )
        else:
            log(e)
    key = rows[0]
    ours, builtin = key.get("ours", {}), key.get("builtin", {})
    if "seconds" in ours and "seconds" in builtin:
        pct, ratio = ours["pct_copy"], builtin["seconds"] / ours["seconds"]
        log(
            f"\nKEY {DecodeShape(**key['shape']).label()}: ours "
            f"{ours['bytes_per_s'] / 1e12:.3f} TB/s = {pct:.1f}% of copy "
            f"({'PASS' if pct >= 85 else 'FAIL'} >= 85%), {ratio:.2f}x JAX built-in "
            f"({'PASS' if ratio >= 1.8 else 'FAIL'} >= 1.8x)"
        )
    log(f"total {report['seconds']:.0f} s")


if __name__ == "__main__":
    main()
