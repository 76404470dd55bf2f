"""``benchmarks/moe.py --sweep``: the grouped GEMM's tiles and the decode path, timed
within a budget (stages and output: ``benchmarks/moe.py``'s docstring)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from models.moe import grouped_swiglu, route
from pallas_kernels import grouped_matmul as gm
from pallas_kernels.expert_gemv import ExpertGemvTiling

SMEM_BYTES = 227 * 1024  # H100/H200 dynamic shared memory per block
WRONG = 2e-2  # max |diff| / max |ref| above which a config's output is wrong
DEFAULT = gm.DEFAULT_TILES


def _grid(smoke: bool) -> list[gm.MosaicTiles]:
    """Step 1's configs (grid_block_n 1), most promising first, those that fit in SMEM."""
    if smoke:
        return [DEFAULT, gm.MosaicTiles(block_m=64), gm.MosaicTiles(block_k=128)]
    configs = []
    for bm, bn, bk, steps in itertools.product((64, 128), (128, 256), (64, 128), (2, 3, 4, 5, 6)):
        if bm * bn > 128 * 128:  # one warpgroup's float32 accumulator: 128 registers a thread
            continue
        smem = (bm + bn) * bk * 2 * steps + bm * bn * 2  # stages + the output tile
        if smem > SMEM_BYTES:
            continue
        configs.append(gm.MosaicTiles(bm, bn, bk, steps, 1))
    # Row tiles of 64 waste less on tiles straddling experts (M = 2048 with 128-row tiles:
    # cdiv(M, 128) + E - 1 = 23 tiles for 16 tiles' worth of rows): try them early.
    configs.sort(key=lambda t: (t != DEFAULT, t.block_m != 64, t.block_k != 64,
                                abs(t.max_concurrent_steps - 4)))  # fmt: skip
    return configs


class _Clock:
    """The budget, and the share of it the current stage may run until (``stage``)."""

    def __init__(self, budget_s: float):
        self.start = time.perf_counter()
        self.budget_s = budget_s
        self.stop_at = self.start + budget_s

    def stage(self, name: str, until_fraction: float) -> None:
        self.stop_at = self.start + until_fraction * self.budget_s
        print(f"[{self.now():6.1f}s] stage {name} (until {until_fraction * self.budget_s:.0f} s)",
              flush=True)  # fmt: skip

    def left(self) -> float:
        return self.stop_at - time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.start


def _time(fn, *args, reps: int, rounds: int = 3) -> float:
    """Seconds per call: ``reps`` calls dispatched back to back, best of ``rounds`` (the first
    call compiles and is not timed)."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        out = None
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / reps)
    return best


@jax.jit
def _rel_diff_device(out, ref):
    out, ref = out.astype(jnp.float32), ref.astype(jnp.float32)
    return jnp.max(jnp.abs(out - ref)) / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-30)


def _rel_diff(out, ref) -> float:
    """max |out - ref| / max |ref|, on the device (outputs of 2048 x 28672 and more)."""
    return float(_rel_diff_device(jnp.asarray(out), jnp.asarray(ref)))


def sweep(args, cfg: dict) -> None:
    clock = _Clock(args.budget_s)
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    num_experts, top_k = cfg["num_local_experts"], cfg["num_experts_per_tok"]
    smoke = args.smoke
    dtype = jnp.float32 if smoke else jnp.bfloat16
    keys = jax.random.split(jax.random.key(0), 4)
    gate_up = (0.02 * jax.random.normal(keys[0], (num_experts, hidden, 2 * inter))).astype(dtype)
    down = (0.02 * jax.random.normal(keys[1], (num_experts, inter, hidden))).astype(dtype)
    router = (0.02 * jax.random.normal(keys[2], (hidden, num_experts))).astype(dtype)
    weights_of = {"gate_up": gate_up, "down": down}
    peak = args.peak_tflops * 1e12
    records: list[dict] = []
    print(f"device: {jax.devices()[0].device_kind}; hidden {hidden}, I {inter}, E {num_experts}, "
          f"k {top_k}, {jnp.dtype(dtype).name}, budget {args.budget_s:.0f} s", flush=True)  # fmt: skip

    def emit(rec: dict) -> None:
        rec["t_s"] = round(clock.now(), 1)
        records.append(rec)
        if "error" in rec:
            print(f"[{rec['t_s']:6.1f}s] {rec['stage']} {rec.get('matmul', '')} "
                  f"T={rec['num_tokens']} {rec.get('tiles', '')}: FAILED {rec['error'][:200]}",
                  flush=True)  # fmt: skip
            return
        print(f"[{rec['t_s']:6.1f}s] {rec['stage']} {rec.get('matmul', rec.get('path', ''))} "
              f"T={rec['num_tokens']} {rec.get('tiles', '')} {rec['seconds'] * 1e3:.3f} ms "
              f"{rec.get('of_peak', 0):.1%} diff {rec.get('rel_diff', float('nan')):.1e}",
              flush=True)  # fmt: skip

    def x_of(num_tokens: int) -> jax.Array:
        return jax.random.normal(jax.random.fold_in(keys[3], num_tokens), (num_tokens, hidden),
                                 dtype)  # fmt: skip

    # ---------------------------------------------------------------- the grouped matmuls
    inputs: dict = {}

    def matmul_inputs(num_tokens: int, name: str):
        """Sorted rows and group sizes of a random routing, and XLA's ragged dot on them."""
        if (num_tokens, name) not in inputs:
            x = x_of(num_tokens)
            _, ids = route(x @ router, top_k)
            flat = ids.reshape(-1)
            sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
            k_dim = hidden if name == "gate_up" else inter
            lhs = jax.random.normal(jax.random.fold_in(keys[3], 7 + num_tokens),
                                    (flat.shape[0], k_dim), dtype)  # fmt: skip
            rhs = weights_of[name]
            ref = jax.jit(lambda a, b, s: jax.lax.ragged_dot(
                a, b, s, preferred_element_type=jnp.float32))(lhs, rhs, sizes)  # fmt: skip
            inputs[num_tokens, name] = (lhs, rhs, sizes, ref)
        return inputs[num_tokens, name]

    def run_matmul(stage: str, num_tokens: int, name: str, tiles: gm.MosaicTiles) -> dict | None:
        if clock.left() <= 0:
            return None
        lhs, rhs, sizes, ref = matmul_inputs(num_tokens, name)
        m, k_dim = lhs.shape
        n_dim = rhs.shape[2]
        rec = dict(stage=stage, matmul=name, num_tokens=num_tokens, m=m, k=k_dim, n=n_dim,
                   tiles=dataclasses.asdict(tiles))  # fmt: skip
        if smoke:  # CPU stand-in: XLA's ragged dot ignores the tiles; one config "fails"
            if tiles.block_k == 128:
                emit({**rec, "error": "smoke: stand-in failure (exercises the error path)"})
                return None
            fn = jax.jit(lambda a, b, s: gm.grouped_matmul(a, b, s, backend="xla"))
        else:
            fn = jax.jit(lambda a, b, s: gm.grouped_matmul(a, b, s, backend="mosaic_gpu",
                                                           tiles=tiles))  # fmt: skip
        try:
            out = fn(lhs, rhs, sizes)
            seconds = _time(fn, lhs, rhs, sizes, reps=3 if smoke else 10)
        except Exception as e:  # noqa: BLE001 - a config that does not compile is a result
            emit({**rec, "error": f"{type(e).__name__}: {str(e)[:1000]}"})
            return None
        flops = 2.0 * m * k_dim * n_dim
        rec.update(seconds=seconds, tflops=flops / seconds / 1e12, of_peak=flops / seconds / peak,
                   rel_diff=_rel_diff(out, ref))  # fmt: skip
        rec["wrong"] = rec["rel_diff"] > WRONG
        emit(rec)
        return rec

    def best(num_tokens: int, name: str, count: int) -> list[gm.MosaicTiles]:
        ok = [r for r in records if r.get("matmul") == name and r["num_tokens"] == num_tokens
              and "seconds" in r and not r["wrong"]]  # fmt: skip
        ok.sort(key=lambda r: r["seconds"])
        out: list[gm.MosaicTiles] = []
        for r in ok:
            t = gm.MosaicTiles(**r["tiles"])
            if t not in out:
                out.append(t)
        return out[:count]

    # ---------------------------------------------------------------- the whole layer
    def run_layer(stage: str, num_tokens: int, path: str, gemv_tiling=None) -> dict | None:
        if clock.left() <= 0:
            return None
        x = x_of(num_tokens)
        backend = "xla" if smoke and path == "mosaic_gpu" else path
        moe_kwargs = dict(interpret=smoke) if path == "gemv" else {}
        if gemv_tiling is not None:  # pallas_kernels.expert_gemv's tiling, through the module
            import pallas_kernels.expert_gemv as eg  # noqa: PLC0415

            eg.DEFAULT_TILING = gemv_tiling  # read at trace time by expert_gemv's default
            jax.clear_caches()

        @jax.jit
        def moe(x, router, gate_up, down):
            weights, ids = route(x @ router, top_k)
            return grouped_swiglu(x, weights, ids, gate_up, down, precision=None,
                                  backend=backend, **moe_kwargs)  # fmt: skip

        rec = dict(stage=stage, path=path, num_tokens=num_tokens,
                   tiles=None if gemv_tiling is None else dataclasses.asdict(gemv_tiling))  # fmt: skip
        try:
            out = moe(x, router, gate_up, down)
            seconds = _time(moe, x, router, gate_up, down, reps=3 if smoke else 20)
        except Exception as e:  # noqa: BLE001
            emit({**rec, "error": f"{type(e).__name__}: {str(e)[:1000]}"})
            return None
        finally:
            if gemv_tiling is not None:
                eg.DEFAULT_TILING = ExpertGemvTiling()
        flops = 2.0 * num_tokens * top_k * 3 * hidden * inter
        _, ids = route(x @ router, top_k)
        used = len(np.unique(np.asarray(ids)))
        expert_bytes = 3 * hidden * inter * jnp.dtype(dtype).itemsize
        rec.update(seconds=seconds, of_peak=flops / seconds / peak, experts_used=used,
                   active_floor_s=used * expert_bytes / (args.hbm_tbps * 1e12),
                   all_experts_floor_s=num_experts * expert_bytes / (args.hbm_tbps * 1e12),
                   output=out)  # fmt: skip
        emit(rec)
        return rec

    # Step 1: T = 1024, the grid, both matmuls per config (so both progress under the budget).
    main_t = 64 if smoke else 1024
    clock.stage("1-grid", 0.40)
    for tiles in _grid(smoke):
        for name in ("gate_up", "down"):
            run_matmul("1-grid", main_t, name, tiles)
    # Step 2: grid_block_n on the best three of each.
    clock.stage("2-grid_block_n", 0.52)
    for name in ("gate_up", "down"):
        for tiles in best(main_t, name, 3):
            for gbn in (2, 4, 8):
                run_matmul("2-grid_block_n", main_t, name,
                           dataclasses.replace(tiles, grid_block_n=gbn))  # fmt: skip
    # Step 3: decode, the whole layer: grouped GEMM against the chosen-experts path.
    decode_ts = (1, 4) if smoke else (1, 4, 16, 64)
    clock.stage("3-decode", 0.70)
    for num_tokens in decode_ts:
        grouped = run_layer("3-decode", num_tokens, "mosaic_gpu")
        gemv = run_layer("3-decode", num_tokens, "gemv")
        if grouped and gemv:
            gemv["rel_diff"] = _rel_diff(gemv["output"], grouped["output"])
            print(f"    T={num_tokens}: gemv vs grouped output diff {gemv['rel_diff']:.1e}; "
                  f"gemv {gemv['seconds'] / grouped['seconds']:.2f}x the grouped time; "
                  f"floors: active {gemv['active_floor_s'] * 1e3:.3f} ms, all experts "
                  f"{gemv['all_experts_floor_s'] * 1e3:.3f} ms", flush=True)  # fmt: skip
    for num_tokens in decode_ts[:: len(decode_ts) - 1]:  # first and last
        for tiling in (ExpertGemvTiling(block_n=64), ExpertGemvTiling(block_n=256),
                       ExpertGemvTiling(block_k=256, num_stages=2)):  # fmt: skip
            run_layer("3-decode-tiling", num_tokens, "gemv", tiling)

    # Step 4/5: the whole layer with the winners, and the other batch sizes.
    def layer_with_winners(num_tokens: int) -> None:
        winners = {name: (best(num_tokens, name, 1) or [DEFAULT])[0] for name in weights_of}
        base = run_layer("layer-default", num_tokens, "mosaic_gpu")
        gm.TILE_TABLE = tuple((1 << 30, w.shape[1], w.shape[2], winners[name])
                              for name, w in weights_of.items())  # fmt: skip
        jax.clear_caches()  # the table is read at trace time
        try:
            tuned = run_layer("layer-winners", num_tokens, "mosaic_gpu")
        finally:
            gm.TILE_TABLE = ()
            jax.clear_caches()
        if tuned is not None:
            tuned["winners"] = {k: dataclasses.asdict(v) for k, v in winners.items()}
            if base is not None:
                tuned["rel_diff"] = _rel_diff(tuned["output"], base["output"])
        if clock.left() > 0:
            rows = jnp.tile(x_of(num_tokens), (top_k, 1))

            @jax.jit
            def dense(rows, w_gate_up, w_down):
                g, u = jnp.split(rows @ w_gate_up, 2, axis=-1)
                return (jax.nn.silu(g) * u) @ w_down

            seconds = _time(dense, rows, gate_up[0], down[0], reps=3 if smoke else 20)
            flops = 2.0 * num_tokens * top_k * 3 * hidden * inter
            emit(dict(stage="layer-plain-gemms", path="plain GEMMs", num_tokens=num_tokens,
                      seconds=seconds, of_peak=flops / seconds / peak))  # fmt: skip

    clock.stage("4-layer", 0.80)
    layer_with_winners(main_t)
    clock.stage("5-other-T", 1.0)
    other_ts = (32,) if smoke else (256, 4096)
    for num_tokens in other_ts:
        for name in ("gate_up", "down"):
            candidates = [DEFAULT] + [t for t in best(main_t, name, 3) if t != DEFAULT]
            for tiles in candidates:
                run_matmul("5-other-T", num_tokens, name, tiles)
    for num_tokens in other_ts:
        layer_with_winners(num_tokens)
    _report(args, cfg, records, clock)


def _report(args, cfg: dict, records: list[dict], clock: _Clock) -> None:
    print(f"\n== sorted (% of {args.peak_tflops:.0f} TFLOP/s), {clock.now():.0f} s in all ==")
    matmuls = [r for r in records if "matmul" in r and "seconds" in r]
    for key in sorted({(r["num_tokens"], r["matmul"]) for r in matmuls}):
        rows = sorted((r for r in matmuls if (r["num_tokens"], r["matmul"]) == key),
                      key=lambda r: r["seconds"])  # fmt: skip
        print(f"-- {key[1]} T={key[0]} (M={rows[0]['m']}, K={rows[0]['k']}, N={rows[0]['n']})")
        print(f"{'bm':>4} {'bn':>4} {'bk':>4} {'st':>3} {'gbn':>3} {'ms':>8} {'of peak':>8} "
              f"{'diff':>8}")  # fmt: skip
        for r in rows:
            t = r["tiles"]
            print(f"{t['block_m']:>4} {t['block_n']:>4} {t['block_k']:>4} "
                  f"{t['max_concurrent_steps']:>3} {t['grid_block_n']:>3} "
                  f"{r['seconds'] * 1e3:>8.3f} {r['of_peak']:>8.1%} {r['rel_diff']:>8.1e}"
                  f"{'  WRONG' if r['wrong'] else ''}")  # fmt: skip
    print("\n-- whole MoE layer")
    for r in records:
        if "path" in r and "seconds" in r:
            extra = ""
            if "active_floor_s" in r:
                extra = (f" experts used {r['experts_used']}, floor active "
                         f"{r['active_floor_s'] * 1e3:.3f} / all {r['all_experts_floor_s'] * 1e3:.3f} ms")  # fmt: skip
            print(f"{r['stage']:>18} {r['path']:>11} T={r['num_tokens']:>5} "
                  f"{r['seconds'] * 1e3:>8.3f} ms {r['of_peak']:>7.1%}"
                  f"{'' if r.get('tiles') is None else ' ' + str(r['tiles'])}{extra}")  # fmt: skip
    print("\n-- TILE_TABLE entries (pallas_kernels/grouped_matmul.py), best per (T, matmul):")
    table = []
    for key in sorted({(r["num_tokens"], r["matmul"]) for r in matmuls}):
        ok = [r for r in matmuls if (r["num_tokens"], r["matmul"]) == key and not r["wrong"]]
        if ok:
            r = min(ok, key=lambda r: r["seconds"])
            table.append(r)
            t = gm.MosaicTiles(**r["tiles"])
            print(f"    ({r['m']}, {r['k']}, {r['n']}, {t!r}),  # {r['of_peak']:.1%}")
    if args.output_json:
        for r in records:
            r.pop("output", None)
        with open(args.output_json, "w") as f:
            json.dump(dict(config=cfg, results=records, best=table,
                           total_s=clock.now()), f, indent=1)  # fmt: skip
        print(f"wrote {args.output_json}")
