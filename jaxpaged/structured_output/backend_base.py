"""What the grammar backends (``backend.XGrammarBackend``, ``backend_guidance.GuidanceBackend``)
share: their engine-wide settings and the shortening of a spec for an error message."""

from __future__ import annotations

import json


class GrammarBackendBase:
    """The settings every backend keeps.

    Args:
        load_tokenizer: returns the HF tokenizer (called once, on the first ``compile``).
        vocab_size: the model's vocabulary (logits width; may exceed the tokenizer's).
        stop_token_ids: the only tokens a complete grammar allows (the engine's EOS).
        disable_any_whitespace, disable_additional_properties: engine-wide defaults
            (``StructuredOutputsConfig``), or-ed with each request's own.
    """

    def __init__(
        self,
        load_tokenizer,
        *,
        vocab_size: int,
        stop_token_ids: list[int] | None,
        disable_any_whitespace: bool = False,
        disable_additional_properties: bool = False,
    ):
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.disable_any_whitespace = disable_any_whitespace
        self.disable_additional_properties = disable_additional_properties


def short(value, limit: int = 200) -> str:
    """A long schema or grammar (a string, or JSON-able) shortened to ``limit`` characters for
    an error message."""
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."
