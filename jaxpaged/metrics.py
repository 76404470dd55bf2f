"""Prometheus metrics of one served engine: vLLM's names under the ``jaxpaged:`` prefix.

Names, types and histogram buckets follow vLLM v1 (``vllm/v1/metrics/loggers.py``), with both the old and the new names where vLLM
renamed one (``gpu_cache_usage_perc`` / ``kv_cache_usage_perc``, ``time_per_output_token_seconds``
/ ``inter_token_latency_seconds``, which observe the same per-token gaps). Every metric carries a
``model_name`` label (the first served model name). Counters are declared without ``_total``;
prometheus_client exports them with it (``jaxpaged:prompt_tokens_total``). One gauge has no
vLLM counterpart: ``grammar_cache_bytes``, the compiled grammars the structured-outputs cache
keeps (bounded by ``structured_outputs_config.grammar_cache_mb``).

``--metrics-prefix vllm`` exports the same metrics as ``vllm:<name>``, the names that inference
gateways and autoscalers read (the Kubernetes Gateway API Inference Extension's model-server
protocol: ``vllm:num_requests_waiting``, ``vllm:num_requests_running``,
``vllm:kv_cache_usage_perc``, ``vllm:lora_requests_info``). As in vLLM v1 every metric also
carries an ``engine`` label, the data-parallel engine index (0 without data parallelism); one
``ServerMetrics`` per engine, rendered together by ``render_all``. ``lora_requests_info`` is
vLLM's: a gauge holding the Unix time of its last update, with labels ``max_lora``,
``running_lora_adapters`` and ``waiting_lora_adapters`` (comma-joined adapter names) and no
``model_name``/``engine``; with LoRA off it still appears with ``max_lora="0"`` and empty lists,
as vLLM v0 reports it (``vllm/engine/llm_engine.py`` ``_get_stats``; v1 only registers it with
a LoRA config). Only the latest label set is kept, so it is one series.

Each ``ServerMetrics`` owns its own ``CollectorRegistry`` (never the process-global one), so
several servers (and tests) in one process do not collide.

Several API processes (``--api-server-count N``) use prometheus_client's multiprocess mode: the
parent sets ``PROMETHEUS_MULTIPROC_DIR`` to a fresh directory before it starts them, each
process writes its values there, and ``render_multiprocess`` (whichever process answers
``/metrics``) adds them up. Per-request metrics (counters, histograms) are summed: each process
counts only its own requests. Engine-level metrics are written by one process only, API process
0 (``observes_engine``), which the engine core sends its stats after every step; their gauges use
``multiprocess_mode="mostrecent"``, so processes that never set them (value 0 at time 0) do not
count, and nothing is summed N times. All ``observe_*`` methods are called
from the engine thread; prometheus_client's metrics are thread-safe for the scraping side.
Times are ``time.monotonic()`` seconds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from collections.abc import Sequence as SequenceABC

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from jaxpaged.core.stats import SchedulerStats
from jaxpaged.outputs import RequestOutput
from jaxpaged.spec_decode.metrics import SpecDecodingStats

DEFAULT_METRICS_PREFIX = "jaxpaged"
# Values of ``--metrics-prefix``: ours, or vLLM's for gateways and dashboards built for vLLM.
METRICS_PREFIX_CHOICES = ("jaxpaged", "vllm")

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
    """The collectors of one server, fed by the API process's core client after every engine-core step with the
    step's outputs and the engine's stats (``LLMEngine.get_stats()``, one ``SchedulerStats``).

    Args:
        model_name: value of the ``model_name`` label.
        registry: where to register; None creates a fresh ``CollectorRegistry``.
        prefix: metric name prefix, one of ``METRICS_PREFIX_CHOICES`` (names become
            ``<prefix>:<name>``).
        engine_index: value of the ``engine`` label, the data-parallel engine index, >= 0.
        max_loras: the ``max_lora`` label of ``lora_requests_info`` (0: LoRA off).
        observes_engine: whether this process keeps the engine-level metrics (gauges,
            preemptions, prefix-cache counters, ``lora_requests_info``); False in API processes
            other than the first of ``--api-server-count`` (they only count their requests).
        multiprocess: prometheus_client runs in multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``
            was set before it was imported); label sets are then never removed (it cannot),
            ``render_multiprocess`` keeps the newest ``lora_requests_info`` instead.
        num_speculative_tokens: K of the engine's ``speculative_config`` (0: no speculation);
            above 0 the four ``spec_decode_*`` counters of vLLM are registered
            (``jaxpaged.spec_decode.metrics``), ``..._per_pos`` with a ``position`` label
            0 .. K-1.

    Raises:
        ValueError: an unknown ``prefix`` or a negative ``engine_index`` / ``max_loras``.
    """

    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry | None = None,
        *,
        prefix: str = DEFAULT_METRICS_PREFIX,
        engine_index: int = 0,
        max_loras: int = 0,
        observes_engine: bool = True,
        multiprocess: bool = False,
        num_speculative_tokens: int = 0,
    ):
        if prefix not in METRICS_PREFIX_CHOICES:
            raise ValueError(
                f"metrics_prefix must be one of {METRICS_PREFIX_CHOICES}, got {prefix!r}"
            )
        if engine_index < 0:
            raise ValueError(f"engine_index must be >= 0, got {engine_index}")
        if max_loras < 0:
            raise ValueError(f"max_loras must be >= 0, got {max_loras}")
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        self.prefix = prefix
        self.engine_index = engine_index
        self.max_loras = max_loras
        self.observes_engine = observes_engine
        self.multiprocess = multiprocess
        # Registered in this order, which is the exposition's.
        self._add_engine_state_metrics()
        self._add_counters()
        self._add_lora_info()
        self._add_latency_histograms()
        self._requests: dict[str, _RequestTimes] = {}
        self._last_stats = _Counters()
        self.spec_decode_counters = None
        if num_speculative_tokens:
            self.spec_decode_counters = _SpecDecodeCounters(
                self._labelled, self.prefix + ":", self._labels, self.registry,
                num_speculative_tokens,
            )  # fmt: skip

    @property
    def _labels(self) -> tuple[str, str]:
        """The ``model_name`` and ``engine`` label values every metric but one carries."""
        return (self.model_name, str(self.engine_index))

    def _labelled(self, kind, name: str, doc: str, **kwargs):
        """A ``kind`` metric ``<prefix>:<name>`` in this registry, at this server's labels."""
        metric = kind(
            f"{self.prefix}:{name}", doc, ["model_name", "engine"], registry=self.registry, **kwargs
        )
        return metric.labels(*self._labels)

    def _add_engine_state_metrics(self) -> None:
        """The engine's gauges, set by one process (module docstring)."""

        def gauge(name, doc):
            return self._labelled(Gauge, name, doc, multiprocess_mode="mostrecent")

        self.num_requests_running = gauge(
            "num_requests_running", "Number of requests in the running batch."
        )
        self.num_requests_waiting = gauge(
            "num_requests_waiting", "Number of requests waiting to be scheduled."
        )
        self.num_requests_swapped = gauge(
            "num_requests_swapped", "Number of requests swapped out to host memory."
        )
        self.kv_cache_usage_perc = gauge(
            "kv_cache_usage_perc", "Fraction of KV-cache blocks in use, 0 to 1."
        )
        self.gpu_cache_usage_perc = gauge(
            "gpu_cache_usage_perc",
            "Fraction of KV-cache blocks in use, 0 to 1 (vLLM v0 name of kv_cache_usage_perc).",
        )
        self.grammar_cache_bytes = gauge(
            "grammar_cache_bytes",
            "Compiled grammars kept by the structured-outputs cache, bytes "
            "(bounded by structured_outputs_config.grammar_cache_mb).",
        )

    def _add_counters(self) -> None:
        """The engine's cumulative counters (prefix cache, preemptions) and the per-request
        ones (tokens, finished requests by reason)."""
        make = self._labelled
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
            f"{self.prefix}:request_success",
            "Finished requests by finish reason.",
            ["model_name", "engine", "finished_reason"],
            registry=self.registry,
        )
        self.request_success = {r: success.labels(*self._labels, r) for r in FINISHED_REASONS}

    def _add_lora_info(self) -> None:
        """vLLM's ``lora_requests_info`` (module docstring), set at once to no adapters."""
        self.lora_requests_info = Gauge(
            f"{self.prefix}:lora_requests_info",
            "Running stats on LoRA requests: Unix time of the last update, labelled with the "
            "running and waiting adapters (comma-joined names) and max_lora.",
            ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self._lora_labels: tuple[str, str, str] | None = None
        self.observe_lora_adapters((), ())

    def _add_latency_histograms(self) -> None:
        """Per-request latencies in seconds, with vLLM v1's buckets."""

        def histogram(name, doc, buckets):
            return self._labelled(Histogram, name, doc, buckets=buckets)

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

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)

    def observe_lora_adapters(self, running: SequenceABC[str], waiting: SequenceABC[str]) -> None:
        """Set ``lora_requests_info`` to now, labelled with these adapter names (distinct,
        in first-seen order, as vLLM's), replacing the previous label set (removed after the
        new one is set, so a scrape never finds the metric empty).

        Called once at construction (no adapters); with multi-LoRA the engine loop
        calls it after each step with the scheduler's running and waiting adapter names.
        A no-op unless ``observes_engine``."""
        if not self.observes_engine:
            return
        labels = (
            str(self.max_loras),
            ",".join(dict.fromkeys(running)),
            ",".join(dict.fromkeys(waiting)),
        )
        self.lora_requests_info.labels(*labels).set_to_current_time()
        previous, self._lora_labels = self._lora_labels, labels
        if previous is not None and previous != labels and not self.multiprocess:
            self.lora_requests_info.remove(*previous)

    # --------------------------------------------------------------- engine-thread callbacks
    def observe_added(self, request_id: str, arrival_time: float) -> None:
        self._requests[request_id] = _RequestTimes(arrival=arrival_time)

    def forget(self, request_id: str) -> None:
        """Drop a request that never entered the engine (refused or cancelled before its ack):
        nothing is counted."""
        self._requests.pop(request_id, None)

    def observe_aborted(self, request_id: str) -> None:
        if self._requests.pop(request_id, None) is not None:
            self.request_success["abort"].inc()

    def observe_step(
        self,
        stats: SchedulerStats,
        outputs: list[RequestOutput],
        step_start: float,
        now: float,
        scheduled: Iterable[str] = (),
    ) -> None:
        """Token counters and latencies from one step's outputs, then the engine's gauges and
        counters from ``stats`` (``LLMEngine.get_stats()`` after the step).

        A request counts as scheduled at ``step_start`` when its id is in ``scheduled`` (the
        engine core reports the ids that entered the running batch), else at its output's
        ``metrics["first_scheduled_time"]``, else at ``step_start`` of its first output.
        """
        for request_id in scheduled:
            times = self._requests.get(request_id)
            if times is not None and times.scheduled is None:
                times.scheduled = step_start
        step_tokens = 0  # counted once per step: at saturation a step has hundreds of outputs
        for output in outputs:
            times = self._requests.get(output.request_id)
            if times is None:
                continue
            if times.scheduled is None:
                scheduled = (output.metrics or {}).get("first_scheduled_time")
                times.scheduled = step_start if scheduled is None else scheduled
            num_tokens = sum(len(c.token_ids) for c in output.outputs)
            new_tokens = num_tokens - times.num_output_tokens
            if new_tokens > 0:
                step_tokens += new_tokens
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
        if step_tokens:
            self.generation_tokens.inc(step_tokens)
        if self.observes_engine:
            self.observe_engine_state(stats)

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

    def observe_engine_state(self, stats: SchedulerStats) -> None:
        """Gauges and the engine's cumulative counters (preemptions, prefix-cache tokens) from
        ``stats``; counters advance by the change since the last call."""
        self.num_requests_running.set(stats.num_requests_running)
        self.num_requests_waiting.set(stats.num_requests_waiting)
        self.num_requests_swapped.set(stats.num_requests_swapped)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage_perc)
        self.gpu_cache_usage_perc.set(stats.kv_cache_usage_perc)
        self.grammar_cache_bytes.set(stats.grammar_cache_bytes)
        last = self._last_stats
        self.num_preemptions.inc(max(0, stats.num_preemptions - last.num_preemptions))
        self.prefix_cache_queries.inc(
            max(0, stats.prefix_cache_queries - last.prefix_cache_queries)
        )
        self.prefix_cache_hits.inc(max(0, stats.prefix_cache_hits - last.prefix_cache_hits))
        self._last_stats = _Counters(
            stats.num_preemptions, stats.prefix_cache_queries, stats.prefix_cache_hits
        )

    def observe_spec_decoding(self, stats: SpecDecodingStats) -> None:
        """Advance the ``spec_decode_*`` counters to ``stats`` (cumulative, from the engine's
        scheduler after a step). A no-op without speculation or unless ``observes_engine``."""
        if self.spec_decode_counters is not None and self.observes_engine:
            self.spec_decode_counters.observe(stats)


class _SpecDecodeCounters:
    """vLLM's four speculative-decoding counters (``vllm/v1/spec_decode/metrics.py``
    ``SpecDecodingProm``), advanced by the change since the last observation."""

    def __init__(self, make, prefix: str, labels: tuple[str, str], registry, k: int):
        self.drafts = make(Counter, "spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.draft_tokens = make(Counter, "spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.accepted_tokens = make(
            Counter, "spec_decode_num_accepted_tokens", "Number of accepted tokens."
        )
        per_pos = Counter(
            prefix + "spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            ["model_name", "engine", "position"],
            registry=registry,
        )
        self.accepted_per_pos = [per_pos.labels(*labels, str(i)) for i in range(k)]
        self._last: SpecDecodingStats | None = None

    def observe(self, stats: SpecDecodingStats) -> None:
        delta = stats.since(self._last)
        self.drafts.inc(delta.num_drafts)
        self.draft_tokens.inc(delta.num_draft_tokens)
        self.accepted_tokens.inc(delta.num_accepted_tokens)
        for counter, n in zip(self.accepted_per_pos, delta.num_accepted_tokens_per_pos,
                              strict=True):  # fmt: skip
            counter.inc(n)
        self._last = dataclasses.replace(
            stats,
            num_accepted_tokens_per_pos=list(stats.num_accepted_tokens_per_pos),
            num_draft_tokens_per_pos=list(stats.num_draft_tokens_per_pos),
        )


@dataclasses.dataclass(frozen=True)
class _Counters:
    """The engine's cumulative counters at the last observation."""

    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class _Merged(Collector):
    """The metric families of several registries as one: samples of families with the same
    name are concatenated under one HELP/TYPE (a text exposition may not repeat a family).
    An exact repeat of a sample (same name and labels, e.g. ``lora_requests_info`` when two
    engines both report no adapters) is kept once."""

    def __init__(self, registries):
        self._registries = registries

    def collect(self):
        merged: dict[str, Metric] = {}
        seen = set()
        for registry in self._registries:
            for family in registry.collect():
                target = merged.get(family.name)
                if target is None:
                    target = Metric(family.name, family.documentation, family.type, family.unit)
                    merged[family.name] = target
                for sample in family.samples:
                    key = (sample.name, tuple(sorted(sample.labels.items())))
                    if key not in seen:
                        seen.add(key)
                        target.samples.append(sample)
        yield from merged.values()


def render_all(metrics: SequenceABC[ServerMetrics]) -> bytes:
    """One Prometheus text exposition of several engines' metrics (data parallelism: one
    ``ServerMetrics`` per engine, told apart by their ``engine`` label).

    Raises:
        ValueError: an empty list, or metrics with different prefixes.
    """
    if not metrics:
        raise ValueError("render_all needs at least one ServerMetrics, got none")
    prefixes = {m.prefix for m in metrics}
    if len(prefixes) > 1:
        raise ValueError(f"render_all needs one metrics prefix, got {sorted(prefixes)}")
    registry = CollectorRegistry()
    registry.register(_Merged([m.registry for m in metrics]))
    return generate_latest(registry)


def render_multiprocess(path: str) -> bytes:
    """One Prometheus text exposition of every API process's values in ``path`` (the
    ``PROMETHEUS_MULTIPROC_DIR`` of ``--api-server-count``; module docstring).

    ``lora_requests_info`` keeps only its newest label set (its value is the Unix time of its
    last update): prometheus_client cannot remove a label set in multiprocess mode, and the
    metric is one series (vLLM's).
    """
    from prometheus_client import multiprocess

    registry = CollectorRegistry()
    registry.register(_NewestLoRAInfo(multiprocess.MultiProcessCollector(None, path=path)))
    return generate_latest(registry)


class _NewestLoRAInfo(Collector):
    """``collector``'s families, with ``*:lora_requests_info`` cut to its newest sample."""

    def __init__(self, collector):
        self._collector = collector

    def collect(self):
        for family in self._collector.collect():
            if family.name.endswith(":lora_requests_info") and family.samples:
                family.samples = [max(family.samples, key=lambda sample: sample.value)]
            yield family
