"""Continuous batching with chunked prefill and recompute preemption (host only; no JAX).

Each step gives every scheduled sequence a range of its tokens to compute:

    |<----------------------------- seq.num_tokens ----------------------------->|
    |<-- num_computed_tokens -->|<-- num_new_tokens -->|<----- not yet -------->|
         K/V already cached        computed this step     later steps (chunked)

When the step computes a sequence's last token (`do_sample`), the model samples one new token for
it, which `update_from_output` appends; that token is the only one the next step has to compute
(a decode). The policy is vLLM v1's unified token budget (DESIGN.md section 2, step 1).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    """One sequence's share of a step: tokens `num_computed_tokens .. + num_new_tokens - 1`."""

    seq: Sequence
    num_computed_tokens: int
    num_new_tokens: int
    # The manager's live table: it covers num_computed_tokens + num_new_tokens tokens and is only
    # ever appended to while the sequence holds it, so it is shared rather than copied per step.
    block_table: list[int]
    # True iff this step computes all of the sequence's tokens, so a token is sampled for it.
    do_sample: bool


@dataclass
class SchedulerOutput:
    """What one step runs. Decodes come first in `scheduled`, then prefill chunks."""

    scheduled: list[ScheduledSequence]
    num_batched_tokens: int
    preempted_seq_ids: list[str] = field(default_factory=list)
    # (src, dst) block pairs for swap preemption and copy-on-write; empty until those land.
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """Nothing to run on the device: no tokens and no block moves."""
        return not (
            self.scheduled
            or self.blocks_to_swap_in
            or self.blocks_to_swap_out
            or self.blocks_to_copy
        )


class Scheduler:
    """Decides, between steps, which sequences run and how many of their tokens each computes.

    `config` is duck-typed (`jaxpaged.config.SchedulerConfig`): `max_num_seqs`,
    `max_num_batched_tokens`, `max_model_len` and optionally `long_prefill_token_threshold`
    (0 = off: a prefill chunk may take the whole remaining budget).

    Policy per step (vLLM v1 style, one token budget `max_num_batched_tokens` for everything):
      1. Running sequences, in arrival order, decodes (1 token each) first, then continuing
         prefill chunks, each taking `min(uncomputed tokens, remaining budget)` tokens. When
         blocks run out, the newest running sequence is preempted by recompute (blocks freed,
         back to the front of the waiting queue) and allocation is retried; if the newest is the
         one being scheduled, it is preempted itself. A newer decode already scheduled this step
         can be the victim of an older prefill chunk: it is taken out of the step again.
      2. Only if nothing was preempted this step: waiting sequences, first come first served,
         while fewer than `max_num_seqs` run and budget remains. A long prompt takes what budget
         is left and continues next step (chunked prefill). If the head of the queue cannot get
         blocks, admission stops and it waits (no skipping ahead).
    `running` stays in arrival order: admission appends in queue order, and preemption pops the
    newest and pushes it back to the front of the queue.
    """

    def __init__(self, config, kv_cache_manager: KVCacheManager) -> None:
        self.max_num_seqs: int = config.max_num_seqs
        self.max_num_batched_tokens: int = config.max_num_batched_tokens
        self.max_model_len: int = config.max_model_len
        self.long_prefill_token_threshold: int = (
            getattr(config, "long_prefill_token_threshold", 0) or 0
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
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}  # unfinished sequences by id
        self.num_preemptions = 0  # cumulative (vllm:num_preemptions_total)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def add_request(self, seq: Sequence) -> None:
        """Queue a new sequence at the back of the waiting queue."""
        if seq.seq_id in self.requests:
            raise ValueError(f"sequence id {seq.seq_id!r} is already scheduled")
        if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens:
            raise ValueError(f"sequence {seq.seq_id!r} is not new: {seq!r}")
        if seq.num_tokens > self.max_model_len:
            raise ValueError(
                f"prompt has {seq.num_tokens} tokens; max_model_len is {self.max_model_len}"
            )
        self.requests[seq.seq_id] = seq
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's sequences and token counts; see the class docstring for the policy."""
        budget = self.max_num_batched_tokens
        scheduled: dict[str, ScheduledSequence] = {}
        preempted: list[Sequence] = []

        # 1. Running sequences: decodes first so that they are never starved by prefill chunks.
        decodes = [seq for seq in self.running if not seq.is_prefill]
        prefills = [seq for seq in self.running if seq.is_prefill]
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._num_new_tokens(seq, budget)
            while not self.kv_cache_manager.allocate_slots(seq, num_new):
                victim = self.running[-1]
                undone = scheduled.pop(victim.seq_id, None)
                if undone is not None:  # a newer decode scheduled before this prefill chunk
                    budget += undone.num_new_tokens
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                # It was the newest and preempted itself. vLLM v1 ends the pass here because in
                # its arrival order every other running sequence is older and already visited;
                # with decodes first, older prefill chunks may still be unvisited, so go on.
                continue
            scheduled[seq.seq_id] = self._scheduled(seq, num_new)
            budget -= num_new

        # 2. Waiting sequences, first come first served; not after a preemption, since the
        #    blocks just freed belong to the running sequences that needed them.
        while not preempted and self.waiting and budget > 0:
            if len(self.running) >= self.max_num_seqs:
                break
            seq = self.waiting[0]
            num_new = self._num_new_tokens(seq, budget)
            if not self.kv_cache_manager.allocate_slots(seq, num_new):
                break  # the head waits for blocks; later arrivals do not overtake it
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled[seq.seq_id] = self._scheduled(seq, num_new)
            budget -= num_new

        items = list(scheduled.values())
        # Stable partition: 1-token decodes first, then prefill chunks (the runner's layout).
        items.sort(key=lambda item: item.seq.is_prefill)
        return SchedulerOutput(
            scheduled=items,
            num_batched_tokens=sum(item.num_new_tokens for item in items),
            preempted_seq_ids=[seq.seq_id for seq in preempted],
        )

    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled_token_ids: dict[str, int]
    ) -> list[Sequence]:
        """Commit a step: advance `num_computed_tokens`, append sampled tokens, finish and free.

        Stop checks (vLLM's order, on the token just appended): once `min_tokens` outputs exist,
        `eos_token_id` (unless `ignore_eos`) or a `stop_token_ids` hit gives FINISHED_STOPPED
        (`stop_reason` = the stop token id); otherwise `max_tokens` outputs or `max_model_len`
        tokens give FINISHED_LENGTH. Returns the sequences that got a token this step, finished
        or not. Sequences aborted since `schedule` are skipped.
        """
        outputs: list[Sequence] = []
        any_finished = False
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
            if not item.do_sample:
                continue
            if seq.seq_id not in sampled_token_ids:
                raise ValueError(f"no sampled token for sequence {seq.seq_id!r}")
            seq.append_token(sampled_token_ids[seq.seq_id])
            status = self._check_stop(seq)
            if status is not None:
                self._finish(seq, status)
                any_finished = True
            outputs.append(seq)
        if any_finished:
            self.running = [seq for seq in self.running if not seq.is_finished]
        return outputs

    def finish_sequence(
        self, seq_id: str, status: SequenceStatus, stop_reason: int | str | None = None
    ) -> Sequence | None:
        """End a sequence from outside (e.g. a stop string found by the detokenizer).

        Frees its blocks; returns it, or None if it is unknown or already finished.
        """
        if not status.is_finished:
            raise ValueError(f"status must be a FINISHED_* status, got {status.name}")
        seq = self.requests.get(seq_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        if stop_reason is not None:
            seq.stop_reason = stop_reason
        self._finish(seq, status)
        return seq

    def abort(self, seq_id: str) -> Sequence | None:
        """Abort a waiting or running sequence (FINISHED_ABORTED, blocks freed); None if unknown."""
        return self.finish_sequence(seq_id, SequenceStatus.FINISHED_ABORTED)

    def _num_new_tokens(self, seq: Sequence, budget: int) -> int:
        num_new = min(seq.num_uncomputed_tokens, budget)
        if 0 < self.long_prefill_token_threshold < num_new:
            # Cap one prefill's share of a step so that concurrent prompts interleave (vLLM).
            num_new = self.long_prefill_token_threshold
        return num_new

    def _scheduled(self, seq: Sequence, num_new: int) -> ScheduledSequence:
        return ScheduledSequence(
            seq=seq,
            num_computed_tokens=seq.num_computed_tokens,
            num_new_tokens=num_new,
            block_table=self.kv_cache_manager.get_block_table(seq.seq_id),
            do_sample=seq.num_computed_tokens + num_new == seq.num_tokens,
        )

    def _preempt(self, seq: Sequence, mode: str = "recompute") -> None:
        """Take a running sequence off the device so that older ones can grow.

        Recompute (vLLM v1's only mode): free its blocks and forget its K/V; it re-prefills its
        prompt and generated tokens when admitted again, then samples its next token. Swap mode
        (copy its blocks to host memory) is the later extension of this method.
        """
        if mode != "recompute":
            raise ValueError(f"preemption mode must be 'recompute', got {mode!r}")
        self.running.remove(seq)
        self.kv_cache_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        # Front of the queue: it arrived before everything still waiting.
        self.waiting.appendleft(seq)

    def check_stop(self, seq: Sequence) -> SequenceStatus | None:
        """The stop rule of `update_from_output` on `seq`'s last token, without acting on it
        (async scheduling re-checks once a placeholder token is replaced by the sampled one)."""
        return self._check_stop(seq)

    def _check_stop(self, seq: Sequence) -> SequenceStatus | None:
        params = seq.sampling_params
        last = seq.last_token_id
        # EOS and stop tokens only count after min_tokens (the sampler masks them before that).
        if seq.num_output_tokens >= (getattr(params, "min_tokens", 0) or 0):
            if not params.ignore_eos and last == seq.eos_token_id:
                return SequenceStatus.FINISHED_STOPPED
            if params.stop_token_ids and last in params.stop_token_ids:
                seq.stop_reason = last
                return SequenceStatus.FINISHED_STOPPED
        max_tokens = params.max_tokens
        if max_tokens is not None and seq.num_output_tokens >= max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        if seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        # The caller removes seq from `running`/`waiting` (in bulk where it can).
        seq.status = status
        self.kv_cache_manager.free(seq)
        del self.requests[seq.seq_id]
