"""``SamplingParams``: how one request is sampled, with vLLM's names, defaults and validation.

Semantics follow vLLM's ``vllm/sampling_params.py``. Validation errors are ``SamplingParamsError`` (a ``ValueError``) carrying the parameter
name and value so the HTTP layer can answer 400 naming the field. Checks that need the model
(token ids inside the vocabulary, ``logprobs <= max_logprobs``) are made by the engine when the
request is added.
"""

from __future__ import annotations

import dataclasses
import enum
import json as _json
import math
import reprlib

# vLLM raises temperatures in (0, 0.01) to 0.01 because smaller ones overflow the logits/T in
# half precision; the sampler applies the same floor (see effective_temperature).
_MIN_TEMPERATURE = 1e-2
# vLLM clamps each logit bias to this magnitude (OpenAI's documented range).
_MAX_LOGIT_BIAS = 100.0
_FLOAT32_MAX = 3.4028234663852886e38  # numpy.finfo(numpy.float32).max
MAX_LOGPROB_TOKEN_IDS = 128
"""Most ``logprob_token_ids`` of a request (vLLM's bound, the width of the device rows that hold
them: ``sample.logits_state``)."""
# Accepted spellings of logprobs_mode: vLLM's --logprobs-mode names, and short aliases.
_LOGPROBS_MODES = {
    "raw_logprobs": "raw_logprobs",
    "raw": "raw_logprobs",
    "raw_logits": "raw_logits",
    "processed_logprobs": "processed_logprobs",
    "processed": "processed_logprobs",
    "processed_logits": "processed_logits",
}
# logprobs_mode -> its code in the step (``SamplingMetadata.logprobs_mode``): bit 0 processed
# (after penalties, temperature and filters), bit 1 logits instead of log-probabilities.
LOGPROBS_MODE_CODES = {
    "raw_logprobs": 0,
    "processed_logprobs": 1,
    "raw_logits": 2,
    "processed_logits": 3,
}


class SamplingParamsError(ValueError):
    """A sampling parameter broke its rule; ``parameter`` and ``value`` name the culprit."""

    def __init__(self, parameter: str, value, rule: str):
        self.parameter = parameter
        self.value = value
        super().__init__(f"{parameter} {rule}, got {value!r}")


# The constraint fields of StructuredOutputsParams, in vLLM's order; exactly one is set.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

MAX_STRUCTURED_OUTPUT_JSON_NESTING = 64
"""vLLM's bound on nested objects and arrays in a ``json`` schema: converting a schema to a
grammar costs about the cube of its depth (xgrammar: 0.03 s at depth 50, 1.7 s at 200, about
18 s at 440 on one CPU core), and past Python's recursion limit every JSON walker fails."""
STRUCTURAL_TAG_WRAPPER_NESTING = 16
"""vLLM's extra nesting allowed in a ``structural_tag`` (its wrapping around the schemas)."""
# A deep schema in an error message: three levels, then "...".
_SHORT_REPR = reprlib.Repr(maxlevel=3, maxdict=4, maxlist=4, maxstring=60, maxother=60)


def json_nesting_exceeds(value, limit: int) -> bool:
    """Whether ``value`` (a JSON document, or its text) nests objects and arrays more than
    ``limit`` levels deep. Walks level by level, without recursion; text too deep for
    ``json.loads`` counts as too deep, malformed text as not (the backend reports it)."""
    if isinstance(value, str):
        try:
            value = _json.loads(value)
        except RecursionError:
            return True
        except ValueError:
            return False
    level = [value]
    for _ in range(limit):
        level = [
            child
            for node in level
            for child in (node.values() if isinstance(node, dict) else node)
            if isinstance(child, (dict, list))
        ]
        if not level:
            return False
    return True


@dataclasses.dataclass
class StructuredOutputsParams:
    """Constrained decoding for one request: exactly one constraint field is set (vLLM's
    ``vllm.sampling_params.StructuredOutputsParams``).

    The engine compiles the constraint with its grammar backend (``structured_outputs_config``)
    and masks, at every sampled position, the tokens the grammar does not allow; the request
    finishes with ``stop`` when the grammar is complete (only EOS remains), and with
    ``length`` when ``max_tokens`` ends it mid-structure.

    Raises:
        SamplingParamsError: (a ``ValueError``) naming the field: no constraint or more than
            one, a field of the wrong type, a ``json`` schema nested more than
            ``MAX_STRUCTURED_OUTPUT_JSON_NESTING`` levels (a ``structural_tag`` 16 more), or a
            NUL in ``regex``. A constraint the backend cannot compile (a bad schema, regex or
            grammar, one matching no text, or past a ``structured_outputs_config`` budget) is
            refused by the engine when the request is added, naming the field.
    """

    json: str | dict | None = None
    """A JSON schema (a dict, or its JSON text) the output must validate against."""
    regex: str | None = None
    """A regular expression the whole output must match."""
    choice: list[str] | None = None
    """The output is exactly one of these strings (non-empty list)."""
    grammar: str | None = None
    """A context-free grammar: GBNF-style EBNF (``root ::= ...``) or Lark (a grammar without a
    ``::=`` rule; both backends)."""
    json_object: bool | None = None
    """Any JSON object (OpenAI's ``response_format={"type": "json_object"}``); set to True."""
    disable_any_whitespace: bool = False
    """JSON output without whitespace between tokens (compact JSON)."""
    disable_additional_properties: bool = False
    """JSON objects get no properties beyond those a schema names (treats every object as
    ``"additionalProperties": false`` unless the schema says otherwise)."""
    whitespace_pattern: str | None = None
    """A regex for the whitespace allowed between JSON tokens; None: the backend's default.
    Only the guidance backend honours it; xgrammar refuses it by name."""
    structural_tag: str | None = None
    """An xgrammar/vLLM structural tag as JSON text: free text in which each ``begin`` ...
    ``end`` segment opened by one of ``triggers`` follows its schema."""
    reasoning_end_token_ids: list[int] | None = None
    """(jaxpaged) The constraint starts after the output contains these token ids, the end of
    a thinking model's reasoning (``</think>``); tokens up to and including them are not
    constrained. None: from the first token. The server sets it from --reasoning-parser, as
    vLLM's engine asks its reasoning parser (``is_reasoning_end``)."""
    reasoning_implicit_end_token_ids: list[int] | None = None
    """(jaxpaged) Single tokens that also end the reasoning when one comes before
    ``reasoning_end_token_ids``, and are then the constraint's first token (Qwen3's
    ``<tool_call>``: a call started without closing the thinking). While the reasoning lasts,
    those the constraint cannot start with are masked. vLLM's reasoners' implicit reasoning
    ends (``implicit_reasoning_end_token_ids``); the server sets it with the other."""

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        given = [name for name in STRUCTURED_OUTPUT_KINDS if getattr(self, name) is not None]
        if not given:
            raise SamplingParamsError(
                "structured_outputs",
                None,
                f"must set exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}",
            )
        if len(given) > 1:
            raise SamplingParamsError(
                given[1],
                getattr(self, given[1]),
                f"cannot be combined with {given[0]}: structured_outputs takes exactly one "
                f"constraint",
            )
        self._check_types()

    def _check_types(self) -> None:
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise SamplingParamsError("json", self.json, "must be a JSON schema (dict or str)")
        for name in ("regex", "grammar", "structural_tag", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise SamplingParamsError(name, value, "must be a non-empty string")
        if self.regex is not None and "\x00" in self.regex:
            raise SamplingParamsError("regex", self.regex, "must not contain a NUL character")
        if self.choice is not None and not (
            isinstance(self.choice, list)
            and self.choice
            and all(isinstance(c, str) for c in self.choice)
        ):
            raise SamplingParamsError("choice", self.choice, "must be a non-empty list of strings")
        if self.json_object is not None and self.json_object is not True:
            raise SamplingParamsError("json_object", self.json_object, "must be True when given")
        for name in ("reasoning_end_token_ids", "reasoning_implicit_end_token_ids"):
            ids = getattr(self, name)
            if ids is not None and not (
                isinstance(ids, list)
                and ids
                and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
            ):
                raise SamplingParamsError(
                    name, ids, "must be a non-empty list of token ids (ints >= 0)"
                )
        if self.reasoning_implicit_end_token_ids and not self.reasoning_end_token_ids:
            raise SamplingParamsError(
                "reasoning_implicit_end_token_ids",
                self.reasoning_implicit_end_token_ids,
                "needs reasoning_end_token_ids (the reasoning's own end)",
            )
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(name, getattr(self, name), "must be a boolean")
        self._check_nesting()

    def _check_nesting(self) -> None:
        """vLLM's nesting bound, before any walker recurses into the schema."""
        for name, limit in (
            ("json", MAX_STRUCTURED_OUTPUT_JSON_NESTING),
            ("structural_tag", MAX_STRUCTURED_OUTPUT_JSON_NESTING + STRUCTURAL_TAG_WRAPPER_NESTING),
        ):
            value = getattr(self, name)
            if value is not None and json_nesting_exceeds(value, limit):
                raise SamplingParamsError(
                    name,
                    value[:120] + "..." if isinstance(value, str) else _SHORT_REPR.repr(value),
                    "is nested too deeply: objects and arrays may nest at most "
                    f"{MAX_STRUCTURED_OUTPUT_JSON_NESTING} levels",
                )

    @property
    def kind(self) -> str:
        """The constraint's field name: one of ``STRUCTURED_OUTPUT_KINDS``."""
        return next(n for n in STRUCTURED_OUTPUT_KINDS if getattr(self, n) is not None)

    @property
    def spec(self) -> str:
        """The constraint as text (a schema is serialized as JSON, key order kept: it is the
        order the output's properties take)."""
        value = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, dict):
            return _json.dumps(value, ensure_ascii=False)
        if self.kind == "choice":
            return _json.dumps(value, ensure_ascii=False)
        if self.kind == "json_object":
            return ""
        return value

    @property
    def cache_key(self) -> tuple:
        """What a compiled grammar is cached by: the kind, its text and the JSON options."""
        return (
            self.kind,
            self.spec,
            self.disable_any_whitespace,
            self.disable_additional_properties,
            self.whitespace_pattern,
        )

    def to_wire(self) -> dict:
        """The set fields as a plain dict (for msgpack between processes)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != f.default
        }


class RequestOutputKind(enum.Enum):
    """What each ``RequestOutput`` of a request carries (vLLM's enum)."""

    CUMULATIVE = 0
    """Everything generated so far (text, token ids, logprobs)."""
    DELTA = 1
    """Only what is new since the previous output (server streaming)."""
    FINAL_ONLY = 2
    """One output, when the request finishes (``LLM.generate``)."""


@dataclasses.dataclass
class SamplingParams:
    """Per-request sampling parameters (vLLM semantics).

    Raises:
        SamplingParamsError: (a ``ValueError``) naming the field, the rule and the value.
    """

    n: int = 1
    """Completions to return for the prompt, >= 1; more than 1 needs temperature > 0."""
    best_of: int | None = None
    """Completions to generate, returning the n with the highest cumulative logprob; >= n;
    None means n."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated; [-2, 2], 0 means off."""
    frequency_penalty: float = 0.0
    """Subtracted from each token's logit once per time it was generated; [-2, 2], 0 means off."""
    repetition_penalty: float = 1.0
    """HF-style: logits of tokens in the prompt or the output are divided by it when positive,
    multiplied when negative; > 0, 1 means off."""
    temperature: float = 1.0
    """Softmax temperature, >= 0; 0 means greedy (argmax); (0, 0.01) is raised to 0.01."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p; (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 means off (all tokens)."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's; [0, 1], 0 means off."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens whatever the batch; None or -1: engine's.
    Any 64-bit integer (vLLM's range, [-2**63, 2**64)); a negative one is stored as its unsigned
    64-bit pattern."""
    stop: str | list[str] | None = None
    """Strings that end generation when they appear in the output text (not in it unless
    include_stop_str_in_output); stored as a list; empty strings are rejected."""
    stop_token_ids: list[int] | None = None
    """Token ids that end generation (kept in token_ids, their text left out)."""
    include_stop_str_in_output: bool = False
    """Keep the stop string (or stop token's text) at the end of the output text."""
    ignore_eos: bool = False
    """Keep generating past the EOS token (benchmarks use this)."""
    max_tokens: int | None = 16
    """Most tokens to generate, >= 1; None means up to max_model_len."""
    min_tokens: int = 0
    """Tokens to generate before EOS, stop_token_ids or stop strings may end the request; the
    sampler suppresses EOS and stop_token_ids until then; [0, max_tokens]."""
    logprobs: int | None = None
    """Top log-probabilities to return per generated token, plus the sampled token's; >= 0 and
    at most the engine's max_logprobs; -1 means the whole vocabulary (vLLM's; allowed when
    max_logprobs is -1 or covers the vocabulary); None means none (and cumulative_logprob is
    None)."""
    prompt_logprobs: int | None = None
    """Top log-probabilities to return per prompt token, plus the prompt token's; as
    ``logprobs`` (-1: the whole vocabulary); None means none. Such requests bypass the prefix
    cache."""
    logprob_token_ids: list[int] | None = None
    """vLLM's: token ids whose logprobs (and true ranks) each generated position returns, beside
    the sampled token's, instead of the top ``logprobs``; 1 to ``MAX_LOGPROB_TOKEN_IDS`` ids of
    the vocabulary, whatever the engine's max_logprobs."""
    logprobs_mode: str | None = None
    """What logprobs report: ``raw_logprobs`` (alias ``raw``: float32 log-softmax of the model's
    logits, before penalties, bias, temperature and top-k/top-p/min-p), ``raw_logits``,
    ``processed_logprobs`` (alias ``processed``: the distribution actually sampled from) or
    ``processed_logits``; None means the engine's ``logprobs_mode`` (vLLM's --logprobs-mode,
    default ``raw_logprobs``). Prompt logprobs are always raw log-probabilities."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the decoded text."""
    spaces_between_special_tokens: bool = True
    """Put a space between adjacent special tokens in the text (only when they are not skipped)."""
    logit_bias: dict[int, float] | None = None
    """{token_id: bias} added to the logits before sampling; keys may be int-like strings (the
    OpenAI wire format); each bias is clamped to [-100, 100]."""
    allowed_token_ids: list[int] | None = None
    """Only these token ids may be sampled; None means all; an empty list is rejected."""
    bad_words: list[str] | None = None
    """Words that are never generated. Each word, and its variant with a leading space, must
    tokenize to one token (a multi-token word is refused, where vLLM bans its last token after
    the others); the engine resolves them with its tokenizer (``update_from_tokenizer``)."""
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    """What each RequestOutput carries: CUMULATIVE, DELTA (new text/tokens only) or FINAL_ONLY."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrained decoding (JSON schema, regex, choice, grammar, JSON object or structural
    tag); None means unconstrained. A dict is converted to ``StructuredOutputsParams``."""
    bad_words_token_ids: list[int] | None = dataclasses.field(
        default=None, init=False, repr=False, compare=False
    )
    """The token ids ``bad_words`` ban, set by ``update_from_tokenizer``."""

    def __post_init__(self) -> None:
        if self.seed == -1:
            self.seed = None
        elif isinstance(self.seed, int) and -(2**63) <= self.seed < 0:
            self.seed += 2**64  # vLLM takes any int64; the sampler reads 64 bits
        if self.logprob_token_ids is not None:
            self.logprob_token_ids = list(dict.fromkeys(self.logprob_token_ids))
        if self.top_k == -1:
            self.top_k = 0
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        else:
            self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
        if self.logit_bias is not None:
            self.logit_bias = _normalize_logit_bias(self.logit_bias)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise SamplingParamsError(
                "structured_outputs",
                self.structured_outputs,
                "must be a StructuredOutputsParams (or a dict of its fields)",
            )
        if self.logprobs_mode is not None and self.logprobs_mode not in _LOGPROBS_MODES:
            raise SamplingParamsError(
                "logprobs_mode", self.logprobs_mode, f"must be one of {sorted(_LOGPROBS_MODES)}"
            )
        self.logprobs_mode = _LOGPROBS_MODES.get(self.logprobs_mode)
        self._verify()
        if self.temperature == 0.0:
            # Greedy ignores the filters; resetting them keeps the sampler's rows uniform (vLLM).
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _verify(self) -> None:
        _check_int("n", self.n, minimum=1)
        if self.best_of is not None:
            _check_int("best_of", self.best_of, minimum=1)
            if self.best_of < self.n:
                raise SamplingParamsError(
                    "best_of", self.best_of, f"must be greater than or equal to n ({self.n})"
                )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise SamplingParamsError(name, value, "must be in [-2, 2]")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise SamplingParamsError(
                "repetition_penalty", self.repetition_penalty, "must be a finite number > 0"
            )
        if not math.isfinite(self.temperature) or self.temperature < 0.0:
            raise SamplingParamsError("temperature", self.temperature, "must be non-negative")
        for name in ("temperature", "repetition_penalty"):
            # The sampler divides float32 logits by them: past float32's range they become
            # infinite, and -inf / inf is NaN, which argmax picks over every allowed token.
            if getattr(self, name) > _FLOAT32_MAX:
                raise SamplingParamsError(
                    name,
                    getattr(self, name),
                    f"must be at most {_FLOAT32_MAX:.6g} (float32's range)",
                )
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError("top_p", self.top_p, "must be in (0, 1]")
        _check_int("top_k", self.top_k, minimum=0, rule="must be 0 or -1 (off), or at least 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError("min_p", self.min_p, "must be in [0, 1]")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("min_tokens", self.min_tokens, minimum=0, rule="must be non-negative")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                "min_tokens", self.min_tokens, f"must be at most max_tokens ({self.max_tokens})"
            )
        if self.seed is not None and not (
            isinstance(self.seed, int)
            and not isinstance(self.seed, bool)
            and 0 <= self.seed < 2**64
        ):
            raise SamplingParamsError("seed", self.seed, "must be a 64-bit integer or None")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, minimum=-1, rule="must be non-negative, -1 or None")
        if self.logprob_token_ids is not None:
            if not self.logprob_token_ids:
                raise SamplingParamsError(
                    "logprob_token_ids", self.logprob_token_ids, "must not be empty when given"
                )
            _check_token_ids("logprob_token_ids", self.logprob_token_ids)
            if len(self.logprob_token_ids) > MAX_LOGPROB_TOKEN_IDS:
                raise SamplingParamsError(
                    "logprob_token_ids",
                    len(self.logprob_token_ids),
                    f"holds more ids than max allowed: {MAX_LOGPROB_TOKEN_IDS} (vLLM's bound)",
                )
        if not all(isinstance(s, str) for s in self.stop):
            raise SamplingParamsError("stop", self.stop, "must be a string or a list of strings")
        if any(not s for s in self.stop):
            raise SamplingParamsError("stop", self.stop, "cannot contain an empty string")
        _check_token_ids("stop_token_ids", self.stop_token_ids)
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise SamplingParamsError(
                    "allowed_token_ids", self.allowed_token_ids, "must not be empty when given"
                )
            _check_token_ids("allowed_token_ids", self.allowed_token_ids)
        if self.logit_bias is not None:
            _check_token_ids("logit_bias", list(self.logit_bias))
        if self.bad_words is not None and not all(
            isinstance(w, str) and w.strip() for w in self.bad_words
        ):
            raise SamplingParamsError(
                "bad_words", self.bad_words, "must be a list of non-blank strings"
            )
        if not isinstance(self.output_kind, RequestOutputKind):
            raise SamplingParamsError(
                "output_kind", self.output_kind, "must be a RequestOutputKind"
            )
        if (self.best_of or self.n) > 1 and self.temperature == 0.0:
            # Greedy samples would all be the same sequence (vLLM's rule).
            raise SamplingParamsError(
                "n" if self.best_of is None else "best_of",
                self.best_of or self.n,
                "must be 1 when using greedy sampling (temperature 0)",
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def effective_temperature(self) -> float:
        """The temperature the sampler applies: 0 (greedy) or at least 0.01, as vLLM does."""
        if self.temperature == 0.0:
            return 0.0
        return max(self.temperature, _MIN_TEMPERATURE)

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """True when cached prompt blocks must be recomputed: prompt logprobs need the logits of
        every prompt position (vLLM's fix for prompt logprobs with prefix caching)."""
        return self.prompt_logprobs is not None

    @property
    def uses_logits_state(self) -> bool:
        """True when sampling needs the per-request rows kept on the device (penalties, logit
        bias, allowed ids, min_tokens suppression, or the ids of ``logprob_token_ids``)."""
        return (
            self.logprob_token_ids is not None
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or self.min_tokens > 0
            or bool(self.bad_words)
        )

    def update_from_tokenizer(self, tokenizer) -> None:
        """Resolve ``bad_words`` to ``bad_words_token_ids`` (vLLM's rule: each word stripped of
        leading space, and with one space in front when that tokenizes differently in as many
        tokens; no special tokens added).

        Raises:
            SamplingParamsError: a word that is more than one token, or ``bad_words`` without a
                tokenizer (``skip_tokenizer_init``).
        """
        if not self.bad_words:
            return
        if tokenizer is None:
            raise SamplingParamsError(
                "bad_words", self.bad_words, "needs a tokenizer (the engine has none)"
            )
        banned = []
        for word in self.bad_words:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            variants = [plain]
            if len(spaced) == len(plain) and spaced[:1] != plain[:1]:
                variants.append(spaced)
            for ids in variants:
                if len(ids) != 1:
                    raise SamplingParamsError(
                        "bad_words",
                        word,
                        f"must each be one token; this one is {len(ids)} tokens {ids}",
                    )
                banned.append(ids[0])
        self.bad_words_token_ids = sorted(set(banned))

    @property
    def stop_buffer_length(self) -> int:
        """Characters streaming holds back because they could still become a stop string."""
        if self.stop and not self.include_stop_str_in_output:
            return max(len(s) for s in self.stop) - 1
        return 0


def _check_int(name: str, value, *, minimum: int, rule: str | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise SamplingParamsError(name, value, "must be an integer")
    if value < minimum:
        raise SamplingParamsError(name, value, rule or f"must be at least {minimum}")
    if value >= 2**63:  # JSON allows any integer; engine-core messages carry 64 bits
        raise SamplingParamsError(name, value, "must be below 2**63")


def _check_token_ids(name: str, ids: list) -> None:
    for token_id in ids:
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
            raise SamplingParamsError(name, ids, "must contain only non-negative integer ids")


def _normalize_logit_bias(logit_bias) -> dict[int, float]:
    if not isinstance(logit_bias, dict):
        raise SamplingParamsError("logit_bias", logit_bias, "must be a dict {token_id: bias}")
    bad_keys = []
    for key in logit_bias:
        try:
            int(key)
        except (TypeError, ValueError):
            bad_keys.append(key)
    if bad_keys:  # every bad key named, not only the first
        raise SamplingParamsError(
            "logit_bias",
            bad_keys if len(bad_keys) > 1 else bad_keys[0],
            "keys must be integer token ids (or int-like strings)",
        )
    out = {}
    for key, bias in logit_bias.items():
        token_id = int(key)
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            # vLLM clamps to [-100, 100] (OpenAI's range) and so took Infinity as 100.
            raise SamplingParamsError(
                "logit_bias",
                {key: bias},
                f"values must be finite numbers (those beyond [-{_MAX_LOGIT_BIAS:g}, "
                f"{_MAX_LOGIT_BIAS:g}] are clamped to it)",
            )
        out[token_id] = min(_MAX_LOGIT_BIAS, max(-_MAX_LOGIT_BIAS, float(bias)))
    return out


def verify_for_model(params: SamplingParams, *, vocab_size: int, max_logprobs: int) -> None:
    """The checks that need the model: token ids inside the vocabulary and the logprobs cap.

    Resolves, in place, ``logprobs`` / ``prompt_logprobs`` of -1 to ``vocab_size`` and, with
    ``logprob_token_ids``, an unset ``logprobs`` to 0 (the step then computes logprobs, those
    ids' among them); a second call changes nothing.

    Raises:
        SamplingParamsError: naming the field, the limit and the value.
    """
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value == -1:
            if max_logprobs < vocab_size:
                raise SamplingParamsError(
                    name,
                    value,
                    f"(the whole vocabulary, {vocab_size} tokens) needs the engine's "
                    f"max_logprobs to cover the vocabulary (start it with --max-logprobs -1); "
                    f"it is {max_logprobs}",
                )
            setattr(params, name, vocab_size)
        elif value is not None and value > max_logprobs:
            raise SamplingParamsError(
                name, value, f"must be at most the engine's max_logprobs ({max_logprobs})"
            )
    if params.logprob_token_ids is not None and params.logprobs is None:
        params.logprobs = 0
    checks = {
        "stop_token_ids": params.stop_token_ids,
        "allowed_token_ids": params.allowed_token_ids or [],
        "logit_bias": list(params.logit_bias or {}),
        "bad_words": params.bad_words_token_ids or [],
        "logprob_token_ids": params.logprob_token_ids or [],
    }
    for name, ids in checks.items():
        bad = [t for t in ids if t >= vocab_size]
        if bad:  # every bad id named; "out of vocabulary" as vLLM words it (clients match it)
            raise SamplingParamsError(
                name,
                bad if len(bad) > 1 else bad[0],
                f"has token ids out of vocabulary (they must be below the vocabulary size "
                f"{vocab_size})",
            )
