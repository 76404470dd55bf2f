"""``mistral``: Mistral 7B v0.3 / Mixtral / Mistral Nemo tool calls.

Format (mistral-common's tool-call tokens; vLLM's ``mistral_tool_parser.py``): content, then
the special token ``[TOOL_CALLS]`` and a JSON array of ``{"name": ..., "arguments": {...}}``.
``[TOOL_CALLS]`` is a special token, so detokenization must keep special tokens.
"""

from __future__ import annotations

from jaxpaged.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedOutput,
    ToolParser,
    hold_back_marker,
)
from jaxpaged.entrypoints.openai.tool_parsers.json_scan import (
    parsed_calls,
    scan_call_array,
    skip_whitespace,
)

BOT = "[TOOL_CALLS]"


class MistralToolParser(ToolParser):
    def parse(self, text: str, *, final: bool) -> ParsedOutput:
        start = text.find(BOT)
        if start < 0:
            return ParsedOutput(text if final else hold_back_marker(text, BOT), [])
        pos = skip_whitespace(text, start + len(BOT))
        objects, _ = scan_call_array(text, pos, ("arguments",), final=final)
        return ParsedOutput(text[:start], parsed_calls(text, objects))
