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
from collections.abc import Sequence


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
    cumulative_logprobs: Sequence[float],
    candidates: Sequence[Sequence[tuple[int, float]]],
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
