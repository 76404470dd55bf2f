"""ServerMetrics against a scripted engine: exact counter deltas, histogram observations,
gauges, the engine-stats path, and one registry per instance."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxpaged.metrics import ITL_BUCKETS, TTFT_BUCKETS, ServerMetrics
from jaxpaged.outputs import CompletionOutput, RequestOutput


def _engine(running=(), waiting=0, preemptions=0, usage=0.0, stats=None, swapped=0):
    engine = SimpleNamespace(
        scheduler=SimpleNamespace(
            running=[SimpleNamespace(request_id=r) for r in running],  # SequenceGroups
            num_running=len(running),
            num_waiting=waiting,
            num_preemptions=preemptions,
            num_swapped=swapped,
        ),
        kv_cache_manager=SimpleNamespace(usage=usage),
    )
    if stats is not None:
        engine.get_stats = lambda: stats
    return engine


def _output(request_id, num_tokens, finish_reason=None, prompt_len=4, cached=0):
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
        num_cached_tokens=cached,
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
    # Step 1 starts at 10.5: "a" (prompt 4, 2 cached) gets its first token; "b" is a
    # running prefill chunk without output yet.
    metrics.observe_step(
        _engine(running=["a", "b"], usage=0.5), [_output("a", 1, cached=2)], 10.5, 11.0
    )
    metrics.observe_step(
        _engine(running=["a", "b"]), [_output("a", 2), _output("b", 1)], 11.0, 11.25
    )
    metrics.observe_step(
        _engine(running=["b"]), [_output("a", 3, "stop"), _output("b", 2)], 11.25, 11.5
    )
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


def test_gauges_preemptions_and_engine_prefix_stats():
    metrics = ServerMetrics("m")
    stats = {"prefix_cache_queries": 100, "prefix_cache_hits": 40}
    metrics.observe_engine_state(
        _engine(running=["x"], waiting=3, preemptions=2, usage=0.25, stats=stats, swapped=1)
    )
    metrics.observe_added("x", 0.0)
    # With engine counters, the outputs' num_cached_tokens are not counted again.
    stats2 = {"prefix_cache_queries": 130, "prefix_cache_hits": 50}
    metrics.observe_step(
        _engine(running=["x"], preemptions=5, stats=stats2), [_output("x", 1, cached=16)], 0, 1
    )
    s = _samples(metrics)
    assert _get(s, "jaxpaged:prefix_cache_queries_total") == 130
    assert _get(s, "jaxpaged:prefix_cache_hits_total") == 50
    assert _get(s, "jaxpaged:num_preemptions_total") == 5
    assert _get(s, "jaxpaged:num_requests_running") == 1
    assert _get(s, "jaxpaged:num_requests_waiting") == 0
    assert _get(s, "jaxpaged:kv_cache_usage_perc") == 0.0

    metrics.observe_engine_state(
        _engine(running=["x"], waiting=3, usage=0.25, stats=stats2, swapped=1, preemptions=5)
    )
    s = _samples(metrics)
    assert _get(s, "jaxpaged:num_requests_waiting") == 3
    assert _get(s, "jaxpaged:num_requests_swapped") == 1
    assert _get(s, "jaxpaged:kv_cache_usage_perc") == 0.25
    assert _get(s, "jaxpaged:gpu_cache_usage_perc") == 0.25
    assert _get(s, "jaxpaged:num_preemptions_total") == 5


def test_each_instance_has_its_own_registry_and_vllm_buckets():
    first, second = ServerMetrics("a"), ServerMetrics("b")
    first.observe_added("r", 0.0)
    first.observe_step(_engine(), [_output("r", 1, "length")], 0.0, 0.5)
    assert _get(_samples(first), "jaxpaged:request_success_total", finished_reason="length") == 1
    assert _get(_samples(second), "jaxpaged:request_success_total", finished_reason="length") == 0
    assert 'model_name="b"' in second.render().decode()
    assert TTFT_BUCKETS[0] == 0.001 and TTFT_BUCKETS[-1] == 2560.0 and len(TTFT_BUCKETS) == 22
    assert ITL_BUCKETS[0] == 0.01 and ITL_BUCKETS[-1] == 80.0
