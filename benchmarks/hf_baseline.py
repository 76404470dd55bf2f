"""The same workloads through Hugging Face transformers' ``generate``: the baseline of vLLM's
published comparisons (static batching, padding, every sequence runs to the batch's longest
output).

The model comes from the same ``config.json`` as jaxpaged's dummy-weight runs
(``AutoModelForCausalLM.from_config``, random init on the device, bf16). Batch sizes grow until
one runs out of memory. ``min_new_tokens = max_new_tokens`` forces every output to its length, as
``ignore_eos`` does for jaxpaged; on the ShareGPT-like workload a batch generates its longest
request's length and only the requests' own lengths count as output tokens. Run it in its own
process before jaxpaged in the same job (JAX preallocates most of the GPU when it starts)::

    python benchmarks/hf_baseline.py --model benchmarks/configs/llama-3-8b \\
        --batch-sizes 1 64 256 1024 --output-json hf.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from jaxpaged.benchmarks.dataset import (  # noqa: E402
    BenchmarkRequest,
    random_requests,
    sharegpt_synthetic_requests,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="directory with the HF config.json")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--device", default="cuda", help="torch device (cuda, or cpu for tests)")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens (random)")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens (random)")
    parser.add_argument(
        "--batch-sizes",
        type=int,
        nargs="+",
        default=[1, 64, 256, 1024],
        help="static batch sizes of the random workload, tried in order until out of memory",
    )
    parser.add_argument(
        "--sharegpt-batch-sizes",
        type=int,
        nargs="*",
        default=[],
        help="static batch sizes of the ShareGPT-like workload (none: skip it)",
    )
    parser.add_argument(
        "--sharegpt-num-batches",
        type=int,
        default=1,
        help="batches of the ShareGPT-like workload timed per batch size (the first requests "
        "of the same seeded dataset jaxpaged runs)",
    )
    parser.add_argument(
        "--num-prompts",
        type=int,
        default=1000,
        help="size of the seeded ShareGPT-like dataset whose first requests are timed (the "
        "dataset jaxpaged's --num-prompts run uses)",
    )
    parser.add_argument("--seed", type=int, default=0, help="dataset and init seed")
    parser.add_argument("--output-json", default=None, help="write results as JSON")
    return parser


def load_model(model_dir: str, dtype_name: str, device: str):
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    dtype = getattr(torch, dtype_name)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    return model, config


def generate_batch(model, batch: list[BenchmarkRequest], device: str) -> float:
    """Seconds to run one static batch: prompts left-padded to the longest, every sequence
    generating the batch's longest output length."""
    import torch

    longest_prompt = max(r.prompt_len for r in batch)
    longest_output = max(r.output_len for r in batch)
    input_ids = torch.zeros((len(batch), longest_prompt), dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, request in enumerate(batch):
        input_ids[row, longest_prompt - request.prompt_len :] = torch.tensor(
            request.prompt_token_ids
        )
        attention_mask[row, longest_prompt - request.prompt_len :] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    _synchronize(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=longest_output,
            min_new_tokens=longest_output,
            do_sample=False,
            pad_token_id=0,
        )
    _synchronize(device)
    elapsed = time.perf_counter() - start
    if out.shape[1] != longest_prompt + longest_output:
        raise RuntimeError(f"generate returned {out.shape[1] - longest_prompt} new tokens")
    return elapsed


def _synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _is_oom(error: BaseException) -> bool:
    import torch

    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def _free(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def run_static(
    model, requests: list[BenchmarkRequest], batch_size: int, num_batches: int, device: str
) -> dict:
    """Output tokens/s of ``num_batches`` consecutive static batches of ``batch_size``."""
    elapsed = 0.0
    useful = generated = 0
    for b in range(num_batches):
        batch = requests[b * batch_size : (b + 1) * batch_size]
        if not batch:
            break
        elapsed += generate_batch(model, batch, device)
        useful += sum(r.output_len for r in batch)
        generated += len(batch) * max(r.output_len for r in batch)
    return {
        "batch_size": batch_size,
        "elapsed_time": elapsed,
        "output_tokens": useful,
        "generated_tokens": generated,
        "output_tokens_per_second": useful / elapsed,
    }


def sweep(model, make_batch_requests, batch_sizes, num_batches: int, device: str, label: str):
    """Run each batch size in order; stop at the first that runs out of memory."""
    results = []
    for batch_size in batch_sizes:
        requests = make_batch_requests(batch_size * num_batches)
        try:
            result = run_static(model, requests, batch_size, num_batches, device)
        except (RuntimeError, MemoryError) as error:
            if not _is_oom(error):
                raise
            _free(device)
            print(f"HF {label} batch {batch_size}: out of memory", flush=True)
            results.append({"batch_size": batch_size, "oom": True})
            break
        results.append(result)
        print(
            f"HF {label} batch {batch_size}: {result['output_tokens_per_second']:.1f} output "
            f"tokens/s ({result['output_tokens']} tokens in {result['elapsed_time']:.2f} s)",
            flush=True,
        )
        _free(device)
    return results


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch
    import transformers

    torch.manual_seed(args.seed)
    start = time.perf_counter()
    model, config = load_model(args.model, args.dtype, args.device)
    print(f"HF model ready in {time.perf_counter() - start:.1f} s", flush=True)
    vocab_size = int(config.vocab_size)
    # Warm-up: CUDA context, cuBLAS handles and kernels load outside the timings.
    warm = random_requests(2, 8, 4, vocab_size, seed=args.seed)
    generate_batch(model, warm, args.device)

    results = {
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "dtype": args.dtype,
    }
    results["random"] = {
        "input_len": args.input_len,
        "output_len": args.output_len,
        "runs": sweep(
            model,
            lambda n: random_requests(
                n, args.input_len, args.output_len, vocab_size, seed=args.seed
            ),
            args.batch_sizes,
            1,
            args.device,
            f"random {args.input_len}/{args.output_len}",
        ),
    }
    if args.sharegpt_batch_sizes:
        needed = max(args.sharegpt_batch_sizes) * args.sharegpt_num_batches
        dataset = sharegpt_synthetic_requests(
            max(args.num_prompts, needed), vocab_size, seed=args.seed
        )
        results["sharegpt-synthetic"] = {
            "runs": sweep(
                model,
                lambda n: dataset[:n],
                args.sharegpt_batch_sizes,
                args.sharegpt_num_batches,
                args.device,
                "sharegpt-synthetic",
            )
        }
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
