"""Tool-call parsers, chosen by ``--tool-call-parser NAME`` (vLLM's names).

Each parser reads one model family's tool-call text format (see its module):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
- ``llama3_json``: ``<|python_tag|>{"name": ..., "parameters": {...}}``, ``;``-separated
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` or, from v11
  tokenizers on, ``[TOOL_CALLS]name{...}`` / ``[TOOL_CALLS]name[ARGS]{...}`` per call
- ``pythonic``: ``[f(a=1), g(b="x")]``

Modules: ``json_scan`` (partial JSON, no parser types) <- ``abstract_tool_parser`` (the
interface) <- one module per format.
"""

from __future__ import annotations

from jaxpaged.entrypoints.openai.parser_registry import ParserRegistry
from jaxpaged.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCallInformation,
    ParsedCall,
    ParsedOutput,
    ToolParser,
    make_tool_call_id,
)

TOOL_PARSERS: ParserRegistry[ToolParser] = ParserRegistry(
    "--tool-call-parser",
    "tool parser",
    __name__,
    {
        "hermes": "hermes_tool_parser:Hermes2ProToolParser",
        "llama3_json": "llama_tool_parser:Llama3JsonToolParser",
        "mistral": "mistral_tool_parser:MistralToolParser",
        "pythonic": "pythonic_tool_parser:PythonicToolParser",
    },
)


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as ``name``.

    Raises:
        ValueError: an unknown name; the message lists the known ones.
    """
    return TOOL_PARSERS.get_class(name)


__all__ = [
    "TOOL_PARSERS",
    "ExtractedToolCallInformation",
    "ParsedCall",
    "ParsedOutput",
    "ToolParser",
    "get_tool_parser",
    "make_tool_call_id",
]
