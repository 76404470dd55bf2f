"""``lora_requests_info``: the gauge Kubernetes inference gateways read to route by adapter.

vLLM's ``vllm:lora_requests_info`` (``vllm/v1/metrics/loggers.py``): one sample whose labels
carry ``max_lora`` (slots), ``running_lora_adapters`` and ``waiting_lora_adapters``
(comma-separated adapter names) and whose value is a Unix timestamp; readers take the sample
with the newest timestamp. The engine core puts the adapter names into the stats it sends after
every step (``lora_stats``); the API process's collector, evaluated at scrape time, reads the
newest of them, so the value is the scrape's time and the labels are the scheduler's state
after the last step.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client.core import GaugeMetricFamily

LABELS = ("max_lora", "running_lora_adapters", "waiting_lora_adapters")


def lora_stats(scheduler, lora_manager) -> dict:
    """The LoRA part of the engine core's stats: ``max_loras`` and the sorted names of the
    running and waiting requests' adapters (``Scheduler.lora_adapter_names``)."""
    running, waiting = scheduler.lora_adapter_names()
    return {
        "max_loras": lora_manager.max_loras,
        "running_lora_adapters": running,
        "waiting_lora_adapters": waiting,
    }


class LoRARequestsInfo:
    """A prometheus_client collector over the engine core's latest stats.

    Args:
        latest_stats: returns the core's stats after its last step (holding ``lora_stats``'
            keys), or None before the first step.
        max_loras: the core's slots (``max_lora`` before any step).
        prefix: the metric name prefix (``jaxpaged.metrics.PREFIX``).
    """

    def __init__(self, latest_stats: Callable[[], dict | None], max_loras: int, prefix: str):
        self.latest_stats = latest_stats
        self.max_loras = max_loras
        self.name = prefix + "lora_requests_info"

    def collect(self):
        stats = self.latest_stats() or {}
        family = GaugeMetricFamily(
            self.name, "Running stats on LoRA requests (value: Unix time).", labels=LABELS
        )
        max_lora = str(stats.get("max_loras", self.max_loras))
        running = ",".join(stats.get("running_lora_adapters", ()))
        waiting = ",".join(stats.get("waiting_lora_adapters", ()))
        family.add_metric([max_lora, running, waiting], time.time())
        yield family
