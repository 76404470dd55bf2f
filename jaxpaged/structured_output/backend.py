"""The grammar library behind structured outputs: xgrammar (vLLM's default backend).

``XGrammarBackend`` checks a request's ``StructuredOutputsParams`` cheaply when it is added
(``precheck``: keywords xgrammar would silently not enforce), turns it into a tokenizer-free
``xgrammar.Grammar`` (``check``) and compiles that against the tokenizer (``compile``); both
run on the compile threads (``compiler.py``), and errors name the constraint field. Matchers:
one ``xgrammar.GrammarMatcher`` per sequence.

What each constraint becomes (vLLM's xgrammar backend does the same, except ``json_object``):

- ``json``: ``Grammar.from_json_schema`` in strict mode (objects take no properties the schema
  does not name, as with xgrammar in vLLM); ``disable_any_whitespace`` gives compact JSON.
  Keywords xgrammar ignores (``multipleOf``, ``uniqueItems``, ``patternProperties`` beside
  ``properties``, several ``allOf`` branches, ...: vLLM 0.34's list,
  ``unsupported_json_feature``) are refused by name, as vLLM refuses them for xgrammar.
- ``regex``: ``Grammar.from_regex``; ``choice``: an EBNF alternation of the JSON-escaped
  strings; ``grammar``: GBNF-style EBNF with a ``root`` rule, or Lark (a grammar with no
  ``::=`` rule, as vLLM tells them apart) through ``Grammar.from_lark``, as vLLM 0.34 does.
- ``json_object``: the schema ``{"type": "object"}`` (OpenAI's JSON mode promises an object;
  vLLM's xgrammar backend allows any JSON value here).
- ``structural_tag``: vLLM's ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``
  form (``Grammar.from_structural_tag`` of the tags and triggers), or xgrammar's own
  structural-tag JSON (any other object).
- ``whitespace_pattern`` is refused by name: xgrammar has no such option.

Error messages keep xgrammar's text without its C++ source position (``clean_message``).
xgrammar imports PyTorch (its ``testing`` module); the engine imports it on the compile thread
at start-up (``StructuredOutputManager``'s warm-up), not on the first constrained request.
"""

from __future__ import annotations

import json
import logging
import os
import re

from jaxpaged.param_errors import SamplingParamsError
from jaxpaged.structured_output.backend_base import (
    GrammarBackendBase,
    clean_message,
    load_structural_tag,
    short,
)
from jaxpaged.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)


def import_xgrammar():
    """The ``xgrammar`` module.

    Raises:
        ValueError: naming ``structured_outputs`` when xgrammar is not installed.
    """
    try:
        import xgrammar
    except ImportError as error:
        raise SamplingParamsError(
            "structured_outputs",
            None,
            f"needs the xgrammar package (pip install xgrammar; it imports torch): {error}",
        ) from None
    return xgrammar


class XGrammarBackend(GrammarBackendBase):
    """Constraint -> grammar -> compiled grammar -> matchers, with xgrammar. Arguments: as
    ``GrammarBackendBase``'s."""

    name = "xgrammar"

    def __init__(self, load_tokenizer, **settings):
        super().__init__(load_tokenizer, **settings)
        self.xgr = import_xgrammar()
        self._compiler = None
        self._batch = None

    def precheck(self, params: StructuredOutputsParams, schema) -> None:
        """The fast checks, on the thread that adds the request. ``schema``: the ``json``
        constraint parsed (None for other kinds).

        Raises:
            SamplingParamsError: ``whitespace_pattern`` (xgrammar has none), or a ``json``
                keyword xgrammar would not enforce, named.
        """
        if params.whitespace_pattern is not None:
            raise SamplingParamsError(
                "whitespace_pattern",
                params.whitespace_pattern,
                "is not supported by the xgrammar backend",
            )
        feature = None if schema is None else unsupported_json_feature(schema)
        if feature is not None:
            raise SamplingParamsError(
                "json",
                short(params.json),
                f"uses {feature}, which the xgrammar backend does not enforce (vLLM refuses it "
                "too); structured_outputs_config.backend 'guidance' supports more of JSON "
                "Schema",
            )

    def check(self, params: StructuredOutputsParams):
        """The tokenizer-free grammar of ``params`` (on the compile thread).

        Raises:
            SamplingParamsError: naming the constraint field (``json``, ``regex``, ...) when the
                backend cannot parse or does not support it.
        """
        kind = params.kind
        try:
            return self._grammar(params)
        except SamplingParamsError:
            raise
        except Exception as error:  # xgrammar raises RuntimeError / ValueError / TypeError
            raise SamplingParamsError(
                kind,
                short(getattr(params, kind)),
                f"cannot be compiled by xgrammar: {clean_message(error)}",
            ) from None

    def _grammar(self, params: StructuredOutputsParams):
        g = self.xgr.Grammar
        kind = params.kind
        any_whitespace = not (params.disable_any_whitespace or self.disable_any_whitespace)
        if kind == "json" or kind == "json_object":
            schema = params.json if kind == "json" else {"type": "object"}
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as error:
                    raise SamplingParamsError(
                        "json", short(params.json), f"is not valid JSON: {error}"
                    ) from None
            if not isinstance(schema, (dict, bool)):
                raise SamplingParamsError(
                    "json", short(params.json), "must be a JSON schema object"
                )
            return g.from_json_schema(
                json.dumps(schema), any_whitespace=any_whitespace, strict_mode=True
            )
        if kind == "regex":
            return g.from_regex(params.regex)
        if kind == "grammar":
            if is_lark(params.grammar):
                return g.from_lark(params.grammar)
            return g.from_ebnf(params.grammar)
        if kind == "choice":
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
            return g.from_ebnf(f"root ::= {alternatives}")
        return self._structural_tag(params.structural_tag)

    def _structural_tag(self, text: str):
        tag = load_structural_tag(text)
        if isinstance(tag, dict) and "structures" in tag:
            items = [
                self.xgr.StructuralTagItem(
                    begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"]
                )
                for s in tag["structures"]
            ]
            return self.xgr.Grammar.from_structural_tag(items, tag["triggers"])
        return self.xgr.Grammar.from_structural_tag(text)

    def compile(self, grammar):
        """``grammar`` compiled against the tokenizer (thread-safe). xgrammar's own cache is
        off: ``compiler.GrammarCompiler`` keeps compiled grammars, bounded by bytes (xgrammar's
        is unbounded by default)."""
        with self._setup_lock:
            if self._compiler is None:
                info = self._tokenizer_info(self.hf_tokenizer)
                # vLLM gives xgrammar 8 threads; they inherit the worker's lower priority.
                threads = max(2, min(8, (os.cpu_count() or 2) // 2))
                self._compiler = self.xgr.GrammarCompiler(
                    info, max_threads=threads, cache_enabled=False
                )
        try:
            return self._compiler.compile_grammar(grammar)
        except Exception as error:
            raise ValueError(f"cannot be compiled by xgrammar: {clean_message(error)}") from None

    @staticmethod
    def nbytes(compiled) -> int:
        """Host memory held by a compiled grammar (xgrammar's own count)."""
        return int(compiled.memory_size_bytes)

    def _tokenizer_info(self, tokenizer):
        """xgrammar's view of the vocabulary, with every special token (BOS, UNK, added special
        tokens, ids past the tokenizer up to ``vocab_size``) as an empty string, which xgrammar
        never allows. ``TokenizerInfo.from_huggingface`` alone keeps their text, so a grammar
        starting with "<" could begin with ``<s>`` (seen on stories260k's SentencePiece
        vocabulary)."""
        detected = self.xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
        )
        encoded = [""] * self.vocab_size
        for token, token_id in tokenizer.get_vocab().items():
            if token_id < self.vocab_size:
                encoded[token_id] = token
        special = set(tokenizer.all_special_ids)
        special |= {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        for token_id in special:
            if token_id < self.vocab_size:
                encoded[token_id] = ""
        return self.xgr.TokenizerInfo(
            encoded,
            detected.vocab_type,
            vocab_size=self.vocab_size,
            stop_token_ids=detected.stop_token_ids,
            add_prefix_space=detected.add_prefix_space,
        )

    def matcher(self, compiled):
        """A fresh matcher at the grammar's start: ``accept_token(id) -> bool``,
        ``is_terminated()``."""
        return self.xgr.GrammarMatcher(compiled)

    def fill_bitmask(self, matchers: list, bitmask, rows: list[int]) -> None:
        """Write each matcher's allowed tokens into ``bitmask`` (i32[B, W] numpy) at its row,
        on xgrammar's threads (one call per step; the GIL is released)."""
        if self._batch is None:
            self._batch = self.xgr.BatchGrammarMatcher(max_threads="auto")
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)

    def accept_tokens(self, matchers: list, tokens: list[int]) -> list[bool]:
        """Advance each matcher by one token; whether each was allowed."""
        return self.xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)


def is_lark(grammar: str) -> bool:
    """Whether ``grammar`` is Lark rather than EBNF: no line (comments dropped) defines a rule
    with ``::=`` (vLLM's rule)."""
    for line in grammar.splitlines():
        line = re.sub(r"(#|//).*$", "", line).strip()
        if "::=" in line:
            return False
    return True


# The string formats xgrammar's JSON-schema converter knows (others would be ignored).
XGRAMMAR_STRING_FORMATS = frozenset(
    {
        "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
        "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
    }
)  # fmt: skip


def unsupported_json_feature(schema) -> str | None:
    """The first keyword (or combination) of ``schema`` that xgrammar 0.2 compiles without
    enforcing, as a phrase for an error message; None when there is none. The list is vLLM
    0.34's (``has_xgrammar_unsupported_json_features`` and its tests): ``multipleOf`` on
    numbers; ``uniqueItems`` / ``contains`` / ``minContains`` / ``maxContains`` on arrays; an
    unknown string ``format``; ``minLength`` / ``maxLength`` beside ``pattern`` or ``format``;
    ``propertyNames`` beside ``patternProperties``, ``properties``, ``unevaluatedProperties``
    or a length-bounded pattern; ``patternProperties`` beside ``properties`` or with several
    patterns; ``allOf`` with two or more branches. ``patternProperties`` alone is enforced.
    Walks without recursion (the schema's nesting is bounded before, but need not be)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(item for item in node if isinstance(item, (dict, list)))
            continue
        if not isinstance(node, dict):
            continue
        phrase = _unsupported_here(node)
        if phrase is not None:
            return phrase
        stack.extend(value for value in node.values() if isinstance(value, (dict, list)))
    return None


def _unsupported_here(node: dict) -> str | None:
    kind = node.get("type")
    types = {kind} if isinstance(kind, str) else {t for t in kind or () if isinstance(t, str)}
    if types & {"integer", "number"} and "multipleOf" in node:
        return "multipleOf"
    if "array" in types:
        for key in ("uniqueItems", "contains", "minContains", "maxContains"):
            if key in node:
                return f"{key} on an array"
    if "string" in types:
        if "format" in node and node["format"] not in XGRAMMAR_STRING_FORMATS:
            return f"string format {node['format']!r}"
        if _bounded_pattern(node):
            return "minLength / maxLength beside pattern or format"
    if "object" in types:
        names = node.get("propertyNames")
        if names is not None:
            if isinstance(names, dict) and _bounded_pattern(names):
                return "propertyNames with minLength / maxLength beside pattern or format"
            for key in ("patternProperties", "properties"):
                if key in node:
                    return f"propertyNames beside {key}"
            if node.get("unevaluatedProperties", True) is not True:
                return "propertyNames beside unevaluatedProperties"
        patterns = node.get("patternProperties")
        if isinstance(patterns, dict):
            if "properties" in node:
                return "patternProperties beside properties"
            if len(patterns) > 1:
                return "patternProperties with several patterns"
    branches = node.get("allOf")
    if isinstance(branches, list) and len(branches) >= 2:
        return "allOf with several branches"
    return None


def _bounded_pattern(node: dict) -> bool:
    return ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node)
