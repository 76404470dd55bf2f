"""``lora_requests_info``: the gauge Kubernetes inference gateways read to route by adapter.

vLLM's ``vllm:lora_requests_info`` (``vllm/v1/metrics/loggers.py``): one sample whose labels
carry ``max_lora`` (slots), ``running_lora_adapters`` and ``waiting_lora_adapters``
(comma-separated adapter names) and whose value is a Unix timestamp; readers take the sample
with the newest timestamp. Here it is a custom collector evaluated at scrape time, so the
value is the scrape's time and the labels are the scheduler's state at that moment.
"""

from __future__ import annotations

import time

from prometheus_client.core import GaugeMetricFamily

LABELS = ("max_lora", "running_lora_adapters", "waiting_lora_adapters")


class LoRARequestsInfo:
    """A prometheus_client collector over an ``LLMEngine`` with LoRA enabled.

    Args:
        llm_engine: the engine (its ``scheduler`` and ``lora_manager`` are read).
        prefix: the metric name prefix (``jaxpaged.metrics.PREFIX``).
    """

    def __init__(self, llm_engine, prefix: str):
        self.llm_engine = llm_engine
        self.name = prefix + "lora_requests_info"

    def collect(self):
        running, waiting = self.llm_engine.scheduler.lora_adapter_names()
        family = GaugeMetricFamily(
            self.name, "Running stats on LoRA requests (value: Unix time).", labels=LABELS
        )
        max_lora = str(self.llm_engine.lora_manager.max_loras)
        family.add_metric([max_lora, ",".join(running), ",".join(waiting)], time.time())
        yield family
