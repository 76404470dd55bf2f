"""What one engine step runs: the scheduler's output to the model runner (host only; no JAX)."""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxpaged.sequence import Sequence


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
    """What one step runs. Decodes come first in `scheduled`, then prefill chunks.

    Block moves run before the step, in this order: swap-out, swap-in, copy (see
    `KVCacheManager`).
    """

    scheduled: list[ScheduledSequence]
    num_batched_tokens: int
    # Ids of the sequences of the requests preempted while scheduling this step.
    preempted_seq_ids: list[str] = field(default_factory=list)
    # (host, device), (device, host) and (src, dst) block id pairs.
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Beam search: how many top (token, logprob) candidates each sampled row must return
    # (2 * the widest beam group scheduled); 0 when no beam group samples in this step.
    num_beam_candidates: int = 0

    @property
    def is_empty(self) -> bool:
        """Nothing to run on the device: no tokens and no block moves."""
        return not (
            self.scheduled
            or self.blocks_to_swap_in
            or self.blocks_to_swap_out
            or self.blocks_to_copy
        )
