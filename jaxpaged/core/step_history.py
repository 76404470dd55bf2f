"""What each engine step scheduled: tokens (prefill / decode), sequences, preemptions, KV usage.

Host only (no JAX). The engine records every ``SchedulerOutput`` it runs; ``jaxpaged.viz`` draws
the records as a timeline. The history is bounded (``max_steps``, oldest dropped first) so a
long-running server does not grow without end.
"""

from __future__ import annotations

import collections
import dataclasses

from jaxpaged.core.scheduler_output import SchedulerOutput

DEFAULT_MAX_STEPS = 10_000


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One step. A scheduled sequence decodes when it computes one token past its prompt;
    everything else (prompt chunks, recomputation after a preemption) is prefill."""

    step: int  # 0-based index among the recorded (non-empty) steps
    num_prefill_tokens: int
    num_decode_tokens: int
    num_seqs: int  # sequences scheduled
    num_preempted: int  # sequences preempted while scheduling this step
    kv_cache_usage: float  # device blocks in use / total after scheduling, in [0, 1]


class StepHistory:
    """The last ``max_steps`` ``StepRecord`` s, oldest first."""

    def __init__(self, max_steps: int = DEFAULT_MAX_STEPS) -> None:
        if max_steps < 1:
            raise ValueError(f"max_steps must be at least 1, got {max_steps}")
        self._records: collections.deque[StepRecord] = collections.deque(maxlen=max_steps)
        self._num_steps = 0

    def record(self, output: SchedulerOutput, kv_cache_usage: float) -> None:
        """Append the record of a step that schedules ``output`` (empty steps are skipped)."""
        if not output.scheduled and not output.preempted_seq_ids:
            return
        decode = sum(
            s.num_new_tokens
            for s in output.scheduled
            if s.num_new_tokens == 1 and s.num_computed_tokens >= s.seq.num_prompt_tokens
        )
        self._records.append(
            StepRecord(
                step=self._num_steps,
                num_prefill_tokens=sum(s.num_new_tokens for s in output.scheduled) - decode,
                num_decode_tokens=decode,
                num_seqs=len(output.scheduled),
                num_preempted=len(output.preempted_seq_ids),
                kv_cache_usage=kv_cache_usage,
            )
        )
        self._num_steps += 1

    @property
    def num_recorded(self) -> int:
        """Steps recorded since the start (dropped ones included)."""
        return self._num_steps

    def last(self) -> StepRecord | None:
        """The newest record (None: none yet), without copying the history."""
        return self._records[-1] if self._records else None

    def records(self) -> list[StepRecord]:
        """A copy of the kept records, oldest first."""
        return list(self._records)

    def clear(self) -> None:
        self._records.clear()
