"""The benchmarks (``jaxpaged bench`` and the suites' programs under ``benchmarks/``) end to end
on a tiny config-only model (dummy weights, no tokenizer), and their vLLM-format result lines."""

from __future__ import annotations

import json
import re

import pytest

from benchmarks import hf_baseline
from jaxpaged.benchmarks import latency as benchmark_latency
from jaxpaged.benchmarks import throughput as benchmark_throughput
from jaxpaged.benchmarks.dataset import BenchmarkRequest

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
ENGINE_FLAGS = [
    "--load-format",
    "dummy",
    "--skip-tokenizer-init",
    "--max-model-len",
    "256",
    "--max-num-seqs",
    "4",
    "--max-num-batched-tokens",
    "64",
]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    (path / "config.json").write_text(json.dumps(TINY_CONFIG))
    return str(path)


def test_throughput_script_prints_vllms_result_line_and_writes_json(tiny_model, tmp_path, capsys):
    out = tmp_path / "throughput.json"
    argv = [
        "--model",
        tiny_model,
        *ENGINE_FLAGS,
        "--input-len",
        "8",
        "--output-len",
        "5",
        "--num-prompts",
        "6",
        "--output-json",
        str(out),
    ]
    assert benchmark_throughput.main(argv) == 0
    printed = capsys.readouterr().out
    assert re.search(
        r"^Throughput: \d+\.\d{2} requests/s, \d+\.\d{2} total tokens/s, "
        r"\d+\.\d{2} output tokens/s$",
        printed,
        re.M,
    )
    assert re.search(r"^Total num prompt tokens:  48$", printed, re.M)
    assert re.search(r"^Total num output tokens:  30$", printed, re.M)
    assert re.search(r"^KV cache: .* blocks of 16 tokens", printed, re.M)
    result = json.loads(out.read_text())
    assert result["num_requests"] == 6 and result["total_num_tokens"] == 78
    assert result["tokens_per_second"] == pytest.approx(78 / result["elapsed_time"])
    assert 0.0 <= result["fragmentation"] < 1.0


def test_latency_lines_are_vllms():
    result = {
        "avg_latency": 1.5,
        "percentiles": {str(p): 1.0 + p / 100 for p in benchmark_latency.PERCENTILES},
        "avg_tpot_seconds": 0.004,
    }
    lines = benchmark_latency.result_lines(result)
    assert lines[0] == "Avg latency: 1.5 seconds"
    assert lines[1] == "10% percentile latency: 1.1 seconds"
    assert lines[6] == "99% percentile latency: 1.99 seconds"
    assert lines[-1] == "Avg time per output token: 4.000 ms"


def test_latency_script_times_each_iteration(tiny_model, tmp_path, capsys):
    out = tmp_path / "latency.json"
    argv = [
        "--model",
        tiny_model,
        *ENGINE_FLAGS,
        "--input-len",
        "4",
        "--output-len",
        "3",
        "--batch-size",
        "2",
        "--num-iters-warmup",
        "1",
        "--num-iters",
        "2",
        "--output-json",
        str(out),
    ]
    assert benchmark_latency.main(argv) == 0
    assert re.search(r"^Avg latency: [\d.e-]+ seconds$", capsys.readouterr().out, re.M)
    result = json.loads(out.read_text())
    assert len(result["latencies"]) == 2 and result["avg_tpot_seconds"] > 0


def test_hf_baseline_runs_static_batches_to_their_longest_output(tiny_model, tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "hf.json"
    argv = [
        "--model",
        tiny_model,
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--input-len",
        "6",
        "--output-len",
        "3",
        "--batch-sizes",
        "1",
        "2",
        "--output-json",
        str(out),
    ]
    assert hf_baseline.main(argv) == 0
    runs = json.loads(out.read_text())["random"]["runs"]
    assert [r["batch_size"] for r in runs] == [1, 2]
    assert runs[1]["output_tokens"] == 6 and runs[1]["output_tokens_per_second"] > 0

    # Mixed lengths: left padding, and the batch generates its longest output for everyone.
    model, _ = hf_baseline.load_model(tiny_model, "float32", "cpu")
    requests = [BenchmarkRequest([1, 5, 7], 2), BenchmarkRequest([1, 9], 4)]
    result = hf_baseline.run_static(model, requests, 2, 1, "cpu")
    assert result["output_tokens"] == 6 and result["generated_tokens"] == 8


def test_report_reads_hf_log_lines_and_rates_each_target():
    from benchmarks.lib import e2e_report as report

    hf = report.hf_from_log(
        "HF model ready in 11.4 s\n"
        "HF random 128/128 batch 1: 10.0 output tokens/s (128 tokens in 12.80 s)\n"
        "HF random 128/128 batch 1024: 8000.0 output tokens/s (131072 tokens in 16.4 s)\n"
        "HF sharegpt-synthetic batch 64: 100.0 output tokens/s (1 tokens in 0.01 s)\n"
    )
    assert hf == {"random": {1: 10.0, 1024: 8000.0}, "sharegpt-synthetic": {64: 100.0}}
    throughput = dict(output_tokens_per_second=24_000.0, fragmentation=0.02)
    suite = {
        "random": throughput,
        "sharegpt-synthetic": dict(output_tokens_per_second=4_600.0, fragmentation=0.05),
        "latency": {"avg_tpot_seconds": 0.005},
        "kv_cache": {"bytes": 95, "budget": {"requested": 120, "peak": 20}},
    }
    rows = report.targets_table(suite, hf)
    ratios = [float(row.split("|")[4].split()[0]) for row in rows[2:]]
    # 128/128, ShareGPT, TPOT, vs HF batch 1, vs HF best 128/128, vs HF ShareGPT, KV, frag.
    assert ratios == pytest.approx([1.2, 0.5, 0.9, 20 / 15, 1.2, 9.2, 0.95 / 0.9, 0.8], abs=0.01)


def test_timed_runs_read_no_prefix_an_earlier_run_cached(tiny_model):
    """The suite runs a workload synchronously and then again with async scheduling on the same
    engine: the second run must not be served prompt blocks the first one cached."""
    from jaxpaged import LLM

    llm = LLM(
        model=tiny_model, load_format="dummy", skip_tokenizer_init=True, max_model_len=256,
        max_num_seqs=4, max_num_batched_tokens=64, async_scheduling=True,
    )  # fmt: skip
    requests = [BenchmarkRequest(list(range(3 + i, 43 + i)), 4) for i in range(4)]
    first = benchmark_throughput.run_throughput(llm, requests, warmup=False)
    llm.llm_engine.async_scheduling = False
    second = benchmark_throughput.run_throughput(llm, requests, warmup=False)
    assert first["prefix_cache_hit_tokens"] == second["prefix_cache_hit_tokens"] == 0
    assert first["num_steps"] == second["num_steps"] + 1  # async: one more step to drain
    for result in (first, second):
        assert 0.0 <= result["device_idle_fraction"] <= 1.0
        assert 0.0 <= result["bucket_padding_fraction"] < 1.0
        assert result["num_device_steps"] == second["num_steps"]


def test_structured_outputs_host_only_times_each_backend_on_masks_it_accepts():
    """``--host-only``: every backend that imports is timed, and each step's random tokens are
    drawn from the backend's own mask, which its matchers must then accept (else it raises)."""
    from benchmarks.structured_outputs import host_mask_cost

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    rows = host_mask_cost(schema, vocab_size=600, batch_sizes=[1, 3], steps=3)
    backends = {r["backend"] for r in rows}
    assert "guidance" in backends  # a runtime dependency
    assert [r["batch_size"] for r in rows if r["backend"] == "guidance"] == [1, 3]
    assert all(r["fill_ms"] > 0 and r["accept_ms"] >= 0 and r["compile_s"] > 0 for r in rows)


def test_weight_sync_throughput_runs_start_with_an_empty_prefix_cache(tiny_model, tmp_path):
    """Before and after the sleep / wake_up round trip the same prompts run: neither run may
    read prompt blocks that the warm-up (or the run before it) cached, or "before" skips the
    prefill that "after" (whose cache ``sleep`` emptied) has to do."""
    from benchmarks import weight_sync as benchmark_weight_sync

    out = tmp_path / "ws.json"
    benchmark_weight_sync.main([
        "--model", tiny_model, "--dtype", "float32", "--num-prompts", "4", "--input-len", "40",
        "--output-len", "4", "--repeats", "1", "--kv-cache-gib", "0.01", "--out", str(out),
    ])  # fmt: skip
    result = json.loads(out.read_text())
    assert result["prefix_cache_hit_tokens_before_after"] == [0, 0]
    assert result["step_compilations_during"] == 0
