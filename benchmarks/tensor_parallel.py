"""Tensor parallelism on 2 GPUs: a 72B model that one H200 cannot hold, and TP's batch-1 latency.

Phases (each in its own process, so each starts with empty GPUs, under its own time limit):

- ``qwen72b``: Qwen2.5-72B-Instruct shapes, dummy bf16 weights, ``tensor_parallel_size=2``,
  ``max_model_len=32768``, ``gpu_memory_utilization=0.90`` (vLLM's published recipe). Prints
  start-up time and the KV budget (GiB, blocks, tokens), then a throughput pass: ``--num-prompts``
  requests of token ids with ShareGPT-like lengths, run once to compile the buckets it uses and
  once timed (no compilation in the timed pass; the count is printed).
- ``llama8b-tp1`` / ``llama8b-tp2``: Llama-3-8B shapes, batch 1, one 512-token prompt, 128
  greedy output tokens; time per output token (TPOT) after one warm-up request.

Usage on a 2-GPU host (~6 minutes)::

    python benchmarks/tensor_parallel.py            # all phases, then a summary table
    python benchmarks/tensor_parallel.py --phases qwen72b --num-prompts 1000 \
        --warmup-prompts 200 --max-num-seqs 256 --qwen-limit 540

JAX preallocates a fraction of GPU memory and reports that pool as the device limit; this
script sets ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.92`` for its phases (unless already set) so that
``gpu_memory_utilization=0.90`` means 0.9 of the device, as in vLLM, with some slack in the pool.
Leave at least ~8% of the device outside the pool: NCCL and XLA's all-reduce scratch allocate
there (at 0.95 the 72B run failed to allocate all-reduce scratch).

The 72B phase compiles every step bucket at start-up (in parallel, before the KV cache is
allocated), so its warm-up pass only warms and the timed pass compiles nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = REPO / "benchmarks" / "configs"
PHASES = {"qwen72b": 270, "llama8b-tp1": 90, "llama8b-tp2": 90}  # name -> time limit (s)
GIB = 1024**3


def _sharegpt_like_lengths(num_prompts: int, seed: int = 0):
    """(input, output) token counts drawn from log-normals shaped like ShareGPT's (medians
    ~170 in / ~150 out, long right tails), clipped to [4, 1024] and [4, 512]."""
    import numpy as np

    rng = np.random.default_rng(seed)
    inputs = np.clip(rng.lognormal(np.log(170), 0.9, num_prompts), 4, 1024).astype(int)
    outputs = np.clip(rng.lognormal(np.log(150), 0.8, num_prompts), 4, 512).astype(int)
    return inputs.tolist(), outputs.tolist()


def _record(out_path: str, **values) -> None:
    """Merge ``values`` into the phase's JSON file now, so a phase that times out still
    reports what it measured."""
    path = pathlib.Path(out_path)
    data = json.loads(path.read_text()) if path.exists() and path.read_text() else {}
    data.update(values)
    path.write_text(json.dumps(data))
    print(json.dumps(values), flush=True)


def _stories_tokenizer() -> str:
    from jaxpaged.config import default_model_path

    return default_model_path()  # prompts are token ids; any tokenizer decodes the outputs


def run_qwen72b(args) -> None:
    import jax
    import numpy as np

    from jaxpaged import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        model=args.qwen_config, tokenizer=_stories_tokenizer(),
        load_format="dummy", dtype="bfloat16", tensor_parallel_size=2, max_model_len=32768,
        gpu_memory_utilization=0.90, max_num_seqs=args.max_num_seqs, enforce_eager=False,
        async_scheduling=args.async_scheduling,
    )  # fmt: skip
    engine = llm.llm_engine
    engine.wait_for_executables()  # a warm start loads buckets in the background
    spec = engine.worker.kv_cache_spec
    kv_bytes = engine.num_blocks * spec.bytes_per_block
    stats = jax.local_devices()[0].memory_stats() or {}
    _record(
        args.out,
        startup_s=round(time.perf_counter() - start, 1),
        compile_s=round(engine.worker.compile_seconds, 1),
        kv_gib_total=round(kv_bytes / GIB, 2),
        kv_gib_per_device=round(kv_bytes / 2 / GIB, 2),
        kv_blocks=engine.num_blocks,
        kv_tokens=engine.num_blocks * spec.block_size,
        device_limit_gib=round(stats.get("bytes_limit", 0) / GIB, 1),
    )

    inputs, outputs = _sharegpt_like_lengths(args.num_prompts)
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": rng.integers(0, 152064, n).tolist()} for n in inputs]
    params = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in outputs]
    warm = time.perf_counter()
    # Compiles the buckets this workload uses; the timed pass counts any it still meets.
    llm.generate(prompts[: args.warmup_prompts], params[: args.warmup_prompts], use_tqdm=False)
    compiles = engine.worker.model_runner.num_compilations
    llm.reset_prefix_cache()  # the timed pass reads nothing the warm-up cached
    _record(args.out, warmup_pass_s=round(time.perf_counter() - warm, 1), compilations=compiles)
    timed = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - timed
    num_out = sum(len(r.outputs[0].token_ids) for r in results)
    num_total = num_out + sum(inputs)
    print(
        f"Throughput: {len(results) / elapsed:.2f} requests/s, {num_total / elapsed:.2f} total "
        f"tokens/s, {num_out / elapsed:.2f} output tokens/s",
        flush=True,
    )
    _record(
        args.out,
        requests_per_s=round(len(results) / elapsed, 2),
        total_tokens_per_s=round(num_total / elapsed, 1),
        output_tokens_per_s=round(num_out / elapsed, 1),
        timed_pass_compilations=engine.worker.model_runner.num_compilations - compiles,
    )


def run_llama8b(args, tp: int) -> None:
    import numpy as np

    from jaxpaged import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        model=args.llama_config, tokenizer=_stories_tokenizer(), load_format="dummy",
        dtype="bfloat16", tensor_parallel_size=tp, max_model_len=1024, max_num_seqs=1,
        max_num_batched_tokens=512, num_gpu_blocks_override=64, enforce_eager=True,
        async_scheduling=args.async_scheduling,
    )  # fmt: skip
    _record(args.out, startup_s=round(time.perf_counter() - start, 1))
    prompt = {"prompt_token_ids": np.random.default_rng(2).integers(0, 128256, 512).tolist()}
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)  # warm-up: compiles prefill + decode
    tpots = []
    for _ in range(3):
        (result,) = llm.generate([prompt], params, use_tqdm=False)
        metrics, n = result.metrics, len(result.outputs[0].token_ids)
        tpots.append((metrics["finished_time"] - metrics["first_token_time"]) / (n - 1))
    _record(args.out, tpot_ms=round(1e3 * float(np.median(tpots)), 2))


def _run_phase(name: str, args) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    command = [
        sys.executable,
        __file__,
        "--phase",
        name,
        "--out",
        out,
        "--num-prompts",
        str(args.num_prompts),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--qwen-config",
        args.qwen_config,
        "--llama-config",
        args.llama_config,
    ]
    if args.warmup_prompts is not None:
        command += ["--warmup-prompts", str(args.warmup_prompts)]
    if args.async_scheduling:
        command.append("--async-scheduling")
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    limit = args.qwen_limit if name == "qwen72b" and args.qwen_limit else PHASES[name]
    print(f"=== {name} (limit {limit} s)", flush=True)
    try:
        proc = subprocess.run(command, env=env, timeout=limit, check=False)
        status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        status = f"timeout {limit} s"
    text = pathlib.Path(out).read_text()
    return {"status": status, **(json.loads(text) if text else {})}


def _summary(results: dict) -> None:
    q = results.get("qwen72b", {})
    print(
        "\n## Qwen2.5-72B-Instruct (dummy bf16), tensor_parallel_size=2, max_model_len=32768, "
        "gpu_memory_utilization=0.90"
    )
    print(
        "| status | start-up s | KV GiB (per device) | KV blocks | KV tokens | warm-up s | "
        "compiles | req/s | total tok/s | output tok/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {q.get('status')} | {q.get('startup_s')} | {q.get('kv_gib_total')} "
        f"({q.get('kv_gib_per_device')}) | {q.get('kv_blocks')} | {q.get('kv_tokens')} | "
        f"{q.get('warmup_pass_s')} | {q.get('compilations')} | {q.get('requests_per_s')} | "
        f"{q.get('total_tokens_per_s')} | {q.get('output_tokens_per_s')} |"
    )
    print("\n## Llama-3-8B (dummy bf16), batch 1, 512-token prompt, 128 output tokens")
    print("| tensor_parallel_size | status | start-up s | TPOT ms |")
    print("|---|---|---|---|")
    for tp in (1, 2):
        r = results.get(f"llama8b-tp{tp}", {})
        print(f"| {tp} | {r.get('status')} | {r.get('startup_s')} | {r.get('tpot_ms')} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", choices=sorted(PHASES), help="run one phase in this process")
    parser.add_argument("--out", help="JSON file a phase writes its results to")
    parser.add_argument("--num-prompts", type=int, default=200, help="requests of the 72B pass")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="batch limit of the 72B pass")
    parser.add_argument(
        "--warmup-prompts", type=int, default=None, help="requests of the 72B warm-up pass (all)"
    )
    parser.add_argument("--qwen-limit", type=int, default=None, help="time limit of the 72B phase")
    parser.add_argument(
        "--phases", default=",".join(PHASES), help="comma-separated phases to run, in order"
    )
    parser.add_argument(
        "--async-scheduling", action="store_true", help="engines run with async scheduling"
    )
    # Other config directories (same layouts, e.g. tiny ones for a dry run of this script).
    parser.add_argument("--qwen-config", default=str(CONFIGS / "qwen2.5-72b-instruct"))
    parser.add_argument("--llama-config", default=str(CONFIGS / "llama-3-8b"))
    args = parser.parse_args()
    if args.phase == "qwen72b":
        run_qwen72b(args)
    elif args.phase is not None:
        run_llama8b(args, tp=int(args.phase[-1]))
    else:
        results = {name: _run_phase(name, args) for name in args.phases.split(",")}
        _summary(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
