"""Which sequences of a request are reported, and in what order (vLLM's `RequestOutput` rules).

- One sample, or `n == best_of` samples: every sequence, in fork order (index 0 is the prompt's
  own sequence, then the children), so that streamed outputs keep their index.
- `best_of > n`: the `n` sequences with the highest cumulative log-probability, best first.
- Beam search: completed and live beams ranked by the length-penalized score
  (`jaxpaged.core.beam_search.beam_search_score`), the best `beam_width`.
"""

from __future__ import annotations

from jaxpaged.core.beam_search import beam_search_score
from jaxpaged.sequence import Sequence, SequenceGroup


def ranked_completions(group: SequenceGroup) -> list[Sequence]:
    """The sequences to report for `group`, in output order (their position is the index)."""
    if group.is_beam_search:
        params = group.beam_params
        # vLLM ranks completed beams, then live ones; the stable sort keeps that order on ties.
        beams = [*group.completed_beams, *group.seqs]
        return sorted(beams, key=lambda seq: _beam_score(seq, params), reverse=True)[
            : group.beam_width
        ]
    n = getattr(group.sampling_params, "n", 1)
    if len(group.seqs) <= n:
        return list(group.seqs)
    return sorted(group.seqs, key=lambda seq: seq.cumulative_logprob, reverse=True)[:n]


def _beam_score(seq: Sequence, params) -> float:
    ends_with_eos = (
        bool(seq.output_token_ids)
        and seq.output_token_ids[-1] == seq.eos_token_id
        and not params.ignore_eos
    )
    return beam_search_score(
        seq.num_tokens, seq.cumulative_logprob, params.length_penalty, ends_with_eos
    )
