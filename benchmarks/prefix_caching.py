"""Benchmark automatic prefix caching (the look-alike of vLLM's benchmark_prefix_caching.py).

Runs one prompt list twice through ``LLM.generate`` with greedy decoding, a warm-up pass then a
measured pass, and prints the wall time of each as vLLM's script does (``cost time <seconds>``).
Compare ``--enable-prefix-caching`` (the default) with ``--no-enable-prefix-caching``.

Workloads:
  - default: one fixed long prompt (a markdown table and a question) repeated;
  - ``--prefix-len N``: random prompts that share an N-token random prefix, with suffix lengths
    drawn from ``--input-length-range``;
  - ``--dataset-path``: ShareGPT conversations whose first turn fits ``--input-length-range``.

Fixed prompt on CPU with the embedded stories260k model::

    python benchmarks/prefix_caching.py --num-prompts 1 --repeat-count 20 --output-len 10
    python benchmarks/prefix_caching.py --num-prompts 1 --repeat-count 20 --output-len 10 \
        --no-enable-prefix-caching
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time

from jaxpaged import LLM, SamplingParams
from jaxpaged.entrypoints.cli_args import add_engine_args, engine_args_from

_TABLE_ROWS = [
    ("Oak", "Tall", "Green", "Forest", "Slow"),
    ("Pine", "Tall", "Green", "Hill", "Fast"),
    ("Rose", "Short", "Red", "Garden", "Slow"),
    ("Fern", "Short", "Green", "Shade", "Fast"),
    ("Tulip", "Short", "Yellow", "Field", "Fast"),
    ("Maple", "Tall", "Orange", "Park", "Slow"),
    ("Cactus", "Short", "Green", "Desert", "Slow"),
    ("Lily", "Short", "White", "Pond", "Fast"),
]


def fixed_prompt() -> str:
    """A shared document followed by a question, like a chat over one file."""
    lines = [
        "Read the table about plants and answer the question.",
        "| Plant | Height | Color | Place | Growth |",
        "|---|---|---|---|---|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in _TABLE_ROWS]
    lines.append("Question: which plants are tall and green?")
    return "\n".join(lines) + "\n"


def sample_random_prompts(tokenizer, num_prompts, prefix_len, length_range, rng):
    """Token-id prompts sharing one random prefix, with random suffixes (no special tokens)."""
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(tokenizer.vocab_size) if i not in special]
    prefix = rng.choices(vocab, k=prefix_len)
    low, high = length_range
    prompts = []
    for _ in range(num_prompts):
        suffix = rng.choices(vocab, k=rng.randint(low, high))
        prompts.append(({"prompt_token_ids": prefix + suffix}, prefix_len + len(suffix)))
    return prompts


def sample_dataset_prompts(path, tokenizer, num_prompts, length_range, rng):
    """First turns of ShareGPT conversations whose token count lies in `length_range`."""
    with open(path) as f:
        dataset = [d for d in json.load(f) if len(d["conversations"]) >= 2]
    rng.shuffle(dataset)
    low, high = length_range
    prompts = []
    for data in dataset:
        if len(prompts) == num_prompts:
            break
        prompt = data["conversations"][0]["value"]
        length = len(tokenizer(prompt).input_ids)
        if low <= length <= high:
            prompts.append((prompt, length))
    return prompts


def repeat_and_sort(prompts, repeat_count, sort, rng):
    """Each prompt `repeat_count` times, sorted by length (`sort`) or shuffled."""
    repeated = prompts * repeat_count
    if sort:
        repeated.sort(key=lambda item: item[1])
    else:
        rng.shuffle(repeated)
    return [prompt for prompt, _ in repeated]


def run_once(llm, prompts, params) -> None:
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    print(f"cost time {time.perf_counter() - start}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset-path", type=str, default=None, help="ShareGPT JSON file.")
    parser.add_argument("--output-len", type=int, default=10, help="Tokens generated per prompt.")
    parser.add_argument("--num-prompts", type=int, default=1, help="Distinct prompts.")
    parser.add_argument("--repeat-count", type=int, default=100, help="Copies of each prompt.")
    parser.add_argument("--sort", action="store_true", help="Sort prompts by input length.")
    parser.add_argument(
        "--input-length-range",
        type=str,
        default="128:256",
        help='Prompt (suffix) length range "min:max" in tokens for sampled prompts.',
    )
    parser.add_argument(
        "--prefix-len", type=int, default=0, help="Shared random prefix of synthetic prompts."
    )
    add_engine_args(parser)
    args = parser.parse_args(argv)

    rng = random.Random(args.seed)
    engine_args = engine_args_from(args)
    llm = LLM(**dataclasses.asdict(engine_args))
    llm.llm_engine.wait_for_executables()  # a warm start loads buckets in the background
    tokenizer = llm.get_tokenizer()
    length_range = tuple(int(x) for x in args.input_length_range.split(":"))
    if args.dataset_path is not None:
        print(f"Start to sample {args.num_prompts} prompts from {args.dataset_path}")
        prompts = sample_dataset_prompts(
            args.dataset_path, tokenizer, args.num_prompts, length_range, rng
        )
    elif args.prefix_len > 0:
        prompts = sample_random_prompts(
            tokenizer, args.num_prompts, args.prefix_len, length_range, rng
        )
    else:
        text = fixed_prompt()
        prompts = [(text, len(tokenizer(text).input_ids))] * args.num_prompts

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len)
    print("Testing filtered datasets")
    prompt_list = repeat_and_sort(prompts, args.repeat_count, args.sort, rng)
    print("------warm up------")
    run_once(llm, prompt_list, params)
    print("------start generating------")
    run_once(llm, prompt_list, params)
    stats = llm.llm_engine.get_stats()
    if stats.prefix_cache_queries:
        rate = stats.prefix_cache_hits / stats.prefix_cache_queries
        print(f"Prefix cache hit rate: {rate:.2%}")


if __name__ == "__main__":
    main()
