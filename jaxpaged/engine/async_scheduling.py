"""Async scheduling: commit step N only once step N+1 is running on the device.

vLLM's ``--async-scheduling``, on the unchanged scheduler. One ``LLMEngine.step()`` (the
PIPELINED plan of ``engine/step_pipeline.py``):

    schedule N+1 -> launch N+1 -> read back N -> resolve N -> commit N+1 with placeholders

``commit_with_placeholders`` commits a launched step at once with ``PLACEHOLDER_TOKEN_ID`` for
every token it samples: the scheduler advances ``num_computed_tokens``, appends the placeholder
and finishes the sequences that reach ``max_tokens`` / ``max_model_len`` (which needs no token
value), so the next ``schedule`` sees each sequence as it will be. A step that decodes a
placeholder reads the real id from the previous step's on-device output (``ModelRunner``).

``resolve`` runs once the tokens are on the host (the device is already busy with the next
step): it writes the real ids over the placeholders, adds their logprobs and applies the stop
rules that need the value (EOS, ``stop_token_ids``). A sequence that stops there was already
scheduled in the step now running; that row is wasted, and its K/V write lands in blocks freed
now, which is harmless: the device runs steps in dispatch order, so it lands before any later
step that reuses those blocks writes them.

Resolving N before committing N+1 keeps each placeholder the last token of its sequence when it
is replaced, and keeps placeholders out of prefix-cache hashes (only computed blocks are hashed,
and a placeholder is never computed before it is resolved). Outputs equal the synchronous
engine's: the same ids, per-row seeds and ``step`` counters, and stop decisions.

Grammars (structured outputs): the bitmask of step N+1 needs step N's tokens on the host. Such a
step runs the SPLIT plan of ``engine/step_pipeline.py``, its forward and sample stages as two
executables:

    schedule N+1 -> launch N+1's forward -> read back and resolve N -> advance the matchers,
    fill N+1's bitmask -> launch N+1's sampling -> commit N+1 with placeholders

so the host's grammar work overlaps the model's forward pass instead of idling the device; the
bitmask is a second host-to-device transfer of that step. Grammar steps with prompt logprobs
(which need the hidden states) run whole, after the pipeline drains, as beam-search steps do
(the SYNC plan).
"""

from __future__ import annotations

import dataclasses

from jaxpaged.core.scheduler import Scheduler, SchedulerOutput
from jaxpaged.sequence import PLACEHOLDER_TOKEN_ID, Sequence, SequenceStatus
from jaxpaged.worker.model_runner import DeviceStep
from jaxpaged.worker.step_output import ModelRunnerOutput


@dataclasses.dataclass
class StepTimes:
    """When one async ``LLMEngine.step`` did what (``time.monotonic()`` seconds), for the engine
    core's choice of when to schedule the next step (``engine_core/admission.py``) and its traces.

    ``device_start`` is when the step this call dispatched began on the device: when the previous
    step's tokens became ready if the host was already waiting for them (the device runs steps in
    dispatch order), else at dispatch: a lower bound (the previous step ended before the host
    looked, perhaps after the dispatch).
    """

    started: float  # step() entered; scheduling began
    dispatched: float  # the step it scheduled was launched (or found empty)
    has_device_work: bool  # that step runs something on the device
    previous_ready: float | None = None  # the previous step's tokens were ready (None: none)
    previous_waited: bool = False  # the host waited for them, so previous_ready is their finish

    @property
    def device_start(self) -> float:
        if self.previous_waited and self.previous_ready is not None:
            return max(self.dispatched, self.previous_ready)
        return self.dispatched


@dataclasses.dataclass
class InFlightStep:
    """A launched step committed with placeholders, waiting for its tokens."""

    step: DeviceStep
    # What the placeholder commit returned: sequences that got a placeholder (finished by
    # length or not) and groups that finished while the step was scheduled.
    updated: list[Sequence]


def commit_with_placeholders(
    scheduler: Scheduler, scheduler_output: SchedulerOutput, step: DeviceStep
) -> InFlightStep:
    """Commit a just-launched step with a placeholder for each token it samples."""
    placeholders = {
        item.seq.seq_id: PLACEHOLDER_TOKEN_ID
        for item in scheduler_output.scheduled
        if item.do_sample
    }
    updated = scheduler.update_from_output(scheduler_output, placeholders)
    return InFlightStep(step, updated)


def resolve(
    scheduler: Scheduler, in_flight: InFlightStep, runner_output: ModelRunnerOutput
) -> list[Sequence]:
    """Replace the step's placeholders by the sampled ids and apply the token stop rules.

    Returns what the synchronous ``update_from_output`` would have: the sequences that got a
    token in the step (finished or not) and the groups that finished while it was scheduled.
    Sequences aborted since are left out, and so are their prompt logprobs (removed from
    ``runner_output``).
    """
    for item in in_flight.step.scheduled:
        if item.seq.status is SequenceStatus.FINISHED_ABORTED:
            # Keyed by sequence id: a request that reuses the aborted one's id must not get them.
            runner_output.prompt_logprobs.pop(item.seq.seq_id, None)
    updated = []
    sampled = runner_output.sampled_token_ids
    for seq in in_flight.updated:
        if seq.status is SequenceStatus.FINISHED_ABORTED:
            continue
        if seq.seq_id in sampled and seq.token_ids[-1] == PLACEHOLDER_TOKEN_ID:
            seq.replace_last_token(sampled[seq.seq_id])
            seq.cumulative_logprob += runner_output.sampled_logprobs.get(seq.seq_id, 0.0)
            status = seq.stop_status(scheduler.max_model_len)
            if seq.is_finished:
                # Finished by length on the placeholder; EOS or a stop token on that same
                # token comes first in the order of the stop checks.
                if status is SequenceStatus.FINISHED_STOPPED:
                    seq.status = status
            elif status is not None:
                scheduler.finish_sequence(seq.seq_id, status)
        updated.append(seq)
    return updated
