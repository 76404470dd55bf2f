"""``mistral``: Mistral 7B v0.3 / Mixtral / Mistral Nemo tool calls.

Format (mistral-common's tool-call tokens; vLLM's ``mistral_tool_parser.py``): content, then
the special token ``[TOOL_CALLS]`` and a JSON array of ``{"name": ..., "arguments": {...}}``;
tokenizers from v11 on write each call as ``[TOOL_CALLS]name[ARGS]{...}`` instead (vLLM reads
both). The markers are special tokens, so detokenization must keep special tokens.
"""

from __future__ import annotations

from jaxpaged.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedCall,
    ParsedOutput,
    ToolParser,
    hold_back_marker,
)
from jaxpaged.entrypoints.openai.tool_parsers.json_scan import (
    MalformedToolCall,
    loads_json,
    parsed_calls,
    scan_call_array,
    skip_whitespace,
    value_end,
)

BOT = "[TOOL_CALLS]"
ARGS = "[ARGS]"


class MistralToolParser(ToolParser):
    def parse(self, text: str, *, final: bool) -> ParsedOutput:
        start = text.find(BOT)
        if start < 0:
            return ParsedOutput(text if final else hold_back_marker(text, BOT), [])
        pos = skip_whitespace(text, start + len(BOT))
        if pos == len(text) or text[pos] == "[":
            objects, _ = scan_call_array(text, pos, ("arguments",), final=final)
            return ParsedOutput(text[:start], parsed_calls(text, objects))
        return ParsedOutput(text[:start], _v11_calls(text, start, final=final))


def _v11_calls(text: str, start: int, *, final: bool) -> list[ParsedCall]:
    """``[TOOL_CALLS]name[ARGS]{...}`` repeated, from ``text[start]``."""
    calls = []
    while start >= 0:
        name_start = start + len(BOT)
        args_tag = text.find(ARGS, name_start)
        if args_tag < 0:
            if not final and "[" not in hold_back_marker(text[name_start:], ARGS):
                break  # the name (or the [ARGS] tag) is still arriving
            raise MalformedToolCall("a [TOOL_CALLS] call needs [ARGS] after its name")
        name = text[name_start:args_tag].strip()
        if not name or not name.replace("_", "a").replace("-", "a").replace(".", "a").isalnum():
            raise MalformedToolCall(f"not a function name: {name!r}")
        args_start = skip_whitespace(text, args_tag + len(ARGS))
        args_end = value_end(text, args_start, final=final)
        arguments = text[args_start : args_end if args_end is not None else len(text)]
        if args_end is not None:
            loads_json(arguments)
        calls.append(ParsedCall(name, arguments, args_end is not None))
        if args_end is None:
            break
        start = text.find(BOT, args_end)
        if start < 0 and text[args_end:].strip() and final:
            raise MalformedToolCall("text after the last call")
    return calls
