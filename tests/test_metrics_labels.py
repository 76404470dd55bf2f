"""``ServerMetrics``' prefix, ``engine`` label and ``lora_requests_info``, and ``render_all``
(several data-parallel engines in one exposition), read back with prometheus_client's parser."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxpaged.core.stats import SchedulerStats
from jaxpaged.metrics import ServerMetrics, render_all


def _families(text: bytes) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text.decode())}


def _engine(running=0, waiting=0):
    """``LLMEngine.get_stats()`` with these counts and half the KV cache in use."""
    return SchedulerStats(
        num_requests_running=running,
        num_requests_waiting=waiting,
        num_requests_swapped=0,
        kv_cache_usage_perc=0.5,
        cpu_cache_usage_perc=0.0,
        num_gpu_blocks=100,
        num_cpu_blocks=0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_preemptions=0,
        num_preemptions_swap=0,
        num_preemptions_recompute=0,
        kv_cache_tokens_stored=0,
        kv_cache_slots_held=0,
    )


def test_vllm_prefix_gives_the_gateway_names_with_model_and_engine_labels():
    metrics = ServerMetrics("m", prefix="vllm", engine_index=3)
    metrics.observe_engine_state(_engine(running=2, waiting=1))
    families = _families(metrics.render())
    assert not [name for name in families if not name.startswith("vllm:")]
    for name, value in [
        ("vllm:num_requests_running", 2),
        ("vllm:num_requests_waiting", 1),
        ("vllm:kv_cache_usage_perc", 0.5),
    ]:
        (sample,) = families[name].samples
        assert sample.labels == {"model_name": "m", "engine": "3"}
        assert sample.value == value
    (lora,) = families["vllm:lora_requests_info"].samples
    assert lora.labels == {
        "max_lora": "0",
        "running_lora_adapters": "",
        "waiting_lora_adapters": "",
    }
    assert lora.value > 1.7e9  # a Unix time, as vLLM's set_to_current_time


def test_lora_requests_info_names_running_and_waiting_adapters_once_each():
    metrics = ServerMetrics("m", max_loras=4)
    metrics.observe_lora_adapters(["sql", "sql", "chat"], ["math"])
    metrics.observe_lora_adapters(["sql"], [])
    (lora,) = _families(metrics.render())["jaxpaged:lora_requests_info"].samples  # latest only
    assert lora.labels == {
        "max_lora": "4",
        "running_lora_adapters": "sql",
        "waiting_lora_adapters": "",
    }
    metrics.observe_lora_adapters(["sql", "sql", "chat"], ["math"])
    (lora,) = _families(metrics.render())["jaxpaged:lora_requests_info"].samples
    assert lora.labels["running_lora_adapters"] == "sql,chat"
    assert lora.labels["waiting_lora_adapters"] == "math"


def test_render_all_reports_each_data_parallel_engine_under_one_family():
    engines = [ServerMetrics("m", prefix="vllm", engine_index=i) for i in range(2)]
    engines[0].observe_engine_state(_engine(running=1))
    engines[1].observe_engine_state(_engine(running=3))
    engines[1].request_success["stop"].inc()
    text = render_all(engines)
    assert text.decode().count("# TYPE vllm:num_requests_running gauge") == 1
    families = _families(text)
    running = {s.labels["engine"]: s.value for s in families["vllm:num_requests_running"].samples}
    assert running == {"0": 1, "1": 3}
    success = {
        s.labels["engine"]: s.value
        for s in families["vllm:request_success"].samples
        if s.name == "vllm:request_success_total" and s.labels["finished_reason"] == "stop"
    }
    assert success == {"0": 0, "1": 1}
    assert len(families["vllm:lora_requests_info"].samples) == 1  # same labels on both engines


def test_bad_prefix_and_mixed_prefixes_are_refused():
    with pytest.raises(ValueError, match=r"metrics_prefix must be one of .*got 'tgi'"):
        ServerMetrics("m", prefix="tgi")
    with pytest.raises(ValueError, match="engine_index must be >= 0, got -1"):
        ServerMetrics("m", engine_index=-1)
    with pytest.raises(ValueError, match=r"one metrics prefix, got \['jaxpaged', 'vllm'\]"):
        render_all([ServerMetrics("m"), ServerMetrics("m", prefix="vllm", engine_index=1)])
