"""Tool-call parsers, chosen by ``--tool-call-parser NAME`` (vLLM's names).

Each parser reads one model family's tool-call text format (see its module):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
- ``llama3_json``: ``<|python_tag|>{"name": ..., "parameters": {...}}``, ``;``-separated
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``
- ``pythonic``: ``[f(a=1), g(b="x")]``
"""

from __future__ import annotations

import importlib

from jaxpaged.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCallInformation,
    ParsedCall,
    ParsedOutput,
    ToolParser,
    make_tool_call_id,
)

# name -> "module:class" under this package (imported when chosen).
TOOL_PARSERS = {
    "hermes": "hermes_tool_parser:Hermes2ProToolParser",
    "llama3_json": "llama_tool_parser:Llama3JsonToolParser",
    "mistral": "mistral_tool_parser:MistralToolParser",
    "pythonic": "pythonic_tool_parser:PythonicToolParser",
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as ``name``.

    Raises:
        ValueError: an unknown name; the message lists the known ones.
    """
    if name not in TOOL_PARSERS:
        raise ValueError(
            f"--tool-call-parser {name!r} is not a known tool parser; choose one of "
            f"{sorted(TOOL_PARSERS)}"
        )
    module, _, cls = TOOL_PARSERS[name].partition(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


__all__ = [
    "TOOL_PARSERS",
    "ExtractedToolCallInformation",
    "ParsedCall",
    "ParsedOutput",
    "ToolParser",
    "get_tool_parser",
    "make_tool_call_id",
]
