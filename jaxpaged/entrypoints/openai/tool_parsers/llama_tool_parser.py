"""``llama3_json``: Llama 3.1 / 3.2 JSON tool calls.

Format (Meta's Llama 3.1 model card, "JSON based tool calling"; vLLM's
``llama_tool_parser.py``): the reply is ``{"name": ..., "parameters": {...}}`` (vLLM also
accepts ``"arguments"``), optionally after ``<|python_tag|>``; several calls are separated by
``;`` (a last ``;`` may follow the last call). The calls may be followed by an end-of-output
token (``<|eom_id|>``, ``<|eot_id|>``, ``<|end_of_text|>``) when detokenization keeps special
tokens. A reply that does not start (after whitespace) with one of those is content.
"""

from __future__ import annotations

from jaxpaged.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedOutput,
    ToolParser,
    parsed_calls,
)
from jaxpaged.entrypoints.openai.tool_parsers.json_scan import (
    MalformedToolCall,
    scan_call_object,
    skip_whitespace,
)

BOT = "<|python_tag|>"
# vLLM's LLAMA_OUTPUT_END_TOKENS: they may end the calls (with only whitespace after them).
END_TOKENS = ("<|eom_id|>", "<|eot_id|>", "<|end_of_text|>")


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
                _check_end_token(text, pos, final=final)
                break
        return ParsedOutput("", parsed_calls(text, objects))


def _check_end_token(text: str, pos: int, *, final: bool) -> None:
    """What follows the calls at ``text[pos]`` must be an end-of-output token (or, while the
    text streams, the start of one), then only whitespace.

    Raises:
        MalformedToolCall: anything else.
    """
    rest = text[pos:]
    for token in END_TOKENS:
        if rest.startswith(token) and not rest[len(token) :].strip():
            return
        if not final and token.startswith(rest):
            return
    raise MalformedToolCall(f"expected ';' between calls at character {pos}")
