"""One sequence's grammar matcher, kept in step with the sequence's committed output tokens.

The matcher is advanced from ``seq.output_token_ids`` rather than from each step's sampled
token, so every path that changes a sequence's tokens is covered by one rule: recompute
preemption keeps the output tokens (the matcher keeps its state), a forked ``n > 1`` sample
starts its own matcher and catches up on its own tokens, and async scheduling's placeholder
(a negative id, not yet resolved) is never fed.
"""

from __future__ import annotations

import logging

from jaxpaged.sequence import PLACEHOLDER_TOKEN_ID

logger = logging.getLogger(__name__)


class SequenceGrammar:
    """The matcher of one sequence and how many of its output tokens it has accepted.

    ``failed`` is set when a committed token is not one the grammar allows (only possible when
    every token was masked, e.g. ``min_tokens`` forbidding the EOS the grammar requires); the
    engine then ends the sequence.
    """

    __slots__ = ("matcher", "num_accepted", "failed")

    def __init__(self, matcher):
        self.matcher = matcher
        self.num_accepted = 0
        self.failed = False

    def sync(self, output_token_ids: list[int]) -> None:
        """Accept the output tokens not yet accepted (up to a placeholder)."""
        while self.num_accepted < len(output_token_ids) and not self.failed:
            token = output_token_ids[self.num_accepted]
            if token == PLACEHOLDER_TOKEN_ID:
                return
            if self.matcher.is_terminated():
                return  # EOS accepted; nothing may follow
            if not self.matcher.accept_token(token):
                logger.warning("token %d is not allowed by the sequence's grammar", token)
                self.failed = True
                return
            self.num_accepted += 1

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token accepted."""
        return self.matcher.is_terminated()
