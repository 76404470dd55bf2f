"""Continuous batching with chunked prefill, swap/recompute preemption and forks (host only; no JAX).

Each step gives every scheduled sequence a range of its tokens to compute:

    |<----------------------------- seq.num_tokens ----------------------------->|
    |<-- num_computed_tokens -->|<-- num_new_tokens -->|<----- not yet -------->|
         K/V already cached        computed this step     later steps (chunked)

When the step computes a sequence's last token (`do_sample`), the model samples one new token for
it, which `update_from_output` appends; that token is the only one the next step has to compute
(a decode). The policy is vLLM v1's unified token budget (docs/architecture.md, "One engine step") over vLLM
v0's sequence groups, which bring swap preemption, parallel sampling and beam search.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
import time
from collections import deque

from jaxpaged.core.beam_search import advance_beams
from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.scheduler_output import ScheduledSequence, SchedulerOutput
from jaxpaged.core.stats import SchedulerStats
from jaxpaged.core.token_plan import is_decoding, num_planned_tokens, plan_tokens
from jaxpaged.sequence import Sequence, SequenceGroup, SequenceStatus, derive_seed

logger = logging.getLogger(__name__)

# How a request gives its blocks back when they run out (None: vLLM's rule, see `_preempt`).
PREEMPTION_MODES = (None, "recompute", "swap")

__all__ = ["PREEMPTION_MODES", "ScheduledSequence", "Scheduler", "SchedulerOutput"]


@dataclasses.dataclass
class _StepSoFar:
    """What ``Scheduler.schedule`` has decided so far in one step, handed from phase to phase."""

    budget: int  # tokens left under max_num_batched_tokens
    num_seats: int  # sequences of the running groups, under max_num_seqs
    scheduled: dict[str, list[ScheduledSequence]] = dataclasses.field(default_factory=dict)
    preempted: list[SequenceGroup] = dataclasses.field(default_factory=list)
    preempted_seq_ids: list[str] = dataclasses.field(default_factory=list)
    loras: set[int] = dataclasses.field(default_factory=set)  # adapters of the running groups


class Scheduler:
    """Decides, between steps, which requests run and how many tokens each of their sequences
    computes.

    `config` is duck-typed (`jaxpaged.config.SchedulerConfig`): `max_num_seqs`,
    `max_num_batched_tokens`, `max_model_len`, and optionally `long_prefill_token_threshold`
    (0 = off: a prefill chunk may take the whole remaining budget) and `preemption_mode`.

    The unit of scheduling is the `SequenceGroup` (one request). Policy per step, one token budget
    `max_num_batched_tokens` for everything and `max_num_seqs` counting sequences:
      1. Running groups, in arrival order, decoding groups first, then prefill chunks, each
         sequence taking `min(uncomputed tokens, remaining budget)` tokens. The sequences of a
         multi-sequence group are kept in step: their prefill stops one token short of the end,
         and they compute their last tokens (and sample) together, all or none. When blocks run
         out, the newest running group is preempted and allocation is retried; if the newest is
         the one being scheduled, it is preempted itself. A newer decode already scheduled this
         step can be the victim of an older prefill chunk: it is taken out of the step again.
      2. Only if nothing was preempted this step: swapped groups, oldest first, come back
         (swap-in) while their blocks fit.
      3. Only if nothing was preempted and nothing is swapped: waiting groups, first come first
         served, reusing their longest cached prefix (prefix caching). A long prompt takes what
         budget is left and continues next step (chunked prefill). If the head of the queue
         cannot get blocks, admission stops and it waits (no skipping ahead).
    Multi-LoRA (`max_loras` > 0): a swapped or waiting group is admitted only if its adapter is
    already running or fewer than `max_loras` adapters run; a waiting group that would exceed
    the limit is skipped (it keeps its place) and later ones may go first, as in vLLM v1.
    Preemption (`preemption_mode`, vLLM v0's rule when None): recompute for single-sequence
    groups (free the blocks; prefill again later, which prefix caching makes cheap), swap for
    multi-sequence ones (copy the blocks to host memory), falling back to recompute when the
    host lacks room.
    """

    def __init__(self, config, kv_cache_manager: KVCacheManager, *, max_loras: int = 0) -> None:
        self.max_num_seqs: int = config.max_num_seqs
        # Multi-LoRA: most distinct adapters among the running groups (so in any step), the
        # engine's device slots; 0 = LoRA off (no limit).
        self.max_loras = max_loras
        self.max_num_batched_tokens: int = config.max_num_batched_tokens
        self.max_model_len: int = config.max_model_len
        self.long_prefill_token_threshold: int = (
            getattr(config, "long_prefill_token_threshold", 0) or 0
        )
        self.preemption_mode: str | None = getattr(config, "preemption_mode", None)
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {list(PREEMPTION_MODES)}, "
                f"got {self.preemption_mode!r}"
            )
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_seqs and max_num_batched_tokens must be at least 1, got "
                f"{self.max_num_seqs} and {self.max_num_batched_tokens}"
            )
        self.kv_cache_manager = kv_cache_manager
        # One sequence at max_model_len must fit in the whole cache, or it could never finish
        # (vLLM refuses to start in that case too).
        needed = kv_cache_manager.num_blocks_needed(self.max_model_len)
        if needed > kv_cache_manager.num_blocks:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) needs {needed} KV blocks of "
                f"{kv_cache_manager.block_size} tokens; the KV cache has only "
                f"{kv_cache_manager.num_blocks}"
            )
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []  # oldest arrival first
        self.requests: dict[str, SequenceGroup] = {}  # unfinished groups by request id
        self._live_seqs: dict[str, Sequence] = {}  # unfinished sequences by id
        self._arrival_order: dict[str, int] = {}
        self._arrivals = itertools.count()
        # Cumulative counters (vllm:num_preemptions, vllm:prefix_cache_queries / _hits).
        self.num_preemptions = 0
        self.num_preemptions_by_mode = {"recompute": 0, "swap": 0}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Sequences of groups that `schedule` ended for lack of room; reported by the next
        # update_from_output so the engine emits their final outputs.
        self._finished_while_scheduling: list[Sequence] = []

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def running_seqs(self) -> list[Sequence]:
        """Unfinished sequences of the running groups (those that may hold device blocks)."""
        return [seq for group in self.running for seq in group.unfinished_seqs]

    def swapped_seqs(self) -> list[Sequence]:
        """Unfinished sequences of the swapped groups (those that may hold host blocks)."""
        return [seq for group in self.swapped for seq in group.unfinished_seqs]

    def add_request(self, request: Sequence | SequenceGroup) -> SequenceGroup:
        """Queue a new request (a group, or a lone sequence wrapped in one) at the back."""
        group = (
            request
            if isinstance(request, SequenceGroup)
            else SequenceGroup(request.seq_id, request)
        )
        if group.request_id in self.requests or group.request_id in self._live_seqs:
            raise ValueError(f"request id {group.request_id!r} is already scheduled")
        seq = group.seqs[0]
        if (
            len(group.seqs) != 1
            or seq.status is not SequenceStatus.WAITING
            or (seq.num_computed_tokens)
        ):
            raise ValueError(f"request {group.request_id!r} is not new: {group!r}")
        if seq.num_tokens > self.max_model_len:
            raise ValueError(
                f"prompt has {seq.num_tokens} tokens; max_model_len is {self.max_model_len}"
            )
        if group.num_seats > self.max_num_seqs:
            raise ValueError(
                f"request {group.request_id!r} needs {group.num_seats} sequences at once "
                f"(best_of / beam_width); max_num_seqs is {self.max_num_seqs}"
            )
        self.requests[group.request_id] = group
        self._live_seqs[seq.seq_id] = seq
        self._arrival_order[group.request_id] = next(self._arrivals)
        self.waiting.append(group)
        return group

    # ---------------------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        """Pick this step's sequences and token counts in the class docstring's three phases:
        running groups, then (only if nothing was preempted) swapped groups, then (only if
        nothing was preempted and nothing is swapped) waiting groups."""
        step = _StepSoFar(
            budget=self.max_num_batched_tokens,
            num_seats=sum(group.num_seats for group in self.running),
        )
        self._schedule_running(step)
        # The adapters of the groups still running after phase 1.
        step.loras = {g.seqs[0].lora_int_id for g in self.running} - {0}
        self._schedule_swapped(step)
        self._schedule_waiting(step)
        return self._scheduler_output(step)

    def _schedule_running(self, step: _StepSoFar) -> None:
        """Phase 1: the running groups, decodes first so that prefill chunks never starve
        them; preempts the newest running group when blocks run out."""
        decoding = [is_decoding(g) for g in self.running]
        order = [g for g, d in zip(self.running, decoding, strict=True) if d]
        order += [g for g, d in zip(self.running, decoding, strict=True) if not d]
        gone: set[str] = set()  # request ids taken off the device during this loop
        for group in order:
            if step.budget == 0:
                break
            if group.request_id in gone:
                continue
            if not group.forked:  # only parallel sampling forks; skip the call otherwise
                self._fork_if_ready(group)
            plan = plan_tokens(group, step.budget, self.long_prefill_token_threshold)
            for seq, num_new in plan:
                self._allocate_or_preempt(step, group, seq, num_new, gone)
                if group.request_id in gone:
                    break
            if group.request_id in gone or not plan:
                # Preempted itself. vLLM v1 ends the pass here because in its arrival order
                # every other running group is older and already visited; with decodes first,
                # older prefill chunks may still be unvisited, so go on.
                continue
            step.scheduled[group.request_id] = [self._scheduled(s, n) for s, n in plan]
            step.budget -= num_planned_tokens(plan)

    def _allocate_or_preempt(
        self, step: _StepSoFar, group: SequenceGroup, seq: Sequence, num_new: int, gone: set
    ) -> None:
        """Blocks for ``num_new`` tokens of ``seq``, preempting the newest running groups until
        they fit (``group`` itself, when it is the newest; it then joins ``gone``)."""
        while not self.kv_cache_manager.allocate_slots(seq, num_new):
            victim = self.running[-1]
            if victim is group and len(self.running) == 1:
                # Alone on the device and still short of blocks: the group can never fit
                # (only multi-sequence groups can outgrow the cache), so end it rather than
                # preempt it forever.
                step.num_seats -= group.num_seats
                self._ignore_group(group)
                self._finished_while_scheduling.extend(group.seqs)
                gone.add(group.request_id)
                return
            undone = step.scheduled.pop(victim.request_id, None)
            if undone is not None:  # a newer decode scheduled before this prefill chunk
                step.budget += sum(item.num_new_tokens for item in undone)
            step.preempted_seq_ids.extend(s.seq_id for s in victim.unfinished_seqs)
            step.num_seats -= victim.num_seats
            self._preempt(victim)
            step.preempted.append(victim)
            gone.add(victim.request_id)
            if victim is group:
                return

    def _schedule_swapped(self, step: _StepSoFar) -> None:
        """Phase 2: swapped groups, oldest first, swapped in while their blocks fit; not after a
        preemption, since the blocks just freed belong to the running groups that needed them."""
        kv = self.kv_cache_manager
        while not step.preempted and self.swapped and step.budget > 0:
            group = self.swapped[0]
            if step.num_seats + group.num_seats > self.max_num_seqs:
                break
            if not self._lora_fits(group, step.loras):
                break
            seqs = group.unfinished_seqs
            # One spare block per sequence lets each decode right away; alone, just fit.
            if not kv.can_swap_in(seqs, len(seqs) if self.running else 0):
                break
            self.swapped.pop(0)
            step.loras.add(group.seqs[0].lora_int_id)
            kv.swap_in(seqs)
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            self.running.append(group)
            step.num_seats += group.num_seats
            self._fork_if_ready(group)
            plan = plan_tokens(group, step.budget, self.long_prefill_token_threshold)
            # All or none: a group in step must not sample with only some of its sequences.
            # Blocks taken before a failure stay with their sequence for the next step.
            if plan and all(kv.allocate_slots(s, n) for s, n in plan):
                step.scheduled[group.request_id] = [self._scheduled(s, n) for s, n in plan]
                step.budget -= sum(n for _, n in plan)

    def _schedule_waiting(self, step: _StepSoFar) -> None:
        """Phase 3: waiting groups, first come first served, each with its cached prefix; only
        if nothing was preempted and nothing is swapped."""
        skipped: list[SequenceGroup] = []  # over the LoRA limit; they keep their places
        while not step.preempted and not self.swapped and self.waiting and step.budget > 0:
            group = self.waiting[0]
            if step.num_seats + group.num_seats > self.max_num_seqs:
                break
            if not self._lora_fits(group, step.loras):
                skipped.append(self.waiting.popleft())
                continue
            items = self._admit(group, step.budget)
            if items is None:
                if self.running:
                    break  # the head waits for blocks; later arrivals do not overtake it
                # Nothing else holds device blocks, so it will never fit (a multi-sequence
                # group re-prefilling after recompute); end it instead of waiting forever.
                self.waiting.popleft()
                self._ignore_group(group, queue_removed=True)
                self._finished_while_scheduling.extend(group.seqs)
                continue
            self.waiting.popleft()
            self.running.append(group)
            step.loras.add(group.seqs[0].lora_int_id)
            step.num_seats += group.num_seats
            step.scheduled[group.request_id] = items
            step.budget -= sum(item.num_new_tokens for item in items)
        self.waiting.extendleft(reversed(skipped))

    def _scheduler_output(self, step: _StepSoFar) -> SchedulerOutput:
        items = [item for group_items in step.scheduled.values() for item in group_items]
        # Stable partition: 1-token decodes first, then prefill chunks (the runner's layout).
        items.sort(key=lambda item: item.seq.is_prefill)
        swap_in, swap_out, copies = self.kv_cache_manager.take_block_ops()
        # Only beam groups count, so the others skip the any() over their items.
        beam_widths = [
            self.requests[rid].beam_width
            for rid, group_items in step.scheduled.items()
            if self.requests[rid].beam_width and any(item.do_sample for item in group_items)
        ]
        return SchedulerOutput(
            scheduled=items,
            num_batched_tokens=sum(item.num_new_tokens for item in items),
            preempted_seq_ids=step.preempted_seq_ids,
            blocks_to_swap_in=swap_in,
            blocks_to_swap_out=swap_out,
            blocks_to_copy=copies,
            num_beam_candidates=2 * max(beam_widths, default=0),
        )

    def lora_adapter_names(self) -> tuple[list[str], list[str]]:
        """Sorted names of the LoRA adapters of the running and of the waiting requests
        (vLLM's ``lora_requests_info`` labels)."""

        def names(groups) -> list[str]:
            # A copy first: metrics read this from another thread while the loop runs.
            requests = (g.seqs[0].lora_request for g in list(groups))
            return sorted({r.lora_name for r in requests if r is not None})

        return names(self.running), names(self.waiting)

    def _lora_fits(self, group: SequenceGroup, loras: set[int]) -> bool:
        """Whether ``group`` may join the running groups, whose adapters are ``loras``, without
        exceeding ``max_loras`` distinct adapters (the base model, id 0, is free)."""
        lora_id = group.seqs[0].lora_int_id
        if not self.max_loras or lora_id == 0 or lora_id in loras:
            return True
        return len(loras - {0}) < self.max_loras

    def _admit(self, group: SequenceGroup, budget: int) -> list[ScheduledSequence] | None:
        """Give a waiting group its cached prefix and first chunk; None (nothing changed) if the
        blocks are not there."""
        kv = self.kv_cache_manager
        seqs = group.unfinished_seqs
        hits = {}
        for seq in seqs:
            blocks, num_hit = kv.get_computed_blocks(seq)
            kv.allocate_slots(seq, 0, blocks)  # takes no new block, so it cannot fail
            seq.num_computed_tokens = num_hit
            seq.status = SequenceStatus.RUNNING
            hits[seq.seq_id] = num_hit
        was_forked = group.forked
        self._fork_if_ready(group)
        plan = plan_tokens(group, budget, self.long_prefill_token_threshold)
        if not plan or not all(kv.allocate_slots(seq, n) for seq, n in plan):
            for seq in group.unfinished_seqs:
                kv.free(seq)
                seq.num_computed_tokens = 0
                seq.status = SequenceStatus.WAITING
            if not was_forked and group.forked:
                self._unfork(group)
            return None
        for seq in seqs:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += hits[seq.seq_id]
        if group.num_cached_tokens is None:
            group.first_scheduled_time = time.monotonic()
            group.num_cached_tokens = hits[group.request_id]
            group.seqs[0].num_cached_tokens = group.num_cached_tokens
        return [self._scheduled(seq, n) for seq, n in plan]

    def _fork_if_ready(self, group: SequenceGroup) -> None:
        """Parallel sampling: once the prompt is computed up to its last token, fork `best_of`
        sequences sharing its blocks; each computes the last token itself and samples with its
        own seed (so the n first tokens differ), copying the shared last block on write."""
        if not group.needs_fork:
            return
        parent = group.seqs[0]
        for index in range(1, group.best_of):
            child = self._fork(group, parent)
            child.sampling_seed = derive_seed(parent.sampling_seed, index)
        group.forked = True

    def _fork(self, group: SequenceGroup, parent: Sequence) -> Sequence:
        child_id = group.new_child_id()
        while child_id in self._live_seqs:  # a user's request id may look like a child id
            child_id = group.new_child_id()
        child = parent.fork(child_id)
        self.kv_cache_manager.fork(parent, child)
        group.seqs.append(child)
        self._live_seqs[child_id] = child
        return child

    def _unfork(self, group: SequenceGroup) -> None:
        """Undo a fork whose children have sampled nothing: keep the prompt's sequence alone."""
        for child in group.seqs[1:]:
            self.kv_cache_manager.free(child)
            del self._live_seqs[child.seq_id]
        del group.seqs[1:]
        group.forked = False

    # ---------------------------------------------------------------------------- commit
    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        sampled_token_ids: dict[str, int],
        sampled_logprobs: dict[str, float] | None = None,
        beam_candidates: dict | None = None,
    ) -> list[Sequence]:
        """Commit a step: advance `num_computed_tokens`, cache full blocks, append sampled tokens,
        finish and free.

        Args:
            sampled_token_ids: the token sampled for each sequence with `do_sample`.
            sampled_logprobs: their log-probabilities, summed into `cumulative_logprob`.
            beam_candidates: for beam-search sequences, `seq_id -> (token_ids, logprobs)` of
                at least `2 * beam_width` best next tokens, best first.

        Stop checks (vLLM's order, on the token just appended): once `min_tokens` outputs exist,
        `eos_token_id` (unless `ignore_eos`) or a `stop_token_ids` hit gives FINISHED_STOPPED
        (`stop_reason` = the stop token id); otherwise `max_tokens` outputs or `max_model_len`
        tokens give FINISHED_LENGTH. Returns the sequences that got a token this step (for beam
        search: the surviving and completed beams), finished or not. Sequences aborted since
        `schedule` are skipped.
        """
        kv = self.kv_cache_manager
        outputs: list[Sequence] = []
        beam_groups: dict[str, SequenceGroup] = {}
        for item in scheduler_output.scheduled:
            seq = item.seq
            if seq.is_finished:
                continue
            if seq.num_computed_tokens != item.num_computed_tokens:
                raise RuntimeError(
                    f"sequence {seq.seq_id!r} changed since it was scheduled: "
                    f"{seq.num_computed_tokens=} {item.num_computed_tokens=}"
                )
            seq.num_computed_tokens += item.num_new_tokens
            kv.cache_full_blocks(seq)
            if not item.do_sample:
                continue
            group = seq.group
            if group.is_beam_search:
                beam_groups[group.request_id] = group
                continue
            if seq.seq_id not in sampled_token_ids:
                raise ValueError(f"no sampled token for sequence {seq.seq_id!r}")
            if sampled_logprobs is not None:
                seq.cumulative_logprob += sampled_logprobs[seq.seq_id]
            seq.append_token(sampled_token_ids[seq.seq_id])
            status = seq.stop_status(self.max_model_len)
            if status is not None:
                self._finish_seq(seq, status)
            outputs.append(seq)
        for group in beam_groups.values():
            outputs.extend(
                advance_beams(
                    group,
                    beam_candidates or {},
                    fork=self._fork,
                    drop=self._drop_beam,
                    finish=self._finish_seq,
                    max_model_len=self.max_model_len,
                )
            )
        # A group can only have finished through a sequence that finished.
        finished = {
            seq.group.request_id for seq in outputs if seq.is_finished and seq.group.is_finished
        }
        if finished:
            self.running = [g for g in self.running if g.request_id not in finished]
            for request_id in finished:
                self._forget(request_id)
        outputs.extend(self._finished_while_scheduling)
        self._finished_while_scheduling = []
        return outputs

    def _drop_beam(self, beam: Sequence) -> None:
        """A beam none of whose continuations survived: freed and forgotten, never reported."""
        self._finish_seq(beam, SequenceStatus.FINISHED_ABORTED)

    # ---------------------------------------------------------------------------- finishing
    def finish_sequence(
        self, seq_id: str, status: SequenceStatus, stop_reason: int | str | None = None
    ) -> Sequence | None:
        """End a sequence from outside (e.g. a stop string found by the detokenizer).

        Frees its blocks (and its group's place in the queues once all its sequences are done);
        returns it, or None if it is unknown or already finished.
        """
        if not status.is_finished:
            raise ValueError(f"status must be a FINISHED_* status, got {status.name}")
        seq = self._live_seqs.get(seq_id)
        if seq is None:
            return None
        if stop_reason is not None:
            seq.stop_reason = stop_reason
        self._finish_seq(seq, status)
        group = seq.group
        if group.is_finished:
            self._remove_from_queue(group)
            self._forget(group.request_id)
        return seq

    def abort(self, request_id: str) -> SequenceGroup | None:
        """Abort a request in any state (waiting, running, swapped, mid-chunked-prefill): every
        unfinished sequence becomes FINISHED_ABORTED and all its device and host blocks are
        freed at once. Returns the group, or None if the id is unknown or finished."""
        group = self.requests.get(request_id)
        if group is None:
            return None
        self._finish_group(group, SequenceStatus.FINISHED_ABORTED)
        return group

    def preempt(self, request_id: str) -> str | None:
        """Take a running request off the device now, between steps (swap or recompute by the
        preemption rule). Returns the mode used, or None if the request is not running."""
        group = self.requests.get(request_id)
        if group is None or group not in self.running:
            return None
        return self._preempt(group)

    def _finish_seq(self, seq: Sequence, status: SequenceStatus) -> None:
        seq.status = status
        self.kv_cache_manager.free(seq)
        self._live_seqs.pop(seq.seq_id, None)

    def _ignore_group(self, group: SequenceGroup, *, queue_removed: bool = False) -> None:
        # vLLM warns when it ignores a request it can never schedule; the output's
        # finish_reason ("length") alone does not say the KV cache was the limit.
        logger.warning(
            "Request %s has %d sequences that need more KV-cache blocks than the %d the cache "
            "holds; it is finished early (finish_reason 'length').",
            group.request_id,
            len(group.unfinished_seqs),
            self.kv_cache_manager.num_blocks,
        )
        self._finish_group(group, SequenceStatus.FINISHED_IGNORED, queue_removed=queue_removed)

    def _finish_group(
        self, group: SequenceGroup, status: SequenceStatus, *, queue_removed: bool = False
    ) -> None:
        for seq in group.unfinished_seqs:
            self._finish_seq(seq, status)
        if not queue_removed:
            self._remove_from_queue(group)
        self._forget(group.request_id)

    def _remove_from_queue(self, group: SequenceGroup) -> None:
        for queue in (self.running, self.waiting, self.swapped):
            if group in queue:
                queue.remove(group)
                return

    def _forget(self, request_id: str) -> None:
        del self.requests[request_id]
        del self._arrival_order[request_id]

    # ---------------------------------------------------------------------------- preemption
    def _preempt(self, group: SequenceGroup) -> str:
        """Take a running group off the device so that older ones can grow; returns the mode.

        Swap keeps the K/V in host blocks and the group resumes where it stopped. Recompute
        frees the blocks and forgets the K/V; the group re-prefills its prompts and generated
        tokens when admitted again (from the prefix cache where its blocks survived), then
        samples its next tokens.
        """
        kv = self.kv_cache_manager
        seqs = group.unfinished_seqs
        mode = self.preemption_mode or ("recompute" if group.num_seats == 1 else "swap")
        if mode == "swap" and not kv.can_swap_out(seqs):
            mode = "recompute"  # vLLM v0 aborts the request here instead
        self.running.remove(group)
        if mode == "swap":
            kv.swap_out(seqs)
            for seq in seqs:
                seq.status = SequenceStatus.SWAPPED
            order = self._arrival_order
            bisect.insort(self.swapped, group, key=lambda g: order[g.request_id])
        else:
            for seq in seqs:
                kv.free(seq)
                seq.num_computed_tokens = 0
                seq.status = SequenceStatus.WAITING
            if group.best_of > 1 and not any(seq.output_token_ids for seq in group.seqs):
                self._unfork(group)  # forked but nothing sampled yet: one prompt to recompute
            # Front of the queue: it arrived before everything still waiting.
            self.waiting.appendleft(group)
        for seq in seqs:
            seq.num_preemptions += 1
        self.num_preemptions += 1
        self.num_preemptions_by_mode[mode] += 1
        return mode

    # ---------------------------------------------------------------------------- helpers
    def _scheduled(self, seq: Sequence, num_new: int) -> ScheduledSequence:
        return ScheduledSequence(
            seq=seq,
            num_computed_tokens=seq.num_computed_tokens,
            num_new_tokens=num_new,
            block_table=self.kv_cache_manager.get_block_table(seq.seq_id),
            do_sample=seq.num_computed_tokens + num_new == seq.num_tokens,
        )

    def get_stats(self) -> SchedulerStats:
        """A snapshot for metrics (see ``SchedulerStats``)."""
        return SchedulerStats.of(self)
