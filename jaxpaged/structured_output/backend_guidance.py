"""The guidance backend: llguidance (vLLM's ``guidance``), torch-free.

Same interface as ``backend.XGrammarBackend``. What each constraint becomes (vLLM's guidance
backend does the same):

- ``json`` / ``json_object``: llguidance's JSON-schema grammar; ``disable_any_whitespace`` and
  ``whitespace_pattern`` go in the schema's ``x-guidance`` options; with
  ``disable_additional_properties`` every object without its own ``additionalProperties`` gets
  ``false``.
- ``regex``; ``grammar``: Lark or GBNF (llguidance tells them apart); ``choice``: its list.
- ``structural_tag`` is refused by name.

llguidance stops a matcher as soon as the grammar can go no further (xgrammar waits for EOS),
so a complete ``choice`` or bounded regex ends without an EOS token, with ``finish_reason``
``stop`` as well.
"""

from __future__ import annotations

import copy
import json

from jaxpaged.sampling_params import SamplingParamsError, StructuredOutputsParams
from jaxpaged.structured_output.backend_base import GrammarBackendBase, short


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


class GuidanceBackend(GrammarBackendBase):
    """Constraint -> llguidance grammar -> matchers. Arguments: as ``GrammarBackendBase``'s."""

    name = "guidance"

    def __init__(self, load_tokenizer, **settings):
        super().__init__(load_tokenizer, **settings)
        self.llg = import_llguidance()
        self._tokenizer = None
        self._executor = None

    def check(self, params: StructuredOutputsParams) -> str:
        """The llguidance grammar of ``params`` (validated without the tokenizer).

        Raises:
            SamplingParamsError: naming the constraint field.
        """
        kind = params.kind
        if kind == "structural_tag":
            raise SamplingParamsError(
                "structural_tag", params.structural_tag, "is not supported by the guidance backend"
            )
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
                f"cannot be compiled by llguidance: {error.strip().splitlines()[0]}",
            )
        return grammar

    def _grammar(self, params: StructuredOutputsParams) -> str:
        kind = params.kind
        if kind in ("json", "json_object"):
            schema = params.json if kind == "json" else {"type": "object"}
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as error:
                    raise SamplingParamsError(
                        "json", short(params.json), f"is not valid JSON: {error}"
                    ) from None
            if not isinstance(schema, dict):
                raise SamplingParamsError(
                    "json", short(params.json), "must be a JSON schema object"
                )
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
            return self.llg.grammar_from("json_schema", json.dumps(schema))
        if kind == "regex":
            return self.llg.grammar_from("regex", params.regex)
        if kind == "grammar":
            return self.llg.grammar_from("grammar", params.grammar)
        return self.llg.grammar_from("choice", json.dumps(params.choice))

    def compile(self, grammar: str):
        """The grammar checked against the tokenizer: a first matcher is built (and dropped)
        so that token-level errors surface on the compile thread."""
        if self._tokenizer is None:
            self._tokenizer = self.llg.hf.from_tokenizer(
                self._load_tokenizer(), n_vocab=self.vocab_size, eos_token=self.stop_token_ids
            )
        self.llg.LLMatcher(self._tokenizer, grammar)
        return grammar

    def matcher(self, compiled: str) -> _Matcher:
        return _Matcher(self.llg.LLMatcher(self._tokenizer, compiled))

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
