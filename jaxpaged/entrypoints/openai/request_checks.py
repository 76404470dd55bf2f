"""Checks of a request body's raw JSON, before pydantic reads it: what no later stage could
carry is refused by path (``check_body``), as a ``FieldValueError`` the 400 names.

Kept apart from the protocol's models, which run ``check_body`` first in every request's
validation (``protocol_base.OpenAIRequest``); the chat tools run it on arguments they parse.
"""

from __future__ import annotations

import math
import re


class FieldValueError(ValueError):
    """A body-level validator's refusal of one field; ``parameter`` is its dotted path
    (``messages[0].content``), which the 400's ``param`` names (``errors._validation_message``):
    pydantic locates a model validator's errors at the body, not the field."""

    def __init__(self, message: str, *, parameter: str | None = None):
        super().__init__(message)
        self.parameter = parameter


MAX_JSON_DEPTH = 100
"""Deepest nesting of objects and arrays in a request body. Schemas, tool parameters and
template kwargs are walked recursively by jsonschema, Jinja, msgpack and the grammar
compilers: a tool schema nested 120 levels deep (5 KB) raised RecursionError (a 500) in
jsonschema. 100 levels is about 48 levels of a JSON schema, far beyond any real one, and
within what each of those walkers takes (jsonschema alone failed past ~90 schema levels)."""
INT_MIN, INT_MAX = -(2**63), 2**64 - 1
"""The integers a body may hold anywhere: what msgpack carries to the engine core (int64 or
uint64); ``{"maximum": 10**40}`` in a schema raised TypeError there (a 500)."""


def check_body(body) -> None:
    """Refuse, naming the value's path (``tools[0].function.parameters``), what a later stage
    could not carry and would raise on instead of answering 400:

    - a string holding a lone surrogate (valid JSON, ``"\\ud800"``; no UTF-8 encodes it);
    - nesting deeper than ``MAX_JSON_DEPTH``;
    - an integer outside ``[INT_MIN, INT_MAX]`` inside an object below the top level: free-form
      content (schemas, tool parameters, template kwargs). Top-level fields and their arrays are
      typed (pydantic words their bounds; token ids are refused as out of vocabulary);
    - NaN or an infinity (Python's JSON reads ``NaN`` / ``Infinity``, RFC 8259 has no such
      numbers): a ``logit_bias`` of ``Infinity`` was accepted as +100.

    Walks an explicit stack, not the call stack: a body nested a thousand levels deep is
    valid JSON, and recursion here raised RecursionError (a 500) before validation refused it.

    Raises:
        FieldValueError: the first offending value in the body's order; ``parameter`` is its
            path cut after its third key (``_field_path``).
    """
    # (value, its path, its depth, whether an object below the body holds it)
    stack = [(body, "", 0, False)]
    while stack:
        value, path, depth, free = stack.pop()
        if isinstance(value, str):
            _check_string(value, path)
        elif isinstance(value, dict):
            if depth >= MAX_JSON_DEPTH:
                _too_deep(path)
            inner = depth > 0  # the body's own keys are its typed fields
            # Pushed last first, so popped in the body's order: the first one is named.
            for key, item in reversed(value.items()):
                item_path = f"{path}.{key}" if path else str(key)
                if type(item) in _SCALARS:
                    _check_scalar(item, item_path, inner)
                else:
                    stack.append((item, item_path, depth + 1, inner))
                stack.append((key, path, depth + 1, False))
        elif isinstance(value, (list, tuple)):
            if depth >= MAX_JSON_DEPTH:
                _too_deep(path)
            kinds = set(map(type, value))
            if kinds <= _FLAT:  # token ids, choices, enums: checked in C-level passes
                if str in kinds:
                    _check_strings(value, path)
                _check_scalars(value, kinds - {str}, path, free)
                continue
            for i in range(len(value) - 1, -1, -1):
                stack.append((value[i], f"{path}[{i}]", depth + 1, free))
        elif type(value) in _SCALARS:
            _check_scalar(value, path, False)


# Element types that hold nothing inside them; lists of them (and of strings) are checked in
# C-level passes: a 100,000-string enum took 54 ms of the event loop one value at a time, 3 ms so.
_SCALARS = frozenset({int, float, bool, type(None)})
_FLAT = _SCALARS | {str}


def _check_string(value: str, path: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(value[error.start])
        where = path or "the request body"
        raise FieldValueError(
            f"{where} holds a lone surrogate U+{code:04X} at character {error.start}, "
            "which is not valid Unicode",
            parameter=_field_path(path),
        ) from None


def _check_strings(values: list, path: str) -> None:
    """``_check_string`` of each string of ``values``: one encode of them all (Python never
    pairs surrogates across a join), then, only if it fails, one by one to name the first."""
    strings = [v for v in values if type(v) is str]
    try:
        "".join(strings).encode("utf-8")
    except UnicodeEncodeError:
        for i, item in enumerate(values):
            if type(item) is str:
                _check_string(item, f"{path}[{i}]")


def _check_scalar(value, path: str, free: bool) -> None:
    if type(value) is int and free and not INT_MIN <= value <= INT_MAX:
        _int_out_of_range(value, path)
    if type(value) is float and not math.isfinite(value):
        raise FieldValueError(
            f"{path} is {value!r}: JSON numbers are finite (RFC 8259), and this value is not "
            "one a request may carry",
            parameter=_field_path(path),
        )


def _check_scalars(values: list, kinds: set, path: str, free: bool) -> None:
    if float in kinds:
        for i, item in enumerate(values):
            _check_scalar(item, f"{path}[{i}]", free)
    elif free and int in kinds and values:
        ints = values if kinds <= {int, bool} else [v for v in values if type(v) is int]
        if not (INT_MIN <= min(ints) and max(ints) <= INT_MAX):
            bad = next(v for v in ints if not INT_MIN <= v <= INT_MAX)
            _int_out_of_range(bad, f"{path}[{values.index(bad)}]")


def _int_out_of_range(value: int, path: str) -> None:
    digits = len(str(abs(value)))
    raise FieldValueError(
        f"{path} holds an integer of {digits} digits, outside the 64-bit range every "
        f"integer of a request must fit ([-2**63, 2**64 - 1]); write a larger bound as a "
        f"number with an exponent (1e40)",
        parameter=_field_path(path),
    )


def _too_deep(path: str) -> None:
    shown = path if len(path) <= 120 else path[:120] + "..."
    raise FieldValueError(
        f"{_field_path(path) or 'the request body'} nests objects and arrays deeper than "
        f"{MAX_JSON_DEPTH} levels (at {shown or 'the top'}); the limit is {MAX_JSON_DEPTH}",
        parameter=_field_path(path),
    )


def _field_path(path: str) -> str | None:
    """``path`` cut after its third key (``tools[0].function.parameters.properties.a`` ->
    ``tools[0].function.parameters``; ``prompt[1][0]`` -> ``prompt``): the field a client
    set, not the position inside a free-form value. None for the body itself."""
    keys = 0
    for match in re.finditer(r"[^.\[\]]+|\[\d+\]", path):
        if not match.group().startswith("["):
            keys += 1
            if keys == 3:
                return path[: match.end()]
    if not path:
        return None
    if keys < 3:  # fewer keys: up to the last key, without the indices after it
        return re.sub(r"(\[\d+\])+$", "", path) or None
    return path
