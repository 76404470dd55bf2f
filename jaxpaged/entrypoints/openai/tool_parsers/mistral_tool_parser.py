"""``mistral``: Mistral 7B v0.3 / Mixtral / Mistral Nemo / Mistral Small tool calls.

Format (mistral-common's tool-call tokens; vLLM's ``vllm/parser/mistral.py``): content, then
the special token ``[TOOL_CALLS]`` and the calls. The markers are special tokens, so
detokenization must keep special tokens. Two generations of tokenizers write the calls
differently; vLLM tells them apart by the tokenizer's ``[ARGS]`` token, and so does this
parser (``v11``):

- before v11: a JSON array ``[{"name": ..., "arguments": {...}}, ...]``. vLLM is lenient with
  what models write, and so is this parser: a bare object is one call, repeated markers count
  once, an entry that is not a call object is skipped, a missing name reads as ``""``,
  arguments given as a JSON string are that string, junk before the array is skipped. Text
  after the array (or object) is dropped from the whole reply and streamed as content. When the
  JSON holds no call, the text after the marker is the content (``[TOOL_CALLS] 42`` -> ``42``).
- v11 on: ``[TOOL_CALLS]name[ARGS]{...}`` per call, or ``[TOOL_CALLS]name{...}`` when
  detokenization drops ``[ARGS]``; a name alone is a call without arguments (``{}``). A bare
  ``[TOOL_CALLS]{...}`` (the model wrote the name before the marker) is a call with the empty
  name; the name stays in the content. Text after a call's arguments is dropped.

Both readings of ``[TOOL_CALLS]name...`` and of the array are accepted whatever the tokenizer;
the tokenizer decides only what a bare object after the marker is.

Call ids are 9 alphanumeric characters: Mistral's chat templates refuse other ids when the
calls come back in the conversation (mistral-common's validator).
"""

from __future__ import annotations

import json
import random
import re
import string

from jaxpaged.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedCall,
    ParsedOutput,
    ToolParser,
    hold_back_marker,
)
from jaxpaged.entrypoints.openai.tool_parsers.json_scan import (
    MalformedToolCall,
    loads_json,
    scan_call_object,
    skip_whitespace,
    value_end,
)

BOT = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_ID_CHARACTERS = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    """Args:
    tokenizer: the server's tokenizer; one with an ``[ARGS]`` token is v11 or later.
    """

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        self.v11 = ARGS in vocab

    def make_call_id(self) -> str:
        return "".join(random.choices(_ID_CHARACTERS, k=9))

    def parse(self, text: str, *, final: bool) -> ParsedOutput:
        start = text.find(BOT)
        if start < 0:
            content = text if final else hold_back_marker(text, BOT)
            # Whitespace alone may yet stand before a marker, where it is not content: wait.
            return ParsedOutput(content if final or content.strip() else "", [])
        # Whitespace alone before the calls is not content (vLLM drops it).
        content = text[:start] if text[:start].strip() else ""
        pos = _after_markers(text, start)
        if pos == len(text) or not final and BOT.startswith(text[pos:]):
            return ParsedOutput(content, [])  # the calls have not started yet
        first = text[pos]
        if first == "{" and self.v11:
            calls, trailing = _v11_calls(text, pos, final=final, v11=True)
        elif first == "{":
            calls, trailing = _bare_object_call(text, pos, final=final)
        elif first == "[":
            calls, trailing = _array_calls(text, pos, final=final)
        else:
            calls, trailing = _v11_calls(text, pos, final=final, v11=self.v11)
            if calls is None:
                calls, trailing = _array_after_junk(text, pos, final=final)
        if calls is None:  # no call (yet): the text after the marker is the content
            if not final:
                return ParsedOutput(content, [])
            return ParsedOutput(content + text[pos:].strip(), [])
        return ParsedOutput(content, calls, trailing)


def _after_markers(text: str, start: int) -> int:
    """The first character after the marker at ``text[start]`` and any markers repeated right
    after it (Mistral-7B-Instruct-v0.3 repeats it at temperature 0), whitespace skipped."""
    pos = skip_whitespace(text, start + len(BOT))
    while text.startswith(BOT, pos):
        pos = skip_whitespace(text, pos + len(BOT))
    return pos


def _envelope_call(text: str, pos: int, *, final: bool) -> tuple[ParsedCall | None, int | None]:
    """The ``{"name": ..., "arguments": ...}`` object at ``text[pos]``: (its call, None when the
    object is not a call; the index past it, None while it is open). Arguments given as a JSON
    string are that string; other non-object values are their JSON; missing ones ``{}``."""
    scanned = scan_call_object(text, pos, ("arguments",), final=final, strict=False)
    closed = scanned.end is not None
    if closed and scanned.name is None and scanned.args_start is None:
        return None, scanned.end
    name = scanned.name if scanned.name is not None or not closed else ""
    if scanned.args_start is None:
        arguments = "{}" if closed else ""
    elif text.startswith("{", scanned.args_start):
        arguments = scanned.arguments(text)
    elif scanned.args_end is None:
        arguments = ""  # a string or other value: sent once it is whole
    else:
        value = json.loads(scanned.arguments(text))
        arguments = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return ParsedCall(name, arguments, closed), scanned.end


def _bare_object_call(text: str, pos: int, *, final: bool):
    """Before v11: a bare call object after the marker is the one call; the text after it is
    trailing. (None, "") when the object is not a call."""
    call, end = _envelope_call(text, pos, final=final)
    if call is None:
        return None, ""
    return [call], text[end:] if end is not None else ""


def _array_calls(text: str, pos: int, *, final: bool):
    """The JSON array of calls at ``text[pos]`` (``[``): (calls, trailing text). Entries that
    are not call objects are skipped; (None, "") when the whole array holds no call.

    Raises:
        MalformedToolCall: the array is not valid JSON.
    """
    calls: list[ParsedCall] = []
    i = skip_whitespace(text, pos + 1)
    while i < len(text):
        if text[i] == "]":
            return (calls or None), text[i + 1 :]
        if text[i] == "{":
            call, end = _envelope_call(text, i, final=final)
            if call is not None:
                calls.append(call)
        else:
            end = value_end(text, i, final=final)
            if end is not None:
                loads_json(text[i:end])
        if end is None:
            return calls, ""
        i = skip_whitespace(text, end)
        if i < len(text) and text[i] == ",":
            i = skip_whitespace(text, i + 1)
        elif i < len(text) and text[i] != "]":
            raise MalformedToolCall(f"expected ',' or ']' at character {i}")
    # Cut off (max_tokens) after its last complete call, or still streaming.
    return (calls or None) if final else calls, ""


def _array_after_junk(text: str, pos: int, *, final: bool):
    """Before v11, vLLM looks for ``[{...}]`` past junk after the marker; so does this."""
    found = text.find("[{", pos)
    if found < 0:
        return None, ""
    return _array_calls(text, found, final=final)


def _v11_calls(text: str, pos: int, *, final: bool, v11: bool):
    """``name[ARGS]{...}`` / ``name{...}`` / ``name`` calls, each after a marker, the first at
    ``text[pos]``: (calls, "") (no trailing text in this form). ``v11``: a bare ``{...}`` is a
    call with the empty name. (None, "") when the text at ``pos`` is not this form."""
    calls: list[ParsedCall] = []
    while True:
        head = _v11_head(text, pos, final=final, v11=v11)
        if head is None:  # not this form: the first call decides, later it is trailing text
            return (calls or None), ""
        if head == "wait":
            return calls, ""
        name, args_start = head
        if args_start is None:  # a name alone: a call without arguments
            end = skip_whitespace(text, pos + len(name))
            calls.append(ParsedCall(name, "{}", True))
        else:
            args_end = value_end(text, args_start, final=final)
            arguments = text[args_start : len(text) if args_end is None else args_end]
            if args_end is None:
                calls.append(ParsedCall(name, arguments, False))
                return calls, ""
            loads_json(arguments)
            calls.append(ParsedCall(name, arguments, True))
            end = args_end
        # Text after the arguments is dropped (vLLM reads only the first JSON value), whole
        # and streamed: a later marker may still start another call.
        following = text.find(BOT, end)
        if following < 0:
            return calls, ""
        pos = _after_markers(text, following)


def _v11_head(text: str, pos: int, *, final: bool, v11: bool):
    """At ``text[pos]`` (after a marker): ``(name, where its arguments start)``, with None
    for a name alone at the end of the text or before the next marker; "wait" while the text
    may still become either; None when it is not the v11 form."""
    if pos == len(text):
        return None if final else "wait"
    if text[pos] == "{":
        return ("", pos) if v11 else None
    match = _NAME.match(text, pos)
    if match is None:
        return None
    after = skip_whitespace(text, match.end())
    rest = text[after:]
    if rest.startswith(ARGS):
        args_start = skip_whitespace(text, after + len(ARGS))
        if args_start == len(text):
            return (match.group(), None) if final else "wait"
        return match.group(), args_start
    if rest.startswith("{"):
        return match.group(), after
    if not rest or rest.startswith(BOT):
        return (match.group(), None) if final or rest else "wait"
    if not final and (ARGS.startswith(rest) or BOT.startswith(rest)):
        return "wait"
    return None
