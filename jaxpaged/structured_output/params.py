"""``StructuredOutputsParams``: one request's constraint (JSON schema, regex, choice, grammar, JSON
object or structural tag), checked when it is made; vLLM's
``vllm.sampling_params.StructuredOutputsParams`` (``jaxpaged.sampling_params`` uses it, and users
import it from there or from ``jaxpaged``).

The checks that need the grammar backend (a schema it cannot compile, budgets) are made by the
engine when the request is added (``admission.py``).
"""

from __future__ import annotations

import dataclasses
import json as _json
import reprlib

from jaxpaged.param_errors import SamplingParamsError

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
