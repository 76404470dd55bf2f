"""ServerMetrics against a scripted engine: exact counter deltas, histogram observations,
gauges, the engine-stats path, and one registry per instance."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxpaged.core.stats import SchedulerStats
from jaxpaged.metrics import ITL_BUCKETS, TTFT_BUCKETS, ServerMetrics
from jaxpaged.outputs import CompletionOutput, RequestOutput


def _stats(running=0, waiting=0, swapped=0, usage=0.0, preemptions=0, queries=0, hits=0):
    """``LLMEngine.get_stats()`` as the engine would report it."""
    return SchedulerStats(
        num_requests_running=running,
        num_requests_waiting=waiting,
        num_requests_swapped=swapped,
        kv_cache_usage_perc=usage,
        cpu_cache_usage_perc=0.0,
        num_gpu_blocks=100,
        num_cpu_blocks=0,
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
        num_preemptions=preemptions,
        num_preemptions_swap=0,
        num_preemptions_recompute=preemptions,
        kv_cache_tokens_stored=0,
        kv_cache_slots_held=0,
    )


def _output(request_id, num_tokens, finish_reason=None, prompt_len=4, scheduled=None):
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=list(range(prompt_len)),
        outputs=[
            CompletionOutput(
                index=0, text="", token_ids=list(range(num_tokens)), finish_reason=finish_reason
            )
        ],
        finished=finish_reason is not None,
        metrics={"first_scheduled_time": scheduled},
    )


def _samples(metrics: ServerMetrics) -> dict:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k not in ("model_name", "engine")}
            out[(sample.name, tuple(sorted(labels.items())))] = sample.value
    return out


def _get(samples, name, **labels):
    return samples[(name, tuple(sorted(labels.items())))]


def test_a_request_lifecycle_gives_exact_counts_and_latencies():
    metrics = ServerMetrics("m")
    metrics.observe_added("a", arrival_time=10.0)
    metrics.observe_added("b", arrival_time=10.0)
    # Step 1 starts at 10.5, where the engine scheduled both: "a" (prompt 4, 2 cached) gets
    # its first token; "b" is a running prefill chunk without output yet.
    step1 = _stats(running=2, usage=0.5, queries=8, hits=2)
    metrics.observe_step(step1, [_output("a", 1, scheduled=10.5)], 10.5, 11.0)
    step2 = _stats(running=2, queries=8, hits=2)
    outputs = [_output("a", 2, scheduled=10.5), _output("b", 1, scheduled=10.5)]
    metrics.observe_step(step2, outputs, 11.0, 11.25)
    outputs = [_output("a", 3, "stop", scheduled=10.5), _output("b", 2, scheduled=10.5)]
    metrics.observe_step(_stats(running=1, queries=8, hits=2), outputs, 11.25, 11.5)
    metrics.observe_aborted("b")
    metrics.observe_aborted("b")  # a second abort of the same request is not counted
    s = _samples(metrics)
    assert _get(s, "jaxpaged:prompt_tokens_total") == 8
    assert _get(s, "jaxpaged:generation_tokens_total") == 5
    assert _get(s, "jaxpaged:prefix_cache_queries_total") == 8
    assert _get(s, "jaxpaged:prefix_cache_hits_total") == 2
    assert _get(s, "jaxpaged:request_success_total", finished_reason="stop") == 1
    assert _get(s, "jaxpaged:request_success_total", finished_reason="abort") == 1
    assert _get(s, "jaxpaged:request_success_total", finished_reason="length") == 0
    # TTFT: a 1.0 s, b 1.25 s.
    assert _get(s, "jaxpaged:time_to_first_token_seconds_count") == 2
    assert _get(s, "jaxpaged:time_to_first_token_seconds_sum") == pytest.approx(2.25)
    # ITL gaps: a 0.25 and 0.25, b 0.25.
    assert _get(s, "jaxpaged:inter_token_latency_seconds_sum") == pytest.approx(0.75)
    assert _get(s, "jaxpaged:time_per_output_token_seconds_count") == 3
    # Only "a" finished: e2e 1.5 s, queue 0.5 s (scheduled at step 1's start), decode 0.5 s.
    assert _get(s, "jaxpaged:e2e_request_latency_seconds_sum") == pytest.approx(1.5)
    assert _get(s, "jaxpaged:request_queue_time_seconds_sum") == pytest.approx(0.5)
    assert _get(s, "jaxpaged:request_prefill_time_seconds_sum") == pytest.approx(0.5)
    assert _get(s, "jaxpaged:request_decode_time_seconds_sum") == pytest.approx(0.5)
    assert _get(s, "jaxpaged:request_inference_time_seconds_count") == 1
    assert _get(s, "jaxpaged:time_to_first_token_seconds_bucket", le="1.0") == 1
    assert _get(s, "jaxpaged:time_to_first_token_seconds_bucket", le="2.5") == 2


def test_gauges_and_engine_counters_come_from_the_stats_api():
    metrics = ServerMetrics("m")
    metrics.observe_engine_state(
        _stats(running=1, waiting=3, preemptions=2, usage=0.25, queries=100, hits=40, swapped=1)
    )
    metrics.observe_added("x", 0.0)
    # Counters advance by the engine's cumulative change; gauges follow the latest stats.
    later = _stats(running=1, preemptions=5, queries=130, hits=50)
    metrics.observe_step(later, [_output("x", 1)], 0, 1)
    s = _samples(metrics)
    assert _get(s, "jaxpaged:prefix_cache_queries_total") == 130
    assert _get(s, "jaxpaged:prefix_cache_hits_total") == 50
    assert _get(s, "jaxpaged:num_preemptions_total") == 5
    assert _get(s, "jaxpaged:num_requests_running") == 1
    assert _get(s, "jaxpaged:num_requests_waiting") == 0
    assert _get(s, "jaxpaged:kv_cache_usage_perc") == 0.0

    metrics.observe_engine_state(
        _stats(running=1, waiting=3, usage=0.25, queries=130, hits=50, swapped=1, preemptions=5)
    )
    s = _samples(metrics)
    assert _get(s, "jaxpaged:num_requests_waiting") == 3
    assert _get(s, "jaxpaged:num_requests_swapped") == 1
    assert _get(s, "jaxpaged:kv_cache_usage_perc") == 0.25
    assert _get(s, "jaxpaged:gpu_cache_usage_perc") == 0.25
    assert _get(s, "jaxpaged:num_preemptions_total") == 5
    assert _get(s, "jaxpaged:prefix_cache_queries_total") == 130


def test_a_request_without_a_scheduled_time_counts_from_its_first_output_step():
    metrics = ServerMetrics("m")
    metrics.observe_added("r", 1.0)
    metrics.observe_step(_stats(), [_output("r", 1)], 2.0, 2.5)
    metrics.observe_step(_stats(), [_output("r", 2, "length")], 2.5, 3.0)
    s = _samples(metrics)
    assert _get(s, "jaxpaged:request_queue_time_seconds_sum") == pytest.approx(1.0)
    assert _get(s, "jaxpaged:request_inference_time_seconds_sum") == pytest.approx(1.0)


def test_each_instance_has_its_own_registry_and_vllm_buckets():
    first, second = ServerMetrics("a"), ServerMetrics("b")
    first.observe_added("r", 0.0)
    first.observe_step(_stats(), [_output("r", 1, "length")], 0.0, 0.5)
    assert _get(_samples(first), "jaxpaged:request_success_total", finished_reason="length") == 1
    assert _get(_samples(second), "jaxpaged:request_success_total", finished_reason="length") == 0
    assert 'model_name="b"' in second.render().decode()
    assert TTFT_BUCKETS[0] == 0.001 and TTFT_BUCKETS[-1] == 2560.0 and len(TTFT_BUCKETS) == 22
    assert ITL_BUCKETS[0] == 0.01 and ITL_BUCKETS[-1] == 80.0


def test_spec_decode_counters_follow_vllm_names_and_advance_by_the_change():
    from jaxpaged.spec_decode.metrics import SpecDecodingStats

    metrics = ServerMetrics("m", prefix="vllm", num_speculative_tokens=3)
    stats = SpecDecodingStats(num_spec_tokens=3)
    stats.observe_draft(3, 2)
    stats.observe_draft(2, 0)
    metrics.observe_spec_decoding(stats)
    stats.observe_draft(3, 3)
    metrics.observe_spec_decoding(stats)
    metrics.observe_spec_decoding(stats)  # nothing new: no change
    samples = _samples(metrics)
    assert _get(samples, "vllm:spec_decode_num_drafts_total") == 3
    assert _get(samples, "vllm:spec_decode_num_draft_tokens_total") == 8
    assert _get(samples, "vllm:spec_decode_num_accepted_tokens_total") == 5
    per_pos = [
        _get(samples, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
        for i in range(3)
    ]
    assert per_pos == [2, 2, 1]
    # Without speculation the counters are not registered (vLLM's rule).
    plain = {name for name, _ in _samples(ServerMetrics("m", prefix="vllm"))}
    assert not any("spec_decode" in name for name in plain)
