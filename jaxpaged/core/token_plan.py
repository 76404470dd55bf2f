"""How many tokens each sequence of a group computes in one step (host only; no JAX).

Pure functions of a group, the step's remaining token budget and the long-prefill cap; the
scheduler (``core/scheduler.py``) calls them while it walks its three phases.
"""

from __future__ import annotations

from jaxpaged.sequence import Sequence, SequenceGroup


def plan_tokens(
    group: SequenceGroup, budget: int, long_prefill_token_threshold: int = 0
) -> list[tuple[Sequence, int]]:
    """(sequence, tokens to compute) for this step; empty when the group waits this step."""
    seqs = group.unfinished_seqs
    if not group.forked:
        # Parallel sampling computes the prompt once, up to its last token, then forks.
        parent = seqs[0]
        room = parent.num_prompt_tokens - 1 - parent.num_computed_tokens
        num_new = min(num_new_tokens(parent, budget, long_prefill_token_threshold), room)
        return [(parent, num_new)] if num_new > 0 else []
    if len(seqs) == 1:
        num_new = num_new_tokens(seqs[0], budget, long_prefill_token_threshold)
        return [(seqs[0], num_new)] if num_new > 0 else []
    if all(seq.num_uncomputed_tokens == 1 for seq in seqs):
        # In step: every sequence computes its last token and samples, or none does.
        return [(seq, 1) for seq in seqs] if budget >= len(seqs) else []
    plan = []
    for seq in seqs:  # catching up after recompute: prefill all but the last token
        num_new = min(
            num_new_tokens(seq, budget, long_prefill_token_threshold), seq.num_uncomputed_tokens - 1
        )
        if num_new > 0:
            plan.append((seq, num_new))
            budget -= num_new
            if budget == 0:
                break
    return plan


def num_new_tokens(seq: Sequence, budget: int, long_prefill_token_threshold: int = 0) -> int:
    """Tokens ``seq`` computes with ``budget`` left: all it has not computed, within the budget
    and, for a long prefill, ``long_prefill_token_threshold`` (0: no cap)."""
    num_new = min(seq.num_uncomputed_tokens, budget)
    if 0 < long_prefill_token_threshold < num_new:
        # Cap one prefill's share of a step so that concurrent prompts interleave (vLLM).
        num_new = long_prefill_token_threshold
    return num_new


def is_decoding(group: SequenceGroup) -> bool:
    """Every unfinished sequence of the group is decoding (true of a group with none)."""
    seqs = group.seqs
    if len(seqs) == 1:  # the common case, without the generator
        seq = seqs[0]
        return seq.is_finished or not seq.is_prefill
    return all(not seq.is_prefill for seq in group.unfinished_seqs)


def num_planned_tokens(plan: list[tuple[Sequence, int]]) -> int:
    """Tokens a ``plan_tokens`` plan computes."""
    if len(plan) == 1:  # the common case, without the generator
        return plan[0][1]
    return sum(n for _, n in plan)
