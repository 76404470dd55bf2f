"""Async scheduling: commit step N only once step N+1 is running on the device.

vLLM v1's async scheduling, on top of the unchanged scheduler. One ``LLMEngine.step()`` call:

    schedule N+1 -> dispatch N+1 -> read back N's tokens -> resolve_step(N) -> apply_placeholders(N+1)

``apply_placeholders`` commits a dispatched step at once with ``PLACEHOLDER_TOKEN_ID`` for every
token it samples: the scheduler advances ``num_computed_tokens``, appends the placeholder and
finishes the sequences that reach ``max_tokens`` / ``max_model_len`` (which needs no token
value), so the next ``schedule`` sees each sequence exactly as it will be. A decode of a
placeholder reads the real id from the previous step's on-device output (``ModelRunner``).

``resolve_step`` runs when the tokens are on the host: it writes the real ids over the
placeholders and applies the stop rules that need them (EOS, ``stop_token_ids``). A sequence that
stops there was already scheduled in the step now running; that row is wasted and its K/V write
lands in blocks freed now. That write is harmless: the device runs steps in dispatch order, so
it lands before any later step that reuses the blocks writes them.

Resolving step N before placeholders of N+1 are applied keeps each placeholder the last token of
its sequence when it is replaced. Outputs equal the synchronous engine's: the sampled ids, the
per-row seeds and ``step`` counters, and the stop decisions are the same.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jaxpaged.core.scheduler import Scheduler, SchedulerOutput
from jaxpaged.sequence import Sequence, SequenceStatus
from jaxpaged.worker.model_runner import PLACEHOLDER_TOKEN_ID, PendingStep


@dataclasses.dataclass
class InFlightStep:
    """A dispatched step committed with placeholders, waiting for its tokens."""

    scheduler_output: SchedulerOutput
    pending: PendingStep
    # Sequences that got a placeholder token from this step, in scheduling order.
    sampled_seqs: list[Sequence]


def apply_placeholders(
    scheduler: Scheduler, scheduler_output: SchedulerOutput, pending: PendingStep
) -> InFlightStep:
    """Commit a just-dispatched step with a placeholder for each token it samples."""
    placeholders = {
        item.seq.seq_id: PLACEHOLDER_TOKEN_ID
        for item in scheduler_output.scheduled
        if item.do_sample
    }
    updated = scheduler.update_from_output(scheduler_output, placeholders)
    return InFlightStep(scheduler_output, pending, updated)


def resolve_step(
    scheduler: Scheduler,
    in_flight: InFlightStep,
    sampled: dict[str, tuple[int, float]],
    is_live: Callable[[Sequence], bool],
) -> list[Sequence]:
    """Replace the step's placeholders by the sampled ids and apply the token stop rules.

    Args:
        sampled: ``{seq_id: (token_id, logprob)}`` read back from the device.
        is_live: False for a sequence whose request was aborted since it was scheduled.

    Returns:
        The live sequences that got a token in the step, finished or not (what the synchronous
        ``update_from_output`` returns).
    """
    updated = []
    for seq in in_flight.sampled_seqs:
        if seq.status is SequenceStatus.FINISHED_ABORTED or not is_live(seq):
            continue
        seq.replace_last_token(sampled[seq.seq_id][0])
        status = scheduler.check_stop(seq)
        if seq.is_finished:
            # Finished by length with the placeholder; EOS or a stop token on the same token
            # takes precedence (the order of the stop checks).
            if status is SequenceStatus.FINISHED_STOPPED:
                seq.status = status
        elif status is not None:
            scheduler.finish_sequence(seq.seq_id, status)
        updated.append(seq)
    return updated
