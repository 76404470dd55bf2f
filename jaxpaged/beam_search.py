"""Beam search's user-facing types, as in vLLM (``vllm.beam_search`` and ``BeamSearchParams``).

``LLM.beam_search(prompts, BeamSearchParams(...))`` returns one ``BeamSearchOutput`` per prompt.
The search runs inside the engine on forked sequences that share KV blocks (copy-on-write); the
selection rule and score are in ``jaxpaged.core.beam_search``.
"""

from __future__ import annotations

import dataclasses
import math

from jaxpaged.param_errors import SamplingParamsError


@dataclasses.dataclass
class BeamSearchParams:
    """Parameters of one beam search (vLLM's ``BeamSearchParams``)."""

    beam_width: int
    """Beams kept after every step, >= 1 (each proposes its 2 * beam_width best next tokens)."""
    max_tokens: int
    """Tokens to generate per beam, >= 1; beams that have not ended with EOS stop here."""
    ignore_eos: bool = False
    """Treat EOS as an ordinary token (beams then always run to max_tokens)."""
    temperature: float = 0.0
    """>= 0; candidates are ranked by log_softmax(logits / temperature); 0 means raw logits."""
    length_penalty: float = 1.0
    """Final ranking by cum_logprob / len ** length_penalty, len = prompt + generated tokens."""
    include_stop_str_in_output: bool = False
    """Accepted for vLLM compatibility; beam search stops on EOS only, never on a stop string."""

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise SamplingParamsError("beam_width", self.beam_width, "must be at least 1")
        if self.max_tokens < 1:
            raise SamplingParamsError("max_tokens", self.max_tokens, "must be at least 1")
        if self.temperature < 0.0:
            raise SamplingParamsError("temperature", self.temperature, "must be non-negative")
        if not math.isfinite(self.length_penalty):
            raise SamplingParamsError("length_penalty", self.length_penalty, "must be finite")


@dataclasses.dataclass
class BeamSearchSequence:
    """One returned beam (vLLM's ``BeamSearchSequence``)."""

    tokens: list[int]
    """Prompt and generated token ids."""
    logprobs: list[dict[int, float]]
    """Per generated token: ``{token_id: logprob}`` of the candidates its parent beam proposed
    at that step (the 2 * beam_width best, the chosen token among them)."""
    cum_logprob: float = 0.0
    """Sum of the chosen tokens' log-probabilities."""
    text: str | None = None
    """The generated text (prompt excluded, a final EOS skipped)."""
    finish_reason: str | None = None
    """``stop`` (EOS) or ``length`` (max_tokens / max_model_len)."""


@dataclasses.dataclass
class BeamSearchOutput:
    """The best ``beam_width`` beams of one prompt, best first (vLLM's ``BeamSearchOutput``)."""

    sequences: list[BeamSearchSequence]
