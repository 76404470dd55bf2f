"""Multi-LoRA cost: throughput with many adapters and batch-1 TPOT with one, vs the base model.

One process runs one engine (``--num-adapters 0``: LoRA off, the base model alone); the job
``benchmarks/lora.sh`` runs it once for the base and once with adapters, then
prints the ratios. Adapters are random PEFT directories of real shapes written on the fly
(``jaxpaged.lora.dummy``), spread round-robin over the requests. Also, with ``--micro``, an
XLA micro-benchmark of one projection with and without ``models.lora.lora_delta`` (the
batched LoRA matmul) at a few token counts: the evidence for or against a Pallas kernel.

Result lines::

    Throughput: X requests/s, Y total tokens/s, Z output tokens/s
    Batch-1 TPOT: T ms
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from jaxpaged.benchmarks.dataset import make_requests  # noqa: E402
from jaxpaged.entrypoints.cli_args import add_engine_args, engine_args_from  # noqa: E402
from jaxpaged.entrypoints.env import set_jax_memory_fraction  # noqa: E402

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-adapters", type=int, default=8, help="0: base model, no LoRA")
    parser.add_argument("--adapter-rank", type=int, default=16, help="rank of every adapter")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--tpot-iters", type=int, default=3, help="batch-1 requests timed")
    parser.add_argument("--micro", action="store_true", help="also time the LoRA matmul alone")
    parser.add_argument("--output-json", default=None)
    add_engine_args(parser)
    return parser


def write_adapters(engine, args, root: str) -> list:
    from jaxpaged.lora.dummy import write_random_peft_adapter
    from jaxpaged.lora.request import LoRARequest
    from models.lora import llama_projection_specs

    config = engine.worker.hf_config
    requests = []
    for i in range(args.num_adapters):
        path = write_random_peft_adapter(
            f"{root}/adapter{i}",
            specs=llama_projection_specs(config),
            num_layers=config.num_hidden_layers,
            rank=args.adapter_rank,
            lora_alpha=2.0 * args.adapter_rank,
            target_modules=ALL_TARGETS,
            seed=i,
            dtype="float16",
        )
        requests.append(LoRARequest(f"adapter{i}", i + 1, path))
    return requests


def run(engine, requests, adapters, *, tag: str) -> tuple[float, int]:
    """Queue ``requests`` (adapters round-robin; none if empty), step to the end."""
    from jaxpaged.sampling_params import SamplingParams

    start = time.perf_counter()
    for i, request in enumerate(requests):
        params = SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=request.output_len)
        lora = adapters[i % len(adapters)] if adapters else None
        engine.add_request(
            f"{tag}-{i}",
            {"prompt_token_ids": request.prompt_token_ids},
            params,
            final_only=True,
            lora_request=lora,
        )
    num_tokens = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            num_tokens += len(output.outputs[0].token_ids)
    return time.perf_counter() - start, num_tokens


def batch1_tpot(engine, request, adapter, *, iters: int) -> float:
    """Mean seconds per output token after the first, one request alone."""
    from jaxpaged.sampling_params import SamplingParams

    tpots = []
    for it in range(iters):
        params = SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=request.output_len)
        engine.add_request(
            f"tpot-{it}", {"prompt_token_ids": request.prompt_token_ids}, params,
            lora_request=adapter,
        )  # fmt: skip
        first = last = None
        while engine.has_unfinished_requests():
            if engine.step():
                last = time.perf_counter()
                first = first or last
        tpots.append((last - first) / (request.output_len - 1))
    return sum(tpots) / len(tpots)


def micro_benchmark(hf_config, dtype, max_loras: int, rank: int) -> list[dict]:
    """Time ``x @ W`` vs ``x @ W + lora_delta`` for qkv_proj and gate_up_proj (XLA)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from models.lora import llama_projection_specs, lora_delta

    rows = []
    for name, spec in llama_projection_specs(hf_config).items():
        if name not in ("qkv_proj", "gate_up_proj"):
            continue
        cols = max_loras * len(spec.part_sizes) * rank
        key = jax.random.key(0)
        w = jax.random.normal(key, (spec.in_features, spec.out_features), dtype) * 0.02
        a = jax.random.normal(key, (spec.in_features, cols), dtype) * 0.02
        b = jax.random.normal(key, (cols, spec.out_features), dtype) * 0.02
        base = jax.jit(lambda x, w: x @ w)
        with_lora = jax.jit(
            lambda x, w, s, a, b: x @ w + lora_delta(x, s, a, b, max_loras=max_loras)
        )
        for num_tokens in (1, 256, 4096):
            x = jax.random.normal(key, (num_tokens, spec.in_features), dtype)
            slots = jnp.asarray(np.arange(num_tokens) % max_loras, jnp.int32)
            timings = {}
            for label, fn, fargs in (
                ("base", base, (x, w)),
                ("lora", with_lora, (x, w, slots, a, b)),
            ):
                fn(*fargs).block_until_ready()
                start = time.perf_counter()
                for _ in range(50):
                    out = fn(*fargs)
                out.block_until_ready()
                timings[label] = (time.perf_counter() - start) / 50
            rows.append(
                {
                    "projection": name,
                    "tokens": num_tokens,
                    "base_us": 1e6 * timings["base"],
                    "lora_us": 1e6 * timings["lora"],
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.num_adapters:
        args.enable_lora = True
        args.max_loras = max(args.max_loras, args.num_adapters)
        args.max_cpu_loras = max(args.max_cpu_loras or 0, args.max_loras)
        args.max_lora_rank = max(args.max_lora_rank, args.adapter_rank)
    engine_args = engine_args_from(args)
    set_jax_memory_fraction(engine_args.gpu_memory_utilization)
    from jaxpaged.entrypoints.llm import LLM

    start = time.perf_counter()
    llm = LLM(**vars(engine_args))
    engine = llm.llm_engine
    engine.wait_for_executables()  # a warm start loads buckets in the background
    print(f"engine ready in {time.perf_counter() - start:.1f} s", flush=True)
    vocab = engine.vocab_size
    requests = make_requests(
        "random", num_prompts=args.num_prompts, input_len=args.input_len,
        output_len=args.output_len, vocab_size=vocab, seed=0,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as root:
        adapters = write_adapters(engine, args, root) if args.num_adapters else []
        for adapter in adapters:  # read and checked before timing (the host LRU holds all)
            engine.add_lora(adapter)
        warm = make_requests(
            "random", num_prompts=16, input_len=16, output_len=4, vocab_size=vocab, seed=1
        )
        run(engine, warm, adapters, tag="warmup")
        engine.reset_prefix_cache()
        elapsed, num_tokens = run(engine, requests, adapters, tag="timed")
        if num_tokens != args.num_prompts * args.output_len:
            raise RuntimeError(f"generated {num_tokens} tokens, expected the full outputs")
        engine.reset_prefix_cache()
        tpot = batch1_tpot(
            engine, requests[0], adapters[0] if adapters else None, iters=args.tpot_iters
        )
    total = num_tokens + sum(r.prompt_len for r in requests)
    result = {
        "num_adapters": args.num_adapters,
        "adapter_rank": args.adapter_rank,
        "elapsed_time": elapsed,
        "output_tokens_per_second": num_tokens / elapsed,
        "tokens_per_second": total / elapsed,
        "requests_per_second": len(requests) / elapsed,
        "batch1_tpot_seconds": tpot,
    }
    if engine.lora_manager is not None:
        result["slot_writes"] = engine.lora_manager.slots.num_writes
        result["lora_slot_bytes"] = engine.lora_manager.slots.nbytes
    if args.micro:
        result["micro"] = micro_benchmark(
            engine.worker.hf_config,
            engine.worker.dtype,
            max(args.num_adapters, 1),
            args.adapter_rank,
        )
    print(
        f"Throughput: {result['requests_per_second']:.2f} requests/s, "
        f"{result['tokens_per_second']:.2f} total tokens/s, "
        f"{result['output_tokens_per_second']:.2f} output tokens/s"
    )
    print(f"Batch-1 TPOT: {1000 * tpot:.3f} ms")
    for row in result.get("micro", []):
        print(
            f"micro {row['projection']:>12} T={row['tokens']:>5}: base {row['base_us']:.1f} us, "
            f"+LoRA {row['lora_us']:.1f} us ({row['lora_us'] / row['base_us']:.2f}x)"
        )
    if args.output_json:
        pathlib.Path(args.output_json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
