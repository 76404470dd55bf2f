"""The grammar library behind structured outputs: xgrammar (vLLM's default backend).

``XGrammarBackend`` turns a request's ``StructuredOutputsParams`` into a tokenizer-free
``xgrammar.Grammar`` (``check``: fast, on the thread that adds the request, so a bad schema,
regex or grammar is refused there, naming the field), compiles it against the tokenizer
(``compile``: slow for large vocabularies, run on the compiler's thread pool) and makes one
``xgrammar.GrammarMatcher`` per sequence.

What each constraint becomes (vLLM's xgrammar backend does the same, except ``json_object``):

- ``json``: ``Grammar.from_json_schema`` in strict mode (objects take no properties the schema
  does not name, as with xgrammar in vLLM); ``disable_any_whitespace`` gives compact JSON.
- ``regex``: ``Grammar.from_regex``; ``grammar``: ``Grammar.from_ebnf`` (GBNF-style EBNF with
  a ``root`` rule); ``choice``: an EBNF alternation of the JSON-escaped strings.
- ``json_object``: the schema ``{"type": "object"}`` (OpenAI's JSON mode promises an object;
  vLLM's xgrammar backend allows any JSON value here).
- ``structural_tag``: vLLM's ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``
  form (``Grammar.from_structural_tag`` of the tags and triggers), or xgrammar's own
  structural-tag JSON (any other object).
- ``whitespace_pattern`` is refused by name: xgrammar has no such option.

xgrammar imports PyTorch (its ``testing`` module), so it is imported only when the first
constrained request arrives.
"""

from __future__ import annotations

import json
import logging

from jaxpaged.sampling_params import SamplingParamsError, StructuredOutputsParams
from jaxpaged.structured_output.backend_base import GrammarBackendBase, short

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

    def check(self, params: StructuredOutputsParams):
        """The tokenizer-free grammar of ``params``.

        Raises:
            SamplingParamsError: naming the constraint field (``json``, ``regex``, ...) when the
                backend cannot parse or does not support it.
        """
        kind = params.kind
        if params.whitespace_pattern is not None:
            raise SamplingParamsError(
                "whitespace_pattern",
                params.whitespace_pattern,
                "is not supported by the xgrammar backend",
            )
        try:
            return self._grammar(params)
        except SamplingParamsError:
            raise
        except Exception as error:  # xgrammar raises RuntimeError / ValueError / TypeError
            message = str(error).strip().splitlines()[-1] if str(error).strip() else repr(error)
            raise SamplingParamsError(
                kind, short(getattr(params, kind)), f"cannot be compiled by xgrammar: {message}"
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
            return g.from_ebnf(params.grammar)
        if kind == "choice":
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
            return g.from_ebnf(f"root ::= {alternatives}")
        return self._structural_tag(params.structural_tag)

    def _structural_tag(self, text: str):
        try:
            tag = json.loads(text)
        except json.JSONDecodeError as error:
            raise SamplingParamsError(
                "structural_tag", short(text), f"is not valid JSON: {error}"
            ) from None
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
        """``grammar`` compiled against the tokenizer (thread-safe; xgrammar caches too)."""
        if self._compiler is None:
            info = self._tokenizer_info(self._load_tokenizer())
            self._compiler = self.xgr.GrammarCompiler(info, max_threads=2)
        return self._compiler.compile_grammar(grammar)

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
