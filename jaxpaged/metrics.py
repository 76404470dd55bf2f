"""Prometheus metrics of one served engine: vLLM's names under the ``jaxpaged:`` prefix.

Names, types and histogram buckets follow vLLM v1 (``vllm/v1/metrics/loggers.py``; the list is
in ``reference/vllm_surface.md`` section 3), with both the old and the new names where vLLM
renamed one (``gpu_cache_usage_perc`` / ``kv_cache_usage_perc``, ``time_per_output_token_seconds``
/ ``inter_token_latency_seconds``, which observe the same per-token gaps). Every metric carries a
``model_name`` label (the first served model name). Counters are declared without ``_total``;
prometheus_client exports them with it (``jaxpaged:prompt_tokens_total``).

Each ``ServerMetrics`` owns its own ``CollectorRegistry`` (never the process-global one), so
several servers (and tests) in one process do not collide. All ``observe_*`` methods are called
from the engine thread; prometheus_client's metrics are thread-safe for the scraping side.
Times are ``time.monotonic()`` seconds.
"""

from __future__ import annotations

import dataclasses

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "jaxpaged:"

# vLLM v1's bucket boundaries, in seconds.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

FINISHED_REASONS = ("stop", "length", "abort")


@dataclasses.dataclass
class _RequestTimes:
    arrival: float
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    num_output_tokens: int = 0


class ServerMetrics:
    """The collectors of one server, fed by ``AsyncLLMEngine`` after every engine step.

    Args:
        model_name: value of the ``model_name`` label.
        registry: where to register; None creates a fresh ``CollectorRegistry``.
    """

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name

        def make(kind, name, doc, **kwargs):
            return kind(
                PREFIX + name, doc, ["model_name"], registry=self.registry, **kwargs
            ).labels(model_name)

        self.num_requests_running = make(
            Gauge, "num_requests_running", "Number of requests in the running batch."
        )
        self.num_requests_waiting = make(
            Gauge, "num_requests_waiting", "Number of requests waiting to be scheduled."
        )
        self.num_requests_swapped = make(
            Gauge, "num_requests_swapped", "Number of requests swapped out to host memory."
        )
        self.kv_cache_usage_perc = make(
            Gauge, "kv_cache_usage_perc", "Fraction of KV-cache blocks in use, 0 to 1."
        )
        self.gpu_cache_usage_perc = make(
            Gauge,
            "gpu_cache_usage_perc",
            "Fraction of KV-cache blocks in use, 0 to 1 (vLLM v0 name of kv_cache_usage_perc).",
        )
        self.prefix_cache_queries = make(
            Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = make(
            Counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.num_preemptions = make(Counter, "num_preemptions", "Cumulative preemptions.")
        self.prompt_tokens = make(Counter, "prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = make(Counter, "generation_tokens", "Generated tokens.")
        success = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.request_success = {r: success.labels(model_name, r) for r in FINISHED_REASONS}

        def histogram(name, doc, buckets):
            return make(Histogram, name, doc, buckets=buckets)

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first token, seconds.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Gap between consecutive tokens, seconds.", ITL_BUCKETS
        )
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds",
            "Gap between consecutive tokens, seconds (vLLM v0 name of inter_token_latency).",
            ITL_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds",
            "Arrival to last token, seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds",
            "Arrival to first scheduled, seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_inference_time = histogram(
            "request_inference_time_seconds",
            "First scheduled to last token, seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds",
            "First scheduled to first token, seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_decode_time = histogram(
            "request_decode_time_seconds",
            "First token to last token, seconds.",
            REQUEST_LATENCY_BUCKETS,
        )

        self._requests: dict[str, _RequestTimes] = {}
        self._last_num_preemptions = 0
        self._last_prefix_stats: tuple[int, int] | None = None

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)

    # --------------------------------------------------------------- engine-thread callbacks
    def observe_added(self, request_id: str, arrival_time: float) -> None:
        self._requests[request_id] = _RequestTimes(arrival=arrival_time)

    def observe_aborted(self, request_id: str) -> None:
        if self._requests.pop(request_id, None) is not None:
            self.request_success["abort"].inc()

    def observe_step(self, engine, outputs, step_start: float, now: float) -> None:
        """Token counters and latencies from one step's outputs.

        Every tracked request in the running batch after the step, or with an output from it,
        counts as scheduled at ``step_start`` if it was not before.
        """
        for group in engine.scheduler.running:
            times = self._requests.get(group.request_id)
            if times is not None and times.scheduled is None:
                times.scheduled = step_start
        prefix_stats = _prefix_cache_stats(engine)
        for output in outputs:
            times = self._requests.get(output.request_id)
            if times is None:
                continue
            if times.scheduled is None:
                times.scheduled = step_start
            num_tokens = sum(len(c.token_ids) for c in output.outputs)
            new_tokens = num_tokens - times.num_output_tokens
            if new_tokens > 0:
                self.generation_tokens.inc(new_tokens)
                if times.first_token is None:
                    times.first_token = now
                    self.time_to_first_token.observe(now - times.arrival)
                    num_prompt = len(output.prompt_token_ids)
                    self.prompt_tokens.inc(num_prompt)
                    if prefix_stats is None:  # the engine keeps no counters: use the output
                        self.prefix_cache_queries.inc(num_prompt)
                        self.prefix_cache_hits.inc(getattr(output, "num_cached_tokens", 0) or 0)
                else:
                    self.inter_token_latency.observe(now - times.last_token)
                    self.time_per_output_token.observe(now - times.last_token)
                times.last_token = now
                times.num_output_tokens = num_tokens
            if output.finished:
                self._observe_finished(output, times, now)
        self._observe_engine_state(engine, prefix_stats)

    def _observe_finished(self, output, times: _RequestTimes, now: float) -> None:
        del self._requests[output.request_id]
        reason = output.outputs[0].finish_reason if output.outputs else None
        if reason in self.request_success:
            self.request_success[reason].inc()
        self.e2e_request_latency.observe(now - times.arrival)
        self.request_queue_time.observe(times.scheduled - times.arrival)
        self.request_inference_time.observe(now - times.scheduled)
        if times.first_token is not None:
            self.request_prefill_time.observe(times.first_token - times.scheduled)
            self.request_decode_time.observe(now - times.first_token)

    def observe_engine_state(self, engine) -> None:
        """Gauges and engine-cumulative counters, read from the scheduler and KV manager
        (and from ``engine.get_stats()`` for the prefix cache, when the engine has it)."""
        self._observe_engine_state(engine, _prefix_cache_stats(engine))

    def _observe_engine_state(self, engine, prefix_stats: tuple[int, int] | None) -> None:
        scheduler = engine.scheduler
        self.num_requests_running.set(scheduler.num_running)
        self.num_requests_waiting.set(scheduler.num_waiting)
        swapped = getattr(scheduler, "num_swapped", None)
        if swapped is None:
            swapped = len(getattr(scheduler, "swapped", ()))
        self.num_requests_swapped.set(swapped)
        usage = engine.kv_cache_manager.usage
        self.kv_cache_usage_perc.set(usage)
        self.gpu_cache_usage_perc.set(usage)
        num_preemptions = scheduler.num_preemptions
        if num_preemptions > self._last_num_preemptions:
            self.num_preemptions.inc(num_preemptions - self._last_num_preemptions)
        self._last_num_preemptions = num_preemptions
        if prefix_stats is not None:
            last = self._last_prefix_stats or (0, 0)
            self.prefix_cache_queries.inc(max(0, prefix_stats[0] - last[0]))
            self.prefix_cache_hits.inc(max(0, prefix_stats[1] - last[1]))
            self._last_prefix_stats = prefix_stats

    def observe_core_step(self, outputs, stats: dict, now: float) -> None:
        """``observe_step`` for an engine core in another process (``engine/core_client.py``).

        Args:
            outputs: the step's cumulative ``RequestOutput``s as the API process built them.
            stats: the core's step stats: ``SchedulerStats`` fields plus ``scheduled`` (ids
                that entered the running batch) and ``step_start`` (``time.monotonic()``).
            now: when the outputs arrived.
        """
        for request_id in stats["scheduled"]:
            times = self._requests.get(request_id)
            if times is not None and times.scheduled is None:
                times.scheduled = stats["step_start"]
        for output in outputs:
            times = self._requests.get(output.request_id)
            if times is None:
                continue
            if times.scheduled is None:
                times.scheduled = stats["step_start"]
            num_tokens = sum(len(c.token_ids) for c in output.outputs)
            new_tokens = num_tokens - times.num_output_tokens
            if new_tokens > 0:
                self.generation_tokens.inc(new_tokens)
                if times.first_token is None:
                    times.first_token = now
                    self.time_to_first_token.observe(now - times.arrival)
                    self.prompt_tokens.inc(len(output.prompt_token_ids))
                else:
                    self.inter_token_latency.observe(now - times.last_token)
                    self.time_per_output_token.observe(now - times.last_token)
                times.last_token = now
                times.num_output_tokens = num_tokens
            if output.finished:
                self._observe_finished(output, times, now)
        self.num_requests_running.set(stats["num_requests_running"])
        self.num_requests_waiting.set(stats["num_requests_waiting"])
        self.num_requests_swapped.set(stats["num_requests_swapped"])
        self.kv_cache_usage_perc.set(stats["kv_cache_usage_perc"])
        self.gpu_cache_usage_perc.set(stats["kv_cache_usage_perc"])
        last_preemptions = self._last_num_preemptions
        self.num_preemptions.inc(max(0, stats["num_preemptions"] - last_preemptions))
        self._last_num_preemptions = stats["num_preemptions"]
        last = self._last_prefix_stats or (0, 0)
        self.prefix_cache_queries.inc(max(0, stats["prefix_cache_queries"] - last[0]))
        self.prefix_cache_hits.inc(max(0, stats["prefix_cache_hits"] - last[1]))
        self._last_prefix_stats = (stats["prefix_cache_queries"], stats["prefix_cache_hits"])


def _prefix_cache_stats(engine) -> tuple[int, int] | None:
    """Cumulative (queries, hits) in tokens from ``engine.get_stats()``, if the engine offers
    them (as attributes or keys ``prefix_cache_queries`` / ``prefix_cache_hits``); else None."""
    get_stats = getattr(engine, "get_stats", None)
    if not callable(get_stats):
        return None
    stats = get_stats()
    values = []
    for name in ("prefix_cache_queries", "prefix_cache_hits"):
        value = stats.get(name) if isinstance(stats, dict) else getattr(stats, name, None)
        if value is None:
            return None
        values.append(int(value))
    return values[0], values[1]
