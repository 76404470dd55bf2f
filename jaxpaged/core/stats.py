"""A snapshot of scheduler and KV-cache state for metrics (host only; no JAX).

Field names follow vLLM v1's Prometheus metrics (`vllm:<name>`; counters gain `_total` on
export; `vllm/v1/metrics/loggers.py`).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    """Gauges describe the moment of the snapshot; counters are cumulative since start-up."""

    num_requests_running: int
    """Requests (sequence groups) in the running batch (`vllm:num_requests_running`)."""
    num_requests_waiting: int
    """Requests waiting to be admitted, including recompute-preempted ones."""
    num_requests_swapped: int
    """Requests preempted to host memory (`vllm:num_requests_swapped`)."""
    kv_cache_usage_perc: float
    """Device KV blocks in use / total, in [0, 1]; evictable cached blocks count as free."""
    cpu_cache_usage_perc: float
    """Host (swap) blocks in use / total, in [0, 1]; 0 without swap space."""
    num_gpu_blocks: int
    num_cpu_blocks: int
    prefix_cache_queries: int
    """Counter: tokens looked up in the prefix cache (`vllm:prefix_cache_queries`)."""
    prefix_cache_hits: int
    """Counter: of those, tokens found cached (`vllm:prefix_cache_hits`)."""
    num_preemptions: int
    """Counter: preemptions of either kind (`vllm:num_preemptions`)."""
    num_preemptions_swap: int
    num_preemptions_recompute: int
    kv_cache_tokens_stored: int
    """Token slots holding K/V in the running sequences' tables."""
    kv_cache_slots_held: int
    """Slots of the blocks those tables hold (blocks * block_size)."""
    grammar_cache_bytes: int = 0
    """Compiled grammars kept by the structured-outputs cache, bytes (set by the engine;
    ``jaxpaged:grammar_cache_bytes``, no vLLM counterpart)."""

    @property
    def gpu_cache_usage_perc(self) -> float:
        """vLLM v0's name for `kv_cache_usage_perc`."""
        return self.kv_cache_usage_perc

    @property
    def kv_cache_fragmentation(self) -> float:
        """Internal fragmentation, `1 - stored / held` in [0, 1); 0 when nothing is held."""
        if not self.kv_cache_slots_held:
            return 0.0
        return 1.0 - self.kv_cache_tokens_stored / self.kv_cache_slots_held

    @classmethod
    def of(cls, scheduler) -> SchedulerStats:
        """The snapshot of a ``core.scheduler.Scheduler`` and its KV cache manager now."""
        kv = scheduler.kv_cache_manager
        stored, held = kv.slots_stored_vs_held()
        return cls(
            num_requests_running=len(scheduler.running),
            num_requests_waiting=len(scheduler.waiting),
            num_requests_swapped=len(scheduler.swapped),
            kv_cache_usage_perc=kv.usage,
            cpu_cache_usage_perc=kv.cpu_usage,
            num_gpu_blocks=kv.num_blocks,
            num_cpu_blocks=kv.num_cpu_blocks,
            prefix_cache_queries=scheduler.prefix_cache_queries,
            prefix_cache_hits=scheduler.prefix_cache_hits,
            num_preemptions=scheduler.num_preemptions,
            num_preemptions_swap=scheduler.num_preemptions_by_mode["swap"],
            num_preemptions_recompute=scheduler.num_preemptions_by_mode["recompute"],
            kv_cache_tokens_stored=stored,
            kv_cache_slots_held=held,
        )
