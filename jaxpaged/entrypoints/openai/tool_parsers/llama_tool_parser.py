"""``llama3_json``: Llama 3.1 / 3.2 JSON tool calls.

Format (Meta's Llama 3.1 model card, "JSON based tool calling"; vLLM's
``llama_tool_parser.py``): the reply is ``{"name": ..., "parameters": {...}}`` (vLLM also
accepts ``"arguments"``), optionally after ``<|python_tag|>``; several calls are separated by
``;``. A reply that does not start (after whitespace) with one of those is content.
"""

from __future__ import annotations

from jaxpaged.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedOutput,
    ToolParser,
)
from jaxpaged.entrypoints.openai.tool_parsers.json_scan import (
    MalformedToolCall,
    parsed_calls,
    scan_call_object,
    skip_whitespace,
)

BOT = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    def parse(self, text: str, *, final: bool) -> ParsedOutput:
        pos = skip_whitespace(text, 0)
        rest = text[pos:]
        if rest.startswith(BOT):
            pos = skip_whitespace(text, pos + len(BOT))
        elif not final and BOT.startswith(rest):
            return ParsedOutput("", [])  # maybe the tag: wait
        if pos < len(text) and text[pos] != "{" or (pos == len(text) and final):
            return ParsedOutput(text, [])
        objects = []
        while pos < len(text):
            call = scan_call_object(text, pos, ("parameters", "arguments"), final=final)
            objects.append(call)
            if call.end is None:
                break
            pos = skip_whitespace(text, call.end)
            if pos < len(text) and text[pos] == ";":
                pos = skip_whitespace(text, pos + 1)
            elif pos < len(text):
                raise MalformedToolCall(f"expected ';' between calls at character {pos}")
        return ParsedOutput("", parsed_calls(text, objects))
