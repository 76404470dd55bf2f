"""What the grammar backends (``backend.XGrammarBackend``, ``backend_guidance.GuidanceBackend``)
share: their engine-wide settings, the first-steps probe of a compiled grammar, and the
shortening and cleaning of text for an error message."""

from __future__ import annotations

import json
import re
import threading

import numpy as np

from jaxpaged.param_errors import SamplingParamsError
from jaxpaged.structured_output.bitmask import ALL_ALLOWED, allowed_tokens, num_words

# xgrammar prefixes its messages with the time and its C++ source position
# ("[20:21:15] /project/cpp/json_schema_converter.cc:5082: "), and a failed internal check
# with its condition ("Check failed: (val <= MAX_INT64_AS_DOUBLE) is false: ").
_SOURCE_PREFIX = re.compile(r"\[\d{2}:\d{2}:\d{2}\]\s*\S+\.(?:cc|cpp|h|hpp|cu):\d+:\s*")
_CHECK_PREFIX = re.compile(r"Check failed:.*? is false:\s*")

# ``probe``'s finding for a grammar no text satisfies.
EMPTY_LANGUAGE = "matches no complete text (its matcher allows no token)"


class GrammarBackendBase:
    """The settings every backend keeps.

    Args:
        load_tokenizer: returns the HF tokenizer (called once, on a compile worker).
        vocab_size: the model's vocabulary (logits width; may exceed the tokenizer's).
        stop_token_ids: the only tokens a complete grammar allows (the engine's EOS).
        disable_any_whitespace, disable_additional_properties: engine-wide defaults
            (``StructuredOutputsConfig``), or-ed with each request's own.
    """

    name = ""

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
        self._hf_tokenizer = None
        self._setup_lock = threading.RLock()  # one-time setup on the workers
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.disable_any_whitespace = disable_any_whitespace
        self.disable_additional_properties = disable_additional_properties

    @property
    def hf_tokenizer(self):
        """The HF tokenizer, loaded on first use (on a compile worker)."""
        with self._setup_lock:
            if self._hf_tokenizer is None:
                self._hf_tokenizer = self._load_tokenizer()
        return self._hf_tokenizer

    def probe(self, compiled) -> str | None:
        """What goes wrong in a fresh matcher's first two steps, or None: the first mask
        allows no token at all (the grammar matches no text, e.g. ``root ::= root "a"``), or
        the matcher fails at the first mask or after the lowest allowed token that is not a
        stop token (a backend limit, e.g. llguidance's 2,000 Earley items per row, reached by
        a ``choice`` of 2,000 strings after their common first token). A cheap look ahead, so
        that such grammars are refused when the request is added rather than aborted later;
        later steps can still reach a limit. Runs on the compile thread."""
        matcher = self.matcher(compiled)
        bitmask = np.full((1, num_words(self.vocab_size)), ALL_ALLOWED, np.int32)
        stops = set(self.stop_token_ids or ())
        for _ in range(2):
            self.fill_bitmask([matcher], bitmask, [0])
            error = self.matcher_error(matcher)
            if error:
                return error
            allowed = np.flatnonzero(allowed_tokens(bitmask[0], self.vocab_size))
            if allowed.size == 0:
                return EMPTY_LANGUAGE
            tokens = [int(t) for t in allowed if int(t) not in stops]
            if not tokens or not matcher.accept_token(tokens[0]):
                return self.matcher_error(matcher)
        return None

    def matcher_error(self, matcher) -> str | None:
        """The matcher's error state, if the backend has one (llguidance)."""
        return None


def short(value, limit: int = 200) -> str:
    """A long schema or grammar (a string, or JSON-able) shortened to ``limit`` characters for
    an error message."""
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."


def clean_message(error: BaseException | str) -> str:
    """A backend's error as one line for the user: its first non-empty line, without
    xgrammar's time and C++ source position or a failed check's condition."""
    text = _SOURCE_PREFIX.sub("", str(error))
    text = _CHECK_PREFIX.sub("", text)
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def load_structural_tag(text: str):
    """A request's ``structural_tag`` (JSON text) as its parsed value.

    Raises:
        SamplingParamsError: the text is not JSON (naming ``structural_tag``).
    """
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise SamplingParamsError(
            "structural_tag", short(text), f"is not valid JSON: {error}"
        ) from None
