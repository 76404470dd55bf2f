"""Benchmark workloads as token ids: fixed lengths, or a synthetic ShareGPT-like mix.

No tokenizer and no download: prompts are random token ids, which is all a dummy-weight model
needs. ``sharegpt-synthetic`` draws prompt and output lengths from seeded log-normals fitted so
that, after vLLM's ShareGPT filter (``benchmarks/benchmark_throughput.py``: drop prompts or
outputs under 4 tokens, prompts over 1024 and prompt + output over 2048 tokens), both means are
about 200 tokens, close to what vLLM reports for ShareGPT (202 in / 179 out, vLLM v0.6.0 blog).
"""

from __future__ import annotations

import dataclasses

import numpy as np

DATASET_NAMES = ("random", "sharegpt-synthetic")

# log-normal (mu, sigma) of the prompt and output lengths before filtering; see the docstring.
SHAREGPT_PROMPT_LOGNORMAL = (4.9, 1.1)
SHAREGPT_OUTPUT_LOGNORMAL = (4.9, 0.9)
# vLLM's ShareGPT filter.
MIN_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048


@dataclasses.dataclass(frozen=True)
class BenchmarkRequest:
    """One request: its prompt token ids and how many tokens it must generate."""

    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def random_requests(
    num_prompts: int, input_len: int, output_len: int, vocab_size: int, *, seed: int = 0
) -> list[BenchmarkRequest]:
    """``num_prompts`` prompts of exactly ``input_len`` random token ids, each generating
    ``output_len`` tokens (vLLM's random dataset with a range ratio of 0).

    Raises:
        ValueError: a count or length below 1, or a vocabulary of fewer than 2 tokens.
    """
    _check_positive(num_prompts=num_prompts, input_len=input_len, output_len=output_len)
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be at least 2, got {vocab_size}")
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab_size, size=(num_prompts, input_len))
    return [BenchmarkRequest(row.tolist(), output_len) for row in ids]


def sharegpt_synthetic_lengths(num_prompts: int, *, seed: int = 0) -> list[tuple[int, int]]:
    """``num_prompts`` (prompt_len, output_len) pairs drawn from the fitted log-normals and
    filtered like vLLM's ShareGPT loader (rejected pairs are redrawn)."""
    _check_positive(num_prompts=num_prompts)
    rng = np.random.default_rng(seed)
    pairs: list[tuple[int, int]] = []
    while len(pairs) < num_prompts:
        batch = 2 * (num_prompts - len(pairs)) + 16
        prompt = np.maximum(1, np.rint(rng.lognormal(*SHAREGPT_PROMPT_LOGNORMAL, batch)))
        output = np.maximum(1, np.rint(rng.lognormal(*SHAREGPT_OUTPUT_LOGNORMAL, batch)))
        keep = (
            (prompt >= MIN_LEN)
            & (output >= MIN_LEN)
            & (prompt <= MAX_PROMPT_LEN)
            & (prompt + output <= MAX_TOTAL_LEN)
        )
        kept = zip(
            prompt[keep].astype(int).tolist(), output[keep].astype(int).tolist(), strict=True
        )
        pairs.extend(kept)
    return pairs[:num_prompts]


def sharegpt_synthetic_requests(
    num_prompts: int, vocab_size: int, *, seed: int = 0
) -> list[BenchmarkRequest]:
    """ShareGPT-like requests: lengths from ``sharegpt_synthetic_lengths``, random token ids."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be at least 2, got {vocab_size}")
    lengths = sharegpt_synthetic_lengths(num_prompts, seed=seed)
    rng = np.random.default_rng(seed + 1)
    return [BenchmarkRequest(rng.integers(0, vocab_size, size=p).tolist(), o) for p, o in lengths]


def make_requests(
    dataset_name: str,
    *,
    num_prompts: int,
    input_len: int | None,
    output_len: int | None,
    vocab_size: int,
    seed: int = 0,
) -> list[BenchmarkRequest]:
    """The workload named ``dataset_name`` (one of ``DATASET_NAMES``).

    Raises:
        ValueError: an unknown name, or ``random`` without both lengths.
    """
    if dataset_name == "random":
        if input_len is None or output_len is None:
            raise ValueError("dataset 'random' needs --input-len and --output-len")
        return random_requests(num_prompts, input_len, output_len, vocab_size, seed=seed)
    if dataset_name == "sharegpt-synthetic":
        return sharegpt_synthetic_requests(num_prompts, vocab_size, seed=seed)
    raise ValueError(f"dataset_name must be one of {list(DATASET_NAMES)}, got {dataset_name!r}")


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
