"""What ``lora_requests_info`` reports, as the engine core computes it after every step.

vLLM's ``vllm:lora_requests_info`` (``vllm/v1/metrics/loggers.py``) labels ``max_lora``,
``running_lora_adapters`` and ``waiting_lora_adapters``; the engine core puts those into the
stats it sends after every step (``lora_stats``) and the API process's
``ServerMetrics.observe_lora_adapters`` sets the gauge (``jaxpaged/metrics.py``).
"""

from __future__ import annotations


def lora_stats(scheduler, lora_manager) -> dict:
    """The LoRA part of the engine core's stats: ``max_loras`` and the sorted names of the
    running and waiting requests' adapters (``Scheduler.lora_adapter_names``)."""
    running, waiting = scheduler.lora_adapter_names()
    return {
        "max_loras": lora_manager.max_loras,
        "running_lora_adapters": running,
        "waiting_lora_adapters": waiting,
    }
