"""One engine step, one pipeline: named stages, and the variants of a step as data.

Every step, whatever its options, goes through the same stages::

      host                         device (worker/step_program.py)            host
    ┌──────────┐  ┌─────────┐  ┌───────────────────────────────────┐  ┌───────────┐  ┌─────────┐
    │ schedule ├─>│ prepare ├─>│ forward ──(logits)──> sample      ├─>│ read back ├─>│ commit  │
    └──────────┘  └─────────┘  └───────────────────────────────────┘  └───────────┘  └─────────┘
     Scheduler     bucket,        model over T tokens    bitmask, penalties,  ModelRunner-     tokens or
     .schedule     slots,         K/V into the cache     filters, sampling,   Output           placeholders,
                   variant,                              logprobs, beams                       stops, outputs
                   packed inputs

A ``StepPlan`` says how one step walks these stages: which device segments it launches (a
segment is a contiguous run of device stages compiled as one executable), and where the host
work falls between them. The host actions are ``RESOLVE`` (read back the step still in flight
under async scheduling, write its tokens over its placeholders, stop checks, grammars, outputs),
``WAIT`` (read back this step's tokens) and ``COMMIT`` (this step's tokens into the scheduler:
the real ones after ``WAIT``, placeholders otherwise, resolved by the next step's ``RESOLVE``).
A bitmask, when some row samples under a grammar, is filled on the host right before the
segment that samples launches. The plans:

    SYNC       RESOLVE, [forward, sample], WAIT, COMMIT
    PIPELINED  [forward, sample], RESOLVE, COMMIT
    SPLIT      [forward], RESOLVE, [sample], COMMIT

``choose_plan`` picks one per step: SYNC without async scheduling (RESOLVE has nothing to do)
and for steps that need the previous tokens on the host before they launch (beam search, whose
candidates the host selects; a grammar step that also wants prompt logprobs, which read the
forward's hidden states and so cannot split); SPLIT for a grammar step under async scheduling
(its bitmask needs the previous step's tokens, so the host fills it while the forward runs);
PIPELINED for every other async step.

Speculative decoding fits in as stages, not as another plan (docs/architecture.md, "The step
pipeline"): a ``propose`` stage before the forward and a ``verify`` stage in place of ``sample``.
"""

from __future__ import annotations

import dataclasses
import time

from jaxpaged.engine.async_scheduling import (
    InFlightStep,
    StepTimes,
    commit_with_placeholders,
    resolve,
)
from jaxpaged.sequence import SequenceStatus
from jaxpaged.worker.model_runner import DeviceStep
from jaxpaged.worker.step_output import ModelRunnerOutput
from jaxpaged.worker.step_program import FORWARD, SAMPLE, WHOLE

RESOLVE = "resolve"
WAIT = "wait"
COMMIT = "commit"


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """How one step walks the pipeline: its actions in order, each a host action (``RESOLVE``,
    ``WAIT``, ``COMMIT``) or a device segment to launch (a tuple of stage names)."""

    name: str
    actions: tuple

    @property
    def segments(self) -> tuple[tuple[str, ...], ...]:
        """The device segments, in launch order."""
        return tuple(a for a in self.actions if isinstance(a, tuple))

    @property
    def waits(self) -> bool:
        """Whether the step reads its own tokens back before it commits (else placeholders)."""
        return WAIT in self.actions

    @property
    def overlaps_resolve(self) -> bool:
        """Whether every segment is launched before the previous step is resolved: the step
        then runs on the device while the host resolves, which ``StepTimes`` measures."""
        last_launch = max(i for i, a in enumerate(self.actions) if isinstance(a, tuple))
        return last_launch < self.actions.index(RESOLVE)


SYNC = StepPlan("sync", (RESOLVE, WHOLE, WAIT, COMMIT))
PIPELINED = StepPlan("pipelined", (WHOLE, RESOLVE, COMMIT))
SPLIT = StepPlan("split", ((FORWARD,), RESOLVE, (SAMPLE,), COMMIT))


def choose_plan(
    *, pipelining: bool, beams: bool, constrained: bool, prompt_logprobs: bool
) -> StepPlan:
    """The plan of one step (module docstring).

    Args:
        pipelining: async scheduling is on, or a step is still in flight from when it was.
        beams: some beam-search row samples in the step.
        constrained: some row samples under a grammar.
        prompt_logprobs: some scheduled request wants prompt logprobs.
    """
    if not pipelining or beams or (constrained and prompt_logprobs):
        return SYNC
    return SPLIT if constrained else PIPELINED


class StepPipeline:
    """Runs engine steps along their plans; holds the step in flight under async scheduling.

    Args:
        scheduler, worker, structured_output, output_processor: the engine's.
        step_history: records what each step scheduled (with ``kv_cache_manager``'s usage).
    """

    def __init__(
        self, scheduler, worker, structured_output, output_processor, step_history, kv_cache_manager
    ):
        self.scheduler = scheduler
        self.worker = worker
        self.structured_output = structured_output
        self.output_processor = output_processor
        self.step_history = step_history
        self.kv_cache_manager = kv_cache_manager
        # Async scheduling: the launched step whose tokens are not yet on the host.
        self.in_flight: InFlightStep | None = None
        # Host-clock marks of the last step that overlapped the resolve (None otherwise).
        self.step_times: StepTimes | None = None

    def step(self, *, async_scheduling: bool, token_deltas: bool) -> list:
        """Schedule one step, walk its plan, and return the outputs that became due (the
        previous step's under async scheduling)."""
        started = time.monotonic()
        self.step_times = None
        scheduler_output = self.scheduler.schedule()
        self.step_history.record(scheduler_output, self.kv_cache_manager.usage)
        scheduled = scheduler_output.scheduled
        constrained = self.structured_output.needs_bitmask(scheduled)
        plan = choose_plan(
            pipelining=async_scheduling or self.in_flight is not None,
            beams=bool(scheduler_output.num_beam_candidates),
            constrained=constrained,
            # Only a grammar step asks (a loop over the rows, kept off the common path).
            prompt_logprobs=constrained
            and any(s.seq.sampling_params.prompt_logprobs is not None for s in scheduled),
        )
        in_flight, self.in_flight = self.in_flight, None
        outputs, step, times, runner_output = [], None, None, None
        for action in plan.actions:
            if action == RESOLVE:
                if in_flight is not None:
                    outputs += self._resolve(in_flight, token_deltas, times)
            elif action == WAIT:
                runner_output = self.worker.collect(step)
            elif action == COMMIT:
                if plan.waits:
                    outputs += self._commit(scheduler_output, runner_output, token_deltas)
                else:
                    self._commit_with_placeholders(scheduler_output, step)
            else:
                step = self._launch(scheduler_output, plan, step, action, constrained)
                if plan.overlaps_resolve and action == plan.segments[-1]:
                    times = StepTimes(started, time.monotonic(), step.out is not None)
        if plan.overlaps_resolve:
            self.step_times = times
        return outputs

    def in_flight_done(self) -> bool | None:
        """Whether the step in flight has computed its tokens (never blocks); None when no
        step is in flight."""
        if self.in_flight is None:
            return None
        return self.worker.is_ready(self.in_flight.step)

    def _launch(self, scheduler_output, plan, step, segment, constrained) -> DeviceStep:
        """Launch ``segment``; the step's first segment moves its blocks and prepares it
        first. The bitmask filler is made right before the segment that samples, after any
        RESOLVE before it (a resolved token may advance or end a grammar)."""
        fill = None
        if constrained and SAMPLE in segment:
            fill = self.structured_output.bitmask_filler(scheduler_output.scheduled)
        if step is None:
            if scheduler_output.is_empty:
                return DeviceStep([])
            self.worker.execute_block_ops(scheduler_output)
            # Known now if the sample is launched with the forward; else it samples under the
            # grammar (all rows allowed if none is left constrained when it launches).
            structured = fill is not None if SAMPLE in segment else constrained
            step = self.worker.prepare(
                scheduler_output, structured=structured, segments=plan.segments
            )
        return self.worker.launch(step, segment, fill_bitmask=fill)

    def _commit_with_placeholders(self, scheduler_output, step: DeviceStep) -> None:
        """Commit a launched step at once, a placeholder for each token it samples; the next
        step's RESOLVE writes the real ones (``engine/async_scheduling.py``)."""
        self.in_flight = commit_with_placeholders(self.scheduler, scheduler_output, step)
        if not step.scheduled and not self.in_flight.updated:
            self.in_flight = None

    def _commit(self, scheduler_output, runner_output: ModelRunnerOutput, token_deltas) -> list:
        # Also commits what finished while scheduling (ignored groups) when nothing ran.
        updated = self.scheduler.update_from_output(
            scheduler_output,
            runner_output.sampled_token_ids,
            runner_output.sampled_logprobs,
            beam_candidates=runner_output.beam_candidates,
        )
        self._update_grammars(updated)
        return self.output_processor.process(
            runner_output, updated, time.monotonic(), token_deltas=token_deltas
        )

    def _resolve(
        self, in_flight: InFlightStep, token_deltas: bool, times: StepTimes | None = None
    ) -> list:
        if times is not None:  # when the step's tokens were ready, and whether we waited
            times.previous_waited = not self.worker.is_ready(in_flight.step)
            self.worker.wait(in_flight.step)
            times.previous_ready = time.monotonic()
        runner_output = self.worker.collect(in_flight.step)
        updated = resolve(self.scheduler, in_flight, runner_output)
        self._update_grammars(updated)
        return self.output_processor.process(
            runner_output, updated, time.monotonic(), token_deltas=token_deltas
        )

    def _update_grammars(self, updated: list) -> None:
        """Feed just-committed tokens to the grammars; abort a sequence whose token the grammar
        rejected (possible only when every token was masked, e.g. min_tokens forbidding the
        EOS a complete grammar requires). A complete grammar allows only EOS, so it stops by
        the usual EOS rule."""
        rejected = self.structured_output.update(updated)
        for seq in rejected:
            self.scheduler.finish_sequence(seq.seq_id, SequenceStatus.FINISHED_ABORTED)
        if rejected:
            self.structured_output.update(rejected)  # drops their state
