"""The requests of ``jaxpaged bench serve``: ``random`` token-id prompts or ``sharegpt``
conversations (vLLM's ``benchmark_serving.py`` datasets and filters).

``random`` needs no tokenizer: prompts are token ids, lengths drawn around the asked ones.
``sharegpt`` reads a ShareGPT-format JSON (``[{"conversations": [{"from": "human", "value":
...}, {"from": "gpt", "value": ...}]}]``) and counts tokens with the server's ``/tokenize``.
"""

from __future__ import annotations

import dataclasses
import json
import random

import httpx
import numpy as np


@dataclasses.dataclass
class SampleRequest:
    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int


def sample_random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    prefix_len: int,
    vocab_size: int,
    rng: np.random.Generator,
) -> list[SampleRequest]:
    """Token-id prompts of ``prefix_len`` shared ids plus a length drawn uniformly in
    ``[input_len * (1 - r), input_len * (1 + r)]``; output lengths likewise (vLLM's rule)."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    low_in, high_in = int(input_len * (1 - range_ratio)), int(input_len * (1 + range_ratio))
    low_out, high_out = int(output_len * (1 - range_ratio)), int(output_len * (1 + range_ratio))
    input_lens = rng.integers(max(low_in, 1), max(high_in, 1) + 1, size=num_prompts)
    output_lens = rng.integers(max(low_out, 1), max(high_out, 1) + 1, size=num_prompts)
    prefix = rng.integers(0, vocab_size, size=prefix_len).tolist()
    requests = []
    for n_in, n_out in zip(input_lens, output_lens, strict=True):
        ids = prefix + rng.integers(0, vocab_size, size=int(n_in)).tolist()
        requests.append(SampleRequest(ids, len(ids), int(n_out)))
    return requests


async def sample_sharegpt_requests(
    path: str,
    num_prompts: int,
    fixed_output_len: int | None,
    http: httpx.AsyncClient,
    model: str,
    rng: random.Random,
) -> list[SampleRequest]:
    """First human turn as prompt, first reply's token count as output length; drops pairs
    under 4 tokens, prompts over 1024 and totals over 2048 tokens (vLLM's filter)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    pairs = [
        (d["conversations"][0]["value"], d["conversations"][1]["value"])
        for d in data
        if len(d.get("conversations", [])) >= 2
    ]
    rng.shuffle(pairs)

    async def count(text: str) -> int:
        response = await http.post("/tokenize", json={"model": model, "prompt": text})
        response.raise_for_status()
        return response.json()["count"]

    requests = []
    for prompt, reply in pairs:
        if len(requests) == num_prompts:
            break
        prompt_len = await count(prompt)
        output_len = fixed_output_len if fixed_output_len is not None else await count(reply)
        if prompt_len < 4 or (fixed_output_len is None and output_len < 4):
            continue
        if prompt_len > 1024 or prompt_len + output_len > 2048:
            continue
        requests.append(SampleRequest(prompt, prompt_len, output_len))
    if len(requests) < num_prompts:
        raise ValueError(f"{path} has only {len(requests)} usable conversations")
    return requests
