"""``SamplingParams``: how one request is sampled, with vLLM's names, defaults and validation.

Semantics follow vLLM's ``vllm/sampling_params.py``. Validation errors are
``SamplingParamsError`` (a ``ValueError``) carrying the parameter name and value so the HTTP layer
can answer 400 naming the field.
"""

from __future__ import annotations

import dataclasses

# vLLM raises temperatures in (0, 0.01) to 0.01 because smaller ones overflow the logits/T in
# half precision; the sampler applies the same floor (see effective_temperature).
_MIN_TEMPERATURE = 1e-2


class SamplingParamsError(ValueError):
    """A sampling parameter broke its rule; ``parameter`` and ``value`` name the culprit."""

    def __init__(self, parameter: str, value, rule: str):
        self.parameter = parameter
        self.value = value
        super().__init__(f"{parameter} {rule}, got {value!r}")


@dataclasses.dataclass
class SamplingParams:
    """Per-request sampling parameters (vLLM semantics)."""

    n: int = 1
    """Completions to return, >= 1; more than 1 needs temperature > 0."""
    best_of: int | None = None
    """Completions to generate, >= n (None means n); the n with the highest cumulative logprob
    are returned."""
    temperature: float = 1.0
    """Softmax temperature, >= 0; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p; (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 means off (all tokens)."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's; [0, 1], 0 means off."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens whatever the batch; None or -1: engine's."""
    max_tokens: int | None = 16
    """Most tokens to generate, >= 1; None means up to max_model_len."""
    min_tokens: int = 0
    """Tokens to generate before EOS or stop_token_ids may end the request; <= max_tokens."""
    stop_token_ids: list[int] | None = None
    """Token ids that end generation (kept in token_ids)."""
    ignore_eos: bool = False
    """Keep generating past the EOS token (benchmarks use this)."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the decoded text."""

    def __post_init__(self) -> None:
        if self.seed == -1:
            self.seed = None
        if self.top_k == -1:
            self.top_k = 0
        if self.stop_token_ids is not None:
            self.stop_token_ids = list(self.stop_token_ids)
        self._verify()

    def _verify(self) -> None:
        if self.n < 1:
            raise SamplingParamsError("n", self.n, "must be at least 1")
        if self.best_of is not None and self.best_of < self.n:
            raise SamplingParamsError("best_of", self.best_of, f"must be at least n ({self.n})")
        if (self.best_of or self.n) > 1 and self.temperature == 0.0:
            raise SamplingParamsError(
                "n" if self.best_of is None else "best_of",
                self.best_of or self.n,
                "must be 1 when using greedy sampling (temperature 0)",
            )
        if self.temperature < 0.0:
            raise SamplingParamsError("temperature", self.temperature, "must be non-negative")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError("top_p", self.top_p, "must be in (0, 1]")
        if self.top_k < 0:
            raise SamplingParamsError("top_k", self.top_k, "must be 0 or -1 (off), or at least 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError("min_p", self.min_p, "must be in [0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise SamplingParamsError("max_tokens", self.max_tokens, "must be at least 1")
        if self.min_tokens < 0:
            raise SamplingParamsError("min_tokens", self.min_tokens, "must be non-negative")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                "min_tokens", self.min_tokens, f"must be at most max_tokens ({self.max_tokens})"
            )
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise SamplingParamsError("seed", self.seed, "must be in [0, 2**63) or -1/None")
        if self.stop_token_ids is not None and any(t < 0 for t in self.stop_token_ids):
            raise SamplingParamsError("stop_token_ids", self.stop_token_ids, "must be >= 0")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def effective_temperature(self) -> float:
        """The temperature the sampler applies: 0 (greedy) or at least 0.01, as vLLM does."""
        if self.temperature == 0.0:
            return 0.0
        return max(self.temperature, _MIN_TEMPERATURE)
