"""``hermes``: Hermes 2 Pro / Qwen2.5 / Qwen3 tool calls.

Format (NousResearch Hermes-Function-Calling, and vLLM's ``hermes_tool_parser.py``): each call
is a JSON object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and
``</tool_call>``; the text before the first ``<tool_call>`` is content, text between or after
calls is dropped. A last call may lack its closing tag.
"""

from __future__ import annotations

from jaxpaged.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedOutput,
    ToolParser,
    hold_back_marker,
    parsed_calls,
)
from jaxpaged.entrypoints.openai.tool_parsers.json_scan import scan_call_object, skip_whitespace

START, END = "<tool_call>", "</tool_call>"


class Hermes2ProToolParser(ToolParser):
    def parse(self, text: str, *, final: bool) -> ParsedOutput:
        start = text.find(START)
        if start < 0:
            return ParsedOutput(text if final else hold_back_marker(text, START), [])
        objects = []
        while start >= 0:
            pos = skip_whitespace(text, start + len(START))
            if pos == len(text):
                break
            call = scan_call_object(text, pos, ("arguments",), final=final)
            objects.append(call)
            if call.end is None:
                break
            start = text.find(START, call.end)
        return ParsedOutput(text[: text.find(START)], parsed_calls(text, objects))
