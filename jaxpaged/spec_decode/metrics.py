"""Speculative-decoding counters with vLLM's names, and its acceptance log line (host only).

vLLM 0.34 (``vllm/v1/spec_decode/metrics.py``): per request that had drafts in a step, the
scheduler counts one draft, its number of draft tokens, its accepted tokens (emitted - 1) and,
for each position ``i`` below the accepted count, one accepted token at position ``i``. The
Prometheus counters (``jaxpaged.metrics``) are ``<prefix>:spec_decode_num_drafts``,
``..._num_draft_tokens``, ``..._num_accepted_tokens`` and ``..._num_accepted_tokens_per_pos``
(label ``position`` = 0 .. K-1), exported with ``_total``. Derived figures: acceptance rate =
accepted / draft tokens; mean acceptance length = 1 + accepted / drafts (the bonus token
included, vLLM's convention); per-position acceptance = accepted at i / drafts.

The counters here are cumulative since start-up, like ``SchedulerStats``' counters: a reader
keeps the last value it saw and takes differences (:meth:`SpecDecodingStats.since`).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SpecDecodingStats:
    """Cumulative counts over every verify step so far (vLLM's ``SpecDecodingStats``, kept
    cumulative). ``num_spec_tokens`` is K, the length of the per-position lists."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = dataclasses.field(default_factory=list)
    num_draft_tokens_per_pos: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        k = self.num_spec_tokens
        self.num_accepted_tokens_per_pos = list(self.num_accepted_tokens_per_pos or [0] * k)
        self.num_draft_tokens_per_pos = list(self.num_draft_tokens_per_pos or [0] * k)
        if len(self.num_accepted_tokens_per_pos) != k or len(self.num_draft_tokens_per_pos) != k:
            raise ValueError(f"per-position lists must have num_spec_tokens = {k} entries")

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Count one request's verify step: ``num_draft_tokens`` drafted (0 counts nothing: a
        request without drafts that step is no draft), ``num_accepted_tokens`` of them
        accepted (its emitted tokens minus the recovered / bonus one).

        Raises:
            ValueError: more accepted than drafted, or more drafted than K.
        """
        if num_draft_tokens == 0:
            return
        if not 0 <= num_accepted_tokens <= num_draft_tokens <= self.num_spec_tokens:
            raise ValueError(
                f"need 0 <= accepted ({num_accepted_tokens}) <= drafted ({num_draft_tokens}) "
                f"<= num_spec_tokens ({self.num_spec_tokens})"
            )
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1
        for i in range(num_draft_tokens):
            self.num_draft_tokens_per_pos[i] += 1

    def since(self, earlier: SpecDecodingStats | None) -> SpecDecodingStats:
        """The counts added after ``earlier`` (a copy taken from this object); None: all."""
        if earlier is None:
            return dataclasses.replace(self)
        return SpecDecodingStats(
            self.num_spec_tokens,
            self.num_drafts - earlier.num_drafts,
            self.num_draft_tokens - earlier.num_draft_tokens,
            self.num_accepted_tokens - earlier.num_accepted_tokens,
            [a - b for a, b in zip(self.num_accepted_tokens_per_pos,
                                   earlier.num_accepted_tokens_per_pos, strict=True)],
            [a - b for a, b in zip(self.num_draft_tokens_per_pos,
                                   earlier.num_draft_tokens_per_pos, strict=True)],
        )  # fmt: skip

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens, in [0, 1]; NaN before any draft."""
        if not self.num_draft_tokens:
            return float("nan")
        return self.num_accepted_tokens / self.num_draft_tokens

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify step with drafts: 1 + accepted / drafts (bonus included);
        NaN before any draft."""
        if not self.num_drafts:
            return float("nan")
        return 1.0 + self.num_accepted_tokens / self.num_drafts

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        """Per position ``i``: the fraction of drafts whose first ``i + 1`` tokens were all
        accepted (vLLM's per-position rate); NaN before any draft."""
        if not self.num_drafts:
            return [float("nan")] * self.num_spec_tokens
        return [n / self.num_drafts for n in self.num_accepted_tokens_per_pos]

    def log_line(self, elapsed_s: float) -> str:
        """vLLM's ``SpecDecoding metrics:`` line for these counts over ``elapsed_s`` seconds
        (use :meth:`since` for an interval's counts)."""
        per_s = 1.0 / elapsed_s if elapsed_s > 0 else 0.0
        rates = ", ".join(f"{r:.3f}" for r in self.acceptance_rate_per_pos)
        return (
            f"SpecDecoding metrics: Mean acceptance length: {self.mean_acceptance_length:.2f}, "
            f"Accepted throughput: {self.num_accepted_tokens * per_s:.2f} tokens/s, "
            f"Drafted throughput: {self.num_draft_tokens * per_s:.2f} tokens/s, "
            f"Accepted: {self.num_accepted_tokens} tokens, "
            f"Drafted: {self.num_draft_tokens} tokens, "
            f"Per-position acceptance rate: {rates}, "
            f"Avg Draft acceptance rate: {100 * self.acceptance_rate:.1f}%"
        )

    def to_wire(self) -> list:
        """A msgpack-friendly list (engine core -> API process)."""
        return [
            self.num_spec_tokens, self.num_drafts, self.num_draft_tokens,
            self.num_accepted_tokens, self.num_accepted_tokens_per_pos,
            self.num_draft_tokens_per_pos,
        ]  # fmt: skip

    @classmethod
    def from_wire(cls, wire: list) -> SpecDecodingStats:
        return cls(*wire)
