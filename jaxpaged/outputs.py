"""``RequestOutput`` and ``CompletionOutput``: what ``LLM.generate`` and the engine return.

Field names and meanings follow vLLM's ``vllm/outputs.py``.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Logprob:
    """One token's entry in a logprobs dict (vLLM's ``Logprob``)."""

    logprob: float
    """Natural-log probability; ``-inf`` for a token the processed distribution excludes."""
    rank: int | None = None
    """1 + the number of vocabulary tokens with a strictly higher logprob (the best token is 1)."""
    decoded_token: str | None = None
    """The token's text on its own (``tokenizer.decode([token_id])``, leading space kept)."""


# Per position: {token_id: Logprob} holding the chosen token plus the top-k (k or k+1 entries).
SampleLogprobs = list[dict[int, Logprob]]
# As SampleLogprobs, but the first prompt position has no logprob and holds None.
PromptLogprobs = list[dict[int, Logprob] | None]


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
    """Sum of the sampled tokens' log-probabilities (in the request's logprobs_mode); None when
    logprobs were not requested (vLLM v1)."""
    logprobs: SampleLogprobs | None = None
    """Per generated token, {token_id: Logprob} with the sampled token and the top ``logprobs``;
    None when not requested."""
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
    prompt_logprobs: PromptLogprobs | None = None
    """Per prompt token (first entry None), {token_id: Logprob} with the prompt token and the top
    ``prompt_logprobs``; None when not requested. In DELTA mode only the first output has it."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at admission (whole blocks, never the last)."""
    metrics: dict | None = None
    """Timestamps (seconds, ``time.monotonic``): arrival_time, first_scheduled_time,
    first_token_time, finished_time."""
