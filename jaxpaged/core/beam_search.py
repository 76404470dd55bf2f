"""Beam search selection: which continuations of a group's beams survive a step (host only).

vLLM's rule (`LLM.beam_search`): every live beam proposes its top `2 * beam_width` next tokens
(twice the width, so that `beam_width` non-EOS continuations exist even if EOS is among every
beam's best). Candidates ending in EOS (unless `ignore_eos`) become completed beams; the others
are ranked and the best `beam_width` continue. Final results are ranked by the length-penalized
score `cumulative_logprob / len ** length_penalty` (Wu et al., 2016, as in vLLM and HF
transformers), where vLLM's `len` counts prompt and generated tokens, minus a final EOS.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC

from jaxpaged.sequence import Sequence, SequenceGroup, SequenceStatus


@dataclasses.dataclass(frozen=True)
class BeamCandidate:
    """One continuation: beam `parent` (an index into the live beams) extended by `token_id`."""

    parent: int
    token_id: int
    logprob: float
    cumulative_logprob: float


def beam_search_score(
    num_tokens: int, cumulative_logprob: float, length_penalty: float, ends_with_eos: bool
) -> float:
    """vLLM's `get_beam_search_score`: `cumulative_logprob / seq_len ** length_penalty`.

    `num_tokens` counts prompt and generated tokens; a final EOS is not counted.
    """
    seq_len = num_tokens - 1 if ends_with_eos else num_tokens
    return cumulative_logprob / (seq_len**length_penalty)


def select_beams(
    cumulative_logprobs: SequenceABC[float],
    candidates: SequenceABC[SequenceABC[tuple[int, float]]],
    *,
    beam_width: int,
    eos_token_id: int | None,
    ignore_eos: bool,
) -> tuple[list[BeamCandidate], list[BeamCandidate]]:
    """Split the live beams' candidates into (completed, continuing).

    Args:
        cumulative_logprobs: each live beam's cumulative log-probability so far.
        candidates: per live beam, its `(token_id, logprob)` proposals, best first; only the
            first `2 * beam_width` are used.

    Returns:
        Every EOS candidate (in beam order), and the best `beam_width` other candidates, best
        first. Live beams all have the same length, so ranking them by cumulative
        log-probability equals ranking by the length-penalized score; the sort is stable, so ties
        keep beam order, then proposal order.
    """
    if len(cumulative_logprobs) != len(candidates):
        raise ValueError(f"{len(cumulative_logprobs)} beams but candidates for {len(candidates)}")
    completed, live = [], []
    for parent, (cumulative, proposals) in enumerate(
        zip(cumulative_logprobs, candidates, strict=True)
    ):
        for token_id, logprob in proposals[: 2 * beam_width]:
            candidate = BeamCandidate(parent, int(token_id), float(logprob), cumulative + logprob)
            if token_id == eos_token_id and not ignore_eos:
                completed.append(candidate)
            else:
                live.append(candidate)
    live.sort(key=lambda candidate: candidate.cumulative_logprob, reverse=True)
    return completed, live[:beam_width]


def advance_beams(
    group: SequenceGroup,
    beam_candidates: dict,
    *,
    fork: Callable[[SequenceGroup, Sequence], Sequence],
    drop: Callable[[Sequence], None],
    finish: Callable[[Sequence, SequenceStatus], None],
    max_model_len: int,
) -> list[Sequence]:
    """One beam-search step of `group`, whose live beams all sampled this step (they run in
    step): keep the best `beam_width` continuations, forking beams that several extend.

    Args:
        beam_candidates: `seq_id -> (token_ids, logprobs)` of each beam's best next tokens.
        fork: the scheduler's fork (a new live sequence sharing the parent's blocks).
        drop: frees a beam with no surviving continuation.
        finish: ends a sequence with a status (max_tokens / max_model_len reached).

    Returns the new live beams, then the beams completed (by EOS) at this step.
    """
    params = group.beam_params
    beams = group.unfinished_seqs
    k = 2 * group.beam_width
    proposals = []
    for beam in beams:
        if beam.seq_id not in beam_candidates:
            raise ValueError(f"no beam candidates for sequence {beam.seq_id!r}")
        token_ids, logprobs = beam_candidates[beam.seq_id]
        proposals.append(list(zip(token_ids[:k], logprobs[:k], strict=True)))
    step_logprobs = [{int(t): float(lp) for t, lp in p} for p in proposals]
    completed, continuing = select_beams(
        [beam.cumulative_logprob for beam in beams],
        proposals,
        beam_width=group.beam_width,
        eos_token_id=beams[0].eos_token_id,
        ignore_eos=params.ignore_eos,
    )
    done = []
    for candidate in completed:  # a finished copy of its parent; it needs no blocks
        beam = beams[candidate.parent].fork(group.new_child_id())
        _extend(beam, candidate, step_logprobs)
        beam.status = SequenceStatus.FINISHED_STOPPED
        done.append(beam)
    group.completed_beams.extend(done)
    # A parent's first continuation (in rank order) extends the parent itself, the others fork
    # it; every fork is made before any parent takes its new token.
    first_rank: dict[int, int] = {}
    for rank, candidate in enumerate(continuing):
        first_rank.setdefault(candidate.parent, rank)
    new_beams = [
        beams[c.parent] if first_rank[c.parent] == rank else fork(group, beams[c.parent])
        for rank, c in enumerate(continuing)
    ]
    for index, beam in enumerate(beams):
        if index not in first_rank:
            drop(beam)
    for beam, candidate in zip(new_beams, continuing, strict=True):
        _extend(beam, candidate, step_logprobs)
    group.seqs = new_beams
    for beam in new_beams:
        at_max_tokens = (
            params.max_tokens is not None and beam.num_output_tokens >= params.max_tokens
        )
        if at_max_tokens or beam.num_tokens >= max_model_len:
            finish(beam, SequenceStatus.FINISHED_LENGTH)
    return new_beams + done


def _extend(beam: Sequence, candidate: BeamCandidate, step_logprobs) -> None:
    beam.append_token(candidate.token_id)
    beam.cumulative_logprob = candidate.cumulative_logprob
    beam.beam_logprobs.append(step_logprobs[candidate.parent])
