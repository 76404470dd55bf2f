"""``RequestOutput`` and ``CompletionOutput``: what ``LLM.generate`` and the engine return.

Field names and meanings follow vLLM's ``vllm/outputs.py``.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a request."""

    index: int
    """Index of this completion among the request's ``n``."""
    text: str
    """Generated text (special tokens skipped unless ``skip_special_tokens=False``)."""
    token_ids: list[int]
    """Generated token ids, including a stop token id that ended generation."""
    cumulative_logprob: float | None = None
    """Sum of the sampled tokens' log-probabilities; None when logprobs were not requested."""
    logprobs: list | None = None
    """Per-step top log-probabilities; None when not requested."""
    finish_reason: str | None = None
    """``stop`` (EOS, stop token or stop string), ``length`` (max_tokens / max_model_len),
    ``abort``, or None while running."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended generation; None for EOS or length."""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """The state of one request after an engine step (or at the end of ``LLM.generate``)."""

    request_id: str
    prompt: str | None
    """The prompt text; None when the prompt was given as token ids."""
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at admission (whole blocks, never the last)."""
    metrics: dict | None = None
    """Timestamps (seconds, ``time.monotonic``): arrival_time, first_token_time, finished_time."""
