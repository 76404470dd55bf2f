"""One request's tokens, counters and status (host only; no JAX).

A `Sequence` is what the scheduler queues, the KV cache manager keys block tables by, and the model
runner reads token ids from. Token regions, as vLLM v1 draws them for a `Request`:

    |<------------------------- num_tokens -------------------------->|
    |<------ num_prompt_tokens ------>|<----- num_output_tokens ----->|
    |<-- num_computed_tokens -->|<------- not yet computed ---------->|

`num_computed_tokens` counts the tokens whose K/V sit in the paged cache. Right after a token is
sampled it is the only uncomputed token: the next step feeds it to the model (a decode). Recompute
preemption sets `num_computed_tokens` back to 0, so the prompt *and* the generated tokens are
prefilled again before the next token is sampled.
"""

from __future__ import annotations

import enum
import time


class SequenceStatus(enum.Enum):
    """Lifecycle of a sequence; the three FINISHED_* states are terminal (vLLM's names)."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS


# vLLM's `CompletionOutput.finish_reason` strings.
_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


class Sequence:
    """One request: its prompt, the tokens generated so far and the scheduling counters.

    `sampling_params` is read by duck typing: `max_tokens` (None = up to max_model_len),
    `ignore_eos`, `stop_token_ids` (list or None) and `min_tokens` (0 when absent).

    Invariant: `token_ids == prompt_token_ids + output_token_ids` and
    `0 <= num_computed_tokens <= num_tokens`. All three lists only grow at the end, by
    `append_token`, so they are kept side by side instead of being rebuilt on access.
    """

    def __init__(
        self,
        seq_id: str,
        prompt_token_ids: list[int],
        sampling_params,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"prompt of sequence {seq_id!r} must have at least 1 token, got 0")
        self.seq_id = seq_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        # Prompt + outputs in one list so the model runner can slice any token range cheaply.
        self.token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        # Prefix-cache hit reported in RequestOutput.num_cached_tokens; 0 until prefix caching.
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        # The stop token id (or, set by the engine, the stop string) that ended the sequence.
        self.stop_reason: int | str | None = None
        # Prefix caching must not serve this sequence's prompt from cached blocks: prompt
        # logprobs need the logits of every prompt position (vLLM's skip_reading_prefix_cache).
        self.skip_prefix_cache = bool(getattr(sampling_params, "skip_reading_prefix_cache", False))

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id!r}, status={self.status.name}, "
            f"num_tokens={self.num_tokens}, num_computed_tokens={self.num_computed_tokens})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + output token ids: the live list, not a copy (read it, don't mutate it)."""
        return self.token_ids

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose K/V are not in the cache yet (at least 1 for an unfinished sequence)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True unless the sequence is decoding.

        Decoding means exactly one token lacks K/V and it is a sampled one:
        `num_output_tokens > 0 and num_computed_tokens == num_tokens - 1`. Everything else is a
        prefill: a new prompt (even a 1-token one), a prompt part-way through chunked prefill, or
        a recomputed sequence re-prefilling its prompt and outputs.
        """
        return not self.output_token_ids or self.num_computed_tokens < len(self.token_ids) - 1

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        """vLLM's finish reason once finished: `"stop"`, `"length"` or `"abort"`; else None."""
        return _FINISH_REASONS.get(self.status)

    def append_token(self, token_id: int) -> None:
        """Record a sampled token; its K/V are computed by the next step that schedules it."""
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def replace_last_token(self, token_id: int) -> None:
        """Overwrite the last output token: async scheduling appends a placeholder first and
        learns the sampled id one step later."""
        if not self.output_token_ids:
            raise ValueError(f"sequence {self.seq_id!r} has no output token to replace")
        self.token_ids[-1] = token_id
        self.output_token_ids[-1] = token_id
