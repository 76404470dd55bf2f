"""jaxpaged/benchmarks/serving.py against the live test server: counts, datasets, result block."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from tests.live_server import API_KEY


@pytest.fixture(scope="module")
def bench():
    from jaxpaged.benchmarks import serving

    return serving


def test_random_requests_follow_lengths_and_ratio(bench):
    rng = np.random.default_rng(0)
    exact = bench.sample_random_requests(5, 10, 4, 0.0, 3, 50, rng)
    assert [r.prompt_len for r in exact] == [13] * 5
    assert all(len(r.prompt) == 13 and max(r.prompt) < 50 for r in exact)
    assert len({tuple(r.prompt[:3]) for r in exact}) == 1  # the shared prefix
    assert [r.expected_output_len for r in exact] == [4] * 5
    spread = bench.sample_random_requests(200, 100, 10, 0.5, 0, 50, rng)
    lens = [r.prompt_len for r in spread]
    assert min(lens) >= 50 and max(lens) <= 150 and len(set(lens)) > 20


def test_random_benchmark_counts_every_token_and_prints_vllm_block(bench, server, capsys, tmp_path):
    args = bench.build_parser().parse_args(
        [
            "--base-url", server.url, "--api-key", API_KEY, "--dataset-name", "random",
            "--num-prompts", "8", "--random-input-len", "8", "--random-output-len", "4",
            "--ignore-eos", "--max-concurrency", "4", "--disable-tqdm",
            "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json",
        ]
    )  # fmt: skip
    metrics = asyncio.run(bench.benchmark(args))
    assert metrics["completed"] == 8 and metrics["failed"] == 0
    assert metrics["total_input_tokens"] == 64
    assert metrics["total_output_tokens"] == 32
    # 4 tokens: at most 4 chunks, 3 gaps (a stream merges the steps its reader fell behind on)
    assert all(len(itl) <= 3 for itl in metrics["itls"])
    assert 0 < metrics["median_ttft_ms"] <= metrics["median_e2el_ms"]
    out = capsys.readouterr().out
    for label in (
        "Successful requests:                     8",
        "Total input tokens:                      64",
        "Total generated tokens:                  32",
        "Request throughput (req/s):",
        "Output token throughput (tok/s):",
        "Total Token throughput (tok/s):",
        "Mean TTFT (ms):",
        "Median TPOT (ms):",
        "P99 ITL (ms):",
        "Mean E2EL (ms):",
    ):
        assert label in out
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["completed"] == 8 and saved["request_rate"] == float("inf")


def test_sharegpt_chat_benchmark_with_poisson_arrivals(bench, server, tmp_path):
    story = "Once upon a time there was a little girl named Lily who liked to play outside."
    data = [
        {
            "conversations": [
                {"from": "human", "value": f"{story} {i}"},
                {"from": "gpt", "value": story},
            ]
        }
        for i in range(6)
    ] + [{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": story}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    args = bench.build_parser().parse_args(
        [
            "--base-url", server.url, "--api-key", API_KEY, "--backend", "openai-chat",
            "--endpoint", "/v1/chat/completions", "--dataset-name", "sharegpt",
            "--dataset-path", str(path), "--num-prompts", "5", "--sharegpt-output-len", "3",
            "--request-rate", "50", "--burstiness", "0.5", "--ignore-eos", "--disable-tqdm",
        ]
    )  # fmt: skip
    metrics = asyncio.run(bench.benchmark(args))
    assert metrics["completed"] == 5
    assert metrics["total_output_tokens"] == 15
    assert min(metrics["input_lens"]) > 4  # "Hi" is filtered out (< 4 tokens)
