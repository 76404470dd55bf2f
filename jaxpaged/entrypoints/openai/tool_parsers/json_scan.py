"""Scanning JSON that may still be arriving: where a value ends, what a call object holds.

The tool parsers read ``{"name": ..., "arguments": {...}}`` objects out of model text that
streams in a few characters at a time. ``json.loads`` needs the whole value; these functions
walk the text once and report what is already certain (the name once its string is closed,
where the arguments value starts and, once it is closed, where it ends), so a parser can
stream the arguments as raw slices of the text: every slice sent is a prefix of the final
arguments text. Grammar of JSON: RFC 8259.
"""

from __future__ import annotations

import dataclasses
import json
import re

_WHITESPACE = " \t\n\r"
# Characters that end a number or a literal (true / false / null).
_SCALAR_END = frozenset(_WHITESPACE + ",]}:")
# What a scan stops at (the regex engine skips the rest in C): inside a value, a string's
# start or a bracket; inside a string, its end or an escape.
_STRUCTURAL = re.compile(r'["{}\[\]]')
_QUOTE_OR_ESCAPE = re.compile(r'["\\]')


class MalformedToolCall(ValueError):
    """The text cannot be the tool-call format the parser expects."""


def skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def value_end(text: str, pos: int, *, final: bool) -> int | None:
    """The index just past the JSON value starting at ``text[pos]``; None when the text ends
    first. Brackets are counted outside strings only; the inside of a closed value is not
    checked (``json.loads`` on the slice does that). A number or literal running to the end
    of the text is complete only when ``final`` (more digits may follow otherwise).

    Raises:
        MalformedToolCall: ``text[pos]`` cannot start a value, or brackets do not match.
    """
    if pos >= len(text):
        return None
    first = text[pos]
    if first == '"':
        return _string_end(text, pos)
    if first in "{[":
        closers = []
        i = pos
        while (match := _STRUCTURAL.search(text, i)) is not None:
            i = match.start()
            char = text[i]
            if char == '"':
                end = _string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if char in "{[":
                closers.append("}" if char == "{" else "]")
            elif not closers or closers.pop() != char:
                raise MalformedToolCall(f"unmatched {char!r} at character {i}")
            elif not closers:
                return i + 1
            i += 1
        return None
    if first in "-0123456789tfn":
        i = pos
        while i < len(text) and text[i] not in _SCALAR_END:
            i += 1
        if i == len(text) and not final:
            return None
        return i
    raise MalformedToolCall(f"no JSON value can start with {first!r} (character {pos})")


def _string_end(text: str, pos: int) -> int | None:
    i = pos + 1
    while (match := _QUOTE_OR_ESCAPE.search(text, i)) is not None:
        if match.group() == '"':
            return match.end()
        i = match.end() + 1  # a backslash escapes the next character
    return None


@dataclasses.dataclass
class CallObject:
    """What is known of one ``{"name": ..., <arguments key>: ...}`` object in a text.

    ``name``: the function name once its string is closed. ``args_start`` / ``args_end``:
    the arguments value's span in the text (``args_end`` None while it is open). ``end``:
    the index past the object's closing brace, None while it is open.
    """

    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    end: int | None = None

    def arguments(self, text: str) -> str:
        """The arguments text known so far (a prefix of the final one)."""
        if self.args_start is None:
            return ""
        return text[self.args_start : self.args_end if self.args_end is not None else len(text)]


def scan_call_object(
    text: str, pos: int, args_keys: tuple[str, ...], *, final: bool, strict: bool = True
) -> CallObject:
    """Read the call object starting at ``text[pos]`` (which must be ``{``) as far as the text
    goes. A complete object must have a string ``name`` and one of ``args_keys`` whose value
    is valid JSON; unless ``strict``, either may be missing and a name that is not a string
    reads as ``""`` (the caller decides what such an object is).

    Raises:
        MalformedToolCall: not an object, bad JSON, or (``strict``) a non-string name or a
            complete object without a name or arguments.
    """
    call = CallObject()
    if pos >= len(text):
        return call
    if text[pos] != "{":
        raise MalformedToolCall(f"a tool call must be a JSON object, got {text[pos]!r}")
    i = skip_whitespace(text, pos + 1)
    expect_key = True
    while i < len(text):
        if text[i] == "}":
            call.end = i + 1
            break
        if not expect_key:
            raise MalformedToolCall(f"expected ',' or '}}' at character {i}")
        key_end = value_end(text, i, final=final)
        if key_end is None:
            return call
        if text[i] != '"':
            raise MalformedToolCall(f"an object key must be a string (character {i})")
        key = json.loads(text[i:key_end])
        i = skip_whitespace(text, key_end)
        if i == len(text):
            return call
        if text[i] != ":":
            raise MalformedToolCall(f"expected ':' after key {key!r}")
        start = skip_whitespace(text, i + 1)
        end = value_end(text, start, final=final)
        if key in args_keys:
            call.args_start, call.args_end = start, end
        if end is None:
            return call
        if key == "name":
            name = loads_json(text[start:end])
            if not isinstance(name, str):
                if strict:
                    raise MalformedToolCall(f"a tool call's name must be a string, got {name!r}")
                name = ""
            call.name = name
        i = skip_whitespace(text, end)
        if i < len(text) and text[i] == ",":
            i = skip_whitespace(text, i + 1)
        elif i < len(text) and text[i] != "}":
            raise MalformedToolCall(f"expected ',' or '}}' at character {i}")
        else:
            expect_key = False
    if call.end is not None:
        if strict and (call.name is None or call.args_start is None):
            raise MalformedToolCall(f"a tool call needs 'name' and one of {list(args_keys)}")
        if call.args_start is not None:
            loads_json(call.arguments(text))
    return call


def loads_json(text: str):
    """``json.loads``, raising MalformedToolCall."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise MalformedToolCall(f"invalid JSON {text[:80]!r}: {error}") from None


def scan_call_array(
    text: str, pos: int, args_keys: tuple[str, ...], *, final: bool
) -> tuple[list[CallObject], int | None]:
    """Read a JSON array of call objects starting at ``text[pos]`` (``[``) as far as the text
    goes: the calls seen, and the index past ``]`` (None while the array is open).

    Raises:
        MalformedToolCall: not an array of call objects.
    """
    if pos >= len(text):
        return [], None
    if text[pos] != "[":
        raise MalformedToolCall(f"expected a JSON array of tool calls, got {text[pos]!r}")
    calls: list[CallObject] = []
    i = skip_whitespace(text, pos + 1)
    while i < len(text):
        if text[i] == "]" and (not calls or calls[-1].end is not None):
            return calls, i + 1
        call = scan_call_object(text, i, args_keys, final=final)
        calls.append(call)
        if call.end is None:
            return calls, None
        i = skip_whitespace(text, call.end)
        if i < len(text) and text[i] == ",":
            i = skip_whitespace(text, i + 1)
        elif i < len(text) and text[i] != "]":
            raise MalformedToolCall(f"expected ',' or ']' at character {i}")
    return calls, None
