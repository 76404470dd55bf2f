"""From a request's constraint to a compiled grammar, within the engine's budgets.

Two parts, so that the engine thread never runs a grammar library:

- ``check_budgets`` (on the thread that adds the request; pure Python, linear in the
  constraint's size): the size budget (``structured_outputs_config.max_grammar_bytes``) and
  external ``$ref`` (a schema must be self-contained: xgrammar would otherwise accept any JSON
  there, and nothing may be fetched). The nesting bound is ``StructuredOutputsParams``' own.
- ``compile_constraint`` (a job on ``compiler.GrammarCompiler``'s workers): the backend's fast
  checks, the tokenizer-free grammar, its compilation against the vocabulary, and a probe of a
  fresh matcher's first steps (a grammar that matches no text, or that reaches one of the
  backend's limits at once, is refused rather than aborted later).

Every refusal is a ``SamplingParamsError`` naming the constraint field (``json``, ``regex``,
...) and, for a budget, ``structured_outputs_config.<name>`` and its value.
"""

from __future__ import annotations

import json
import logging

from jaxpaged.param_errors import SamplingParamsError
from jaxpaged.structured_output.backend_base import short
from jaxpaged.structured_output.config import StructuredOutputsConfig
from jaxpaged.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)


def check_budgets(so: StructuredOutputsParams, config: StructuredOutputsConfig) -> None:
    """The checks done before a constraint is queued for compilation.

    Raises:
        SamplingParamsError: the constraint is larger than ``max_grammar_bytes``, or its schema
            (``json``, or a ``structural_tag``'s) has a ``$ref`` outside itself.
    """
    kind = so.kind
    size = len(so.spec.encode("utf-8", "surrogatepass"))
    if size > config.max_grammar_bytes:
        raise SamplingParamsError(
            kind,
            short(so.spec),
            f"is {size} bytes; structured_outputs_config.max_grammar_bytes is "
            f"{config.max_grammar_bytes}",
        )
    if kind in ("json", "structural_tag"):
        ref = external_ref(_parsed(getattr(so, kind)))
        if ref is not None:
            raise SamplingParamsError(
                kind,
                short(so.spec),
                f"has the external $ref {ref!r}: a schema must be self-contained (only "
                "references inside it, starting with '#', are resolved)",
            )


def external_ref(document) -> str | None:
    """The first ``$ref`` string in ``document`` (parsed JSON) not starting with ``#``, the
    only references resolved inside a schema; None when there is none. No recursion."""
    stack = [document]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and not ref.startswith("#"):
                return ref
            stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))
    return None


def compile_constraint(backend, so: StructuredOutputsParams):
    """``so`` compiled by ``backend`` and probed (a compile job; runs on a worker thread).

    Raises:
        SamplingParamsError: naming the constraint field, with the backend's reason.
    """
    kind = so.kind
    schema = _parsed(so.json) if kind == "json" else None
    backend.precheck(so, schema if isinstance(schema, dict) else None)
    grammar = backend.check(so)
    try:
        compiled = backend.compile(grammar)
    except ValueError as error:
        raise SamplingParamsError(kind, short(getattr(so, kind)), str(error)) from None
    problem = backend.probe(compiled)
    if problem is not None:
        del compiled  # the refusal's traceback must not keep it alive
        raise SamplingParamsError(kind, short(getattr(so, kind)), problem)
    return compiled


def refusal(so: StructuredOutputsParams, error: BaseException) -> ValueError:
    """The error a failed compile job refuses its request with: the job's own
    ``ValueError`` (a ``SamplingParamsError`` naming the field, or the backend's missing
    package), anything else (a backend bug) named after the constraint field."""
    if isinstance(error, ValueError):
        return error
    logger.error("compiling a %s constraint failed: %r", so.kind, error)
    return SamplingParamsError(
        so.kind,
        short(getattr(so, so.kind)),
        f"cannot be compiled: {type(error).__name__}: {error}",
    )


def timed_out(so: StructuredOutputsParams, config: StructuredOutputsConfig) -> SamplingParamsError:
    """The refusal of a constraint whose compilation ran past the time budget."""
    return SamplingParamsError(
        so.kind,
        short(getattr(so, so.kind)),
        "took longer to compile than structured_outputs_config.grammar_compile_timeout_s "
        f"({config.grammar_compile_timeout_s:g} s)",
    )


def _parsed(value):
    """A schema (or structural tag) as parsed JSON; malformed text as None (the backend's
    ``check`` reports it, naming the field)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        return None
