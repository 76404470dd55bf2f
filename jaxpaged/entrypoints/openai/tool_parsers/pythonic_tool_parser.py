"""``pythonic``: tool calls written as a Python list of calls (Llama 3.2 / 4, ToolACE).

Format (vLLM's ``pythonic_tool_parser.py`` and its docs): the whole reply is
``[f(a=1, b="x"), g(c=[1, 2])]`` with keyword arguments whose values are Python literals
(``true`` / ``false`` / ``null`` are accepted too). Arguments are sent as the JSON of the
keyword arguments (``json.dumps``, non-ASCII kept); while a call is open, the JSON of the
arguments already closed without its final ``}``, so each streamed text is a prefix of the
next. A reply that is not such a list is content.
"""

from __future__ import annotations

import ast
import json
import re

from jaxpaged.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedCall,
    ParsedOutput,
    ToolParser,
)
from jaxpaged.entrypoints.openai.tool_parsers.json_scan import MalformedToolCall, skip_whitespace

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_JSON_NAMES = {"true": True, "false": False, "null": None}
_CLOSERS = {"(": ")", "[": "]", "{": "}"}
# What the argument scan stops at (the regex engine skips the rest in C).
_ARGUMENT_STRUCTURE = re.compile(r"[\"'()\[\]{},]")
_QUOTE_OR_ESCAPE = {'"': re.compile(r'["\\]'), "'": re.compile(r"['\\]")}


class PythonicToolParser(ToolParser):
    keeps_special_tokens = False

    def parse(self, text: str, *, final: bool) -> ParsedOutput:
        pos = skip_whitespace(text, 0)
        if pos == len(text):
            return ParsedOutput(text if final else "", [])
        if text[pos] != "[":
            return ParsedOutput(text, [])
        try:
            calls, end = _scan_calls(text, pos + 1, final=final)
        except MalformedToolCall:
            if _looks_like_calls(text, pos):
                raise
            return ParsedOutput(text, [])  # e.g. "[1, 2]": a list, not calls
        if final and (end is None or text[end:].strip()):
            raise MalformedToolCall("a pythonic tool-call list must close and end the reply")
        return ParsedOutput("", calls)


def _looks_like_calls(text: str, pos: int) -> bool:
    """Whether ``text[pos:]`` (at ``[``) has reached ``[name(``: after that a syntax error
    is a broken call, before it the text may just be a list in prose."""
    match = _NAME.match(text, skip_whitespace(text, pos + 1))
    if match is None:
        return False
    paren = skip_whitespace(text, match.end())
    return paren < len(text) and text[paren] == "("


def _scan_calls(text: str, pos: int, *, final: bool) -> tuple[list[ParsedCall], int | None]:
    calls: list[ParsedCall] = []
    pos = skip_whitespace(text, pos)
    while pos < len(text):
        if text[pos] == "]":
            return calls, pos + 1
        match = _NAME.match(text, pos)
        if match is None:
            raise MalformedToolCall(f"expected a function name at character {pos}")
        paren = skip_whitespace(text, match.end())
        if paren == len(text):
            return calls, None  # the name may go on
        if text[paren] != "(":
            raise MalformedToolCall(f"expected '(' after {match.group()!r}")
        call, pos = _scan_arguments(text, paren + 1, match.group(), final=final)
        calls.append(call)
        if pos is None:
            return calls, None
        pos = skip_whitespace(text, pos)
        if pos < len(text) and text[pos] == ",":
            pos = skip_whitespace(text, pos + 1)
        elif pos < len(text) and text[pos] != "]":
            raise MalformedToolCall(f"expected ',' or ']' at character {pos}")
    return calls, None


def _scan_arguments(text: str, pos: int, name: str, *, final: bool):
    """The call's arguments from ``text[pos]`` (just past ``(``): (ParsedCall, index past
    ``)`` or None while open)."""
    arguments: dict = {}
    while True:
        segment_end = _segment_end(text, pos)
        if segment_end is None:
            return ParsedCall(name, _open_json(arguments), False), None
        segment = text[pos:segment_end].strip()
        closing = text[segment_end] == ")"
        if segment:
            key, sep, value = segment.partition("=")
            key = key.strip()
            if not sep or not key.isidentifier():
                raise MalformedToolCall(f"{name}: arguments must be keyword=value, got {segment!r}")
            arguments[key] = _literal(value.strip())
        elif not closing:
            raise MalformedToolCall(f"{name}: an empty argument")
        pos = segment_end + 1
        if closing:
            return ParsedCall(name, json.dumps(arguments, ensure_ascii=False), True), pos


def _open_json(arguments: dict) -> str:
    """The JSON of the arguments closed so far, without the final ``}``."""
    return json.dumps(arguments, ensure_ascii=False)[:-1]


def _segment_end(text: str, pos: int) -> int | None:
    """The index of the ``,`` or ``)`` that ends the argument starting at ``pos`` (outside
    strings and brackets); None when the text ends first."""
    stack: list[str] = []
    i = pos
    while (match := _ARGUMENT_STRUCTURE.search(text, i)) is not None:
        i = match.start()
        char = text[i]
        if char in "\"'":
            end = _python_string_end(text, i)
            if end is None:
                return None
            i = end
            continue
        if char in _CLOSERS:
            stack.append(_CLOSERS[char])
        elif char in ")]}":
            if not stack:
                if char == ")":
                    return i
                raise MalformedToolCall(f"unmatched {char!r} at character {i}")
            if stack.pop() != char:
                raise MalformedToolCall(f"unmatched {char!r} at character {i}")
        elif char == "," and not stack:
            return i
        i += 1
    return None


def _python_string_end(text: str, pos: int) -> int | None:
    pattern = _QUOTE_OR_ESCAPE[text[pos]]
    i = pos + 1
    while (match := pattern.search(text, i)) is not None:
        if match.group() != "\\":
            return match.end()
        i = match.end() + 1  # a backslash escapes the next character
    return None


def _literal(source: str):
    try:
        node = ast.parse(source, mode="eval").body
    except SyntaxError as error:
        raise MalformedToolCall(f"not a Python literal: {source!r}") from error
    return _value(node)


def _value(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, str | int | float | None):
        return node.value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List | ast.Tuple):
        return [_value(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        if not all(isinstance(key, ast.Constant) for key in node.keys):
            raise MalformedToolCall("dict keys in tool-call arguments must be literals")
        return {key.value: _value(value) for key, value in zip(node.keys, node.values, strict=True)}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        value = _value(node.operand)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return -value
    raise MalformedToolCall(f"tool-call arguments must be literals, got {ast.dump(node)[:80]}")
