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

    ``start_after`` (``StructuredOutputsParams.reasoning_end_token_ids``): the grammar starts
    after the output first contains these ids (a reasoning model's ``</think>``); until then
    the sequence is not ``active``: nothing accepted, and no mask but ``masked_while_reasoning``.
    ``implicit_ends`` (``reasoning_implicit_end_token_ids``): single tokens that end the
    reasoning too when one comes first, and are the grammar's first token (Qwen3's
    ``<tool_call>``). ``start`` is the index of the first constrained output token once found.
    ``masked_while_reasoning``: the implicit ends the grammar cannot start with (the manager
    masks them until the grammar starts, as vLLM does: sampling one would end the reasoning
    on a token the grammar rejects).
    """

    __slots__ = (
        "matcher", "num_accepted", "failed", "start_after", "implicit_ends",
        "masked_while_reasoning", "start", "_scanned",
    )  # fmt: skip

    def __init__(
        self,
        matcher,
        start_after: list[int] | None = None,
        implicit_ends: list[int] | None = None,
        masked_while_reasoning: tuple[int, ...] = (),
    ):
        self.matcher = matcher
        self.num_accepted = 0
        self.failed = False
        self.start_after = tuple(start_after) if start_after else None
        self.implicit_ends = frozenset(implicit_ends or ())
        self.masked_while_reasoning = masked_while_reasoning
        self.start = None if self.start_after else 0
        self._scanned = 0  # output tokens searched for the start (each decided once)

    @property
    def active(self) -> bool:
        """The grammar constrains the next token (the reasoning, if any, has ended)."""
        return self.start is not None

    def _find_start(self, output_token_ids: list[int]) -> None:
        """The first end of the reasoning: the whole marker (the grammar starts after it), or
        an implicit end (the grammar starts at it). A marker still incomplete at the end of
        the output is looked at again next time."""
        marker, n, implicit = self.start_after, len(self.start_after), self.implicit_ends
        end = len(output_token_ids)
        if PLACEHOLDER_TOKEN_ID in output_token_ids[self._scanned :]:  # not resolved yet
            end = output_token_ids.index(PLACEHOLDER_TOKEN_ID, self._scanned)
        for i in range(self._scanned, end):
            token = output_token_ids[i]
            if token in implicit:
                self.start = i
                return
            if token == marker[0] and tuple(output_token_ids[i : i + n]) == marker:
                self.start = i + n
                return
        self._scanned = max(self._scanned, end - n + 1)

    def sync(self, output_token_ids: list[int]) -> None:
        """Accept the output tokens not yet accepted (up to a placeholder)."""
        if self.start is None:
            self._find_start(output_token_ids)
            if self.start is None:
                return
        while self.start + self.num_accepted < len(output_token_ids) and not self.failed:
            token = output_token_ids[self.start + self.num_accepted]
            if token == PLACEHOLDER_TOKEN_ID:
                return
            if self.matcher.is_terminated():
                return  # EOS accepted; nothing may follow
            if not self.matcher.accept_token(token):
                logger.warning("token %d is not allowed by the sequence's grammar", token)
                self.failed = True
                return
            self.num_accepted += 1

    def num_behind(self, output_token_ids: list[int]) -> int:
        """Output tokens not yet accepted (none before the grammar starts)."""
        if self.start is None:
            return 0
        return len(output_token_ids) - self.start - self.num_accepted

    def accepted(self, ok: bool) -> None:
        """Record the outcome of accepting the next token outside ``sync`` (a batched call)."""
        if ok:
            self.num_accepted += 1
        else:
            logger.warning("a token is not allowed by the sequence's grammar")
            self.failed = True

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token accepted."""
        return self.active and self.matcher.is_terminated()
