"""The guidance backend: llguidance (vLLM's ``guidance``), torch-free.

Same interface as ``backend.XGrammarBackend``. What each constraint becomes (vLLM's guidance
backend does the same):

- ``json`` / ``json_object``: llguidance's JSON-schema grammar; ``disable_any_whitespace`` and
  ``whitespace_pattern`` go in the schema's ``x-guidance`` options; with
  ``disable_additional_properties`` every object without its own ``additionalProperties`` gets
  ``false``.
- ``regex``; ``grammar``: Lark or GBNF (llguidance tells them apart); ``choice``: its list, at
  most ``MAX_CHOICES`` strings (llguidance's parser holds at most 2,000 items per row: a longer
  list fails after its strings' common first token).
- ``structural_tag``: vLLM's ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``
  form, as vLLM builds it for llguidance: each structure a ``llguidance.StructTag`` opened by
  the first trigger its ``begin`` starts with, free text around them; ``<...>`` triggers are
  matched as special tokens when the tokenizer has them as such (vLLM always assumes so, which
  fails for a tokenizer without them). xgrammar's own structural-tag format is refused by
  name.

"Compiling" builds the first ``LLMatcher`` (llguidance constructs the grammar's lexer then,
off the engine thread); each sequence's matcher is a copy of it (``deep_copy``), cheap on the
engine thread. llguidance stops a matcher as soon as the grammar can go no further (xgrammar
waits for EOS), so a complete ``choice`` or bounded regex ends without an EOS token, with
``finish_reason`` ``stop`` as well.
"""

from __future__ import annotations

import copy
import json

from jaxpaged.param_errors import SamplingParamsError
from jaxpaged.structured_output.backend_base import (
    EMPTY_LANGUAGE,
    GrammarBackendBase,
    clean_message,
    load_structural_tag,
    short,
)
from jaxpaged.structured_output.params import StructuredOutputsParams

# llguidance's ParserLimits.max_items_in_row is 2,000, and an alternation of N strings puts
# N + 1 items in the row after their common first token.
MAX_CHOICES = 1999


def import_llguidance():
    """The ``llguidance`` module.

    Raises:
        ValueError: naming ``structured_outputs_config.backend`` when it is not installed.
    """
    try:
        import llguidance
        import llguidance.hf  # noqa: F401  (submodules the backend calls)
        import llguidance.numpy  # noqa: F401
    except ImportError as error:
        raise ValueError(
            "structured_outputs_config.backend 'guidance' needs the llguidance package "
            f"(pip install llguidance): {error}"
        ) from None
    return llguidance


class _Matcher:
    """An ``LLMatcher`` with the matcher interface ``SequenceGrammar`` uses."""

    __slots__ = ("m",)

    def __init__(self, matcher):
        self.m = matcher

    def accept_token(self, token_id: int) -> bool:
        return bool(self.m.consume_token(token_id)) and not self.m.is_error()

    def is_terminated(self) -> bool:
        return self.m.is_stopped()


class _Compiled:
    """A grammar checked against the tokenizer: its text and a matcher at its start."""

    __slots__ = ("grammar", "start")

    def __init__(self, grammar: str, start):
        self.grammar = grammar
        self.start = start


class GuidanceBackend(GrammarBackendBase):
    """Constraint -> llguidance grammar -> matchers. Arguments: as ``GrammarBackendBase``'s."""

    name = "guidance"

    def __init__(self, load_tokenizer, **settings):
        super().__init__(load_tokenizer, **settings)
        self.llg = import_llguidance()
        self._tokenizer = None
        self._executor = None

    def precheck(self, params: StructuredOutputsParams, schema) -> None:
        """The fast checks (``schema``: unused, as for xgrammar's).

        Raises:
            SamplingParamsError: a ``choice`` of more than ``MAX_CHOICES`` strings.
        """
        if params.choice is not None and len(params.choice) > MAX_CHOICES:
            raise SamplingParamsError(
                "choice",
                short(params.choice),
                f"has {len(params.choice)} strings; the guidance backend takes at most "
                f"{MAX_CHOICES} (llguidance's parser holds 2000 items per row)",
            )

    def check(self, params: StructuredOutputsParams) -> str:
        """The llguidance grammar of ``params`` (validated without the tokenizer).

        Raises:
            SamplingParamsError: naming the constraint field.
        """
        kind = params.kind
        try:
            grammar = self._grammar(params)
            error = self.llg.LLMatcher.validate_grammar(grammar, None)
        except SamplingParamsError:
            raise
        except Exception as exc:  # llguidance raises ValueError / TypeError on bad input
            error = str(exc)
        if error:
            raise SamplingParamsError(
                kind,
                short(getattr(params, kind)),
                f"cannot be compiled by llguidance: {clean_message(error)}",
            )
        return grammar

    def _grammar(self, params: StructuredOutputsParams) -> str:
        kind = params.kind
        if kind in ("json", "json_object"):
            schema = params.json if kind == "json" else {"type": "object"}
            return self.llg.grammar_from("json_schema", json.dumps(self._schema(params, schema)))
        if kind == "regex":
            return self.llg.grammar_from("regex", params.regex)
        if kind == "grammar":
            return self.llg.grammar_from("grammar", params.grammar)
        if kind == "structural_tag":
            return self._structural_tag(params)
        return self.llg.grammar_from("choice", json.dumps(params.choice))

    def _schema(self, params: StructuredOutputsParams, schema) -> dict:
        """``schema`` (a dict or its JSON text) with the request's JSON options applied."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise SamplingParamsError(
                    params.kind, short(schema), f"is not valid JSON: {error}"
                ) from None
        if not isinstance(schema, dict):
            raise SamplingParamsError(params.kind, short(schema), "must be a JSON schema object")
        schema = copy.deepcopy(schema)
        if params.disable_additional_properties or self.disable_additional_properties:
            _close_objects(schema)
        options = dict(schema.get("x-guidance") or {})
        if params.disable_any_whitespace or self.disable_any_whitespace:
            options.update(whitespace_flexible=False, item_separator=",", key_separator=":")
        if params.whitespace_pattern is not None:
            options["whitespace_pattern"] = params.whitespace_pattern
        if options:
            schema["x-guidance"] = options
        return schema

    def _structural_tag(self, params: StructuredOutputsParams) -> str:
        text = params.structural_tag
        tag = load_structural_tag(text)
        if not (isinstance(tag, dict) and "structures" in tag and "triggers" in tag):
            raise SamplingParamsError(
                "structural_tag",
                short(text),
                'must be {"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]} '
                "with the guidance backend (xgrammar's own structural-tag format needs "
                "structured_outputs_config.backend 'xgrammar')",
            )
        triggers, tags = tag["triggers"], []
        for item in tag["structures"]:
            begin = item["begin"]
            trigger = next((t for t in triggers if t and begin.startswith(t)), None)
            if trigger is None:
                raise SamplingParamsError(
                    "structural_tag",
                    short(text),
                    f"has a structure beginning {begin!r} that no trigger in {triggers} starts",
                )
            tags.append(
                self.llg.StructTag(
                    trigger=trigger,
                    begin=begin,
                    grammar=self._schema(params, item["schema"]),
                    end=item["end"],
                )
            )
        if not tags:
            raise SamplingParamsError("structural_tag", short(text), "has no structures")
        # A "<...>" trigger is matched as one special token when the tokenizer has it as such
        # (a model's "<tool_call>"), else as text.
        bracketed = [t for t in triggers if t.startswith("<") and t.endswith(">")]
        special = bool(bracketed) and set(bracketed) <= self._special_texts()
        return self.llg.StructTag.to_grammar(tags, assume_special=special)

    def _special_texts(self) -> set[str]:
        """The text of the tokenizer's special tokens."""
        tokenizer = self.hf_tokenizer
        texts = set(tokenizer.all_special_tokens)
        texts |= {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
        return texts

    def compile(self, grammar: str) -> _Compiled:
        """The grammar built against the tokenizer: its first matcher (llguidance constructs
        the lexer here, with the GIL released).

        Raises:
            ValueError: llguidance's error for the grammar (first line).
        """
        with self._setup_lock:
            if self._tokenizer is None:
                self._tokenizer = self.llg.hf.from_tokenizer(
                    self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.stop_token_ids
                )
        start = self.llg.LLMatcher(self._tokenizer, grammar, log_level=0)
        if start.is_error():
            raise ValueError(
                f"cannot be compiled by llguidance: {clean_message(start.get_error())}"
            )
        return _Compiled(grammar, start)

    @staticmethod
    def nbytes(compiled: _Compiled) -> int:
        """The grammar's text (llguidance does not report its matcher's memory)."""
        return len(compiled.grammar.encode())

    def matcher(self, compiled: _Compiled) -> _Matcher:
        return _Matcher(compiled.start.deep_copy())

    def matcher_error(self, matcher: _Matcher) -> str | None:
        """The matcher's error as a phrase for ``probe``; None when it has none."""
        if not matcher.m.is_error():
            return None
        message = clean_message(matcher.m.get_error())
        if message == "NoExtensionBias":  # llguidance's word for "no token can follow"
            return EMPTY_LANGUAGE
        return f"fails in llguidance's first decoding steps: {message}"

    def fill_bitmask(self, matchers: list, bitmask, rows: list[int]) -> None:
        """Write each matcher's allowed tokens into ``bitmask`` (i32[B, W]) at its row, on
        llguidance's threads."""
        if self._executor is None:
            self._executor = self.llg.LLExecutor()
        pairs = [(m.m, row) for m, row in zip(matchers, rows, strict=True)]
        self.llg.numpy.fill_next_token_bitmask_par(self._executor, pairs, bitmask)

    def accept_tokens(self, matchers: list, tokens: list[int]) -> list[bool]:
        return [m.accept_token(t) for m, t in zip(matchers, tokens, strict=True)]


def _close_objects(schema) -> None:
    """Give every object schema without ``additionalProperties`` the value false."""
    if isinstance(schema, dict):
        if schema.get("type") == "object" or "properties" in schema:
            schema.setdefault("additionalProperties", False)
        for value in schema.values():
            _close_objects(value)
    elif isinstance(schema, list):
        for item in schema:
            _close_objects(item)
