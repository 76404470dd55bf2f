"""Reasoning parsers, chosen by ``--reasoning-parser NAME`` (vLLM's names): ``deepseek_r1``
and ``qwen3``, both splitting ``<think>…</think>`` from the reply (see their modules)."""

from __future__ import annotations

from jaxpaged.entrypoints.openai.parser_registry import ParserRegistry
from jaxpaged.entrypoints.openai.reasoning_parsers.abstract_reasoning_parser import (
    ReasoningParser,
    Split,
)

REASONING_PARSERS: ParserRegistry[ReasoningParser] = ParserRegistry(
    "--reasoning-parser",
    "reasoning parser",
    __name__,
    {
        "deepseek_r1": "deepseek_r1_reasoning_parser:DeepSeekR1ReasoningParser",
        "qwen3": "qwen3_reasoning_parser:Qwen3ReasoningParser",
    },
)


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as ``name``.

    Raises:
        ValueError: an unknown name; the message lists the known ones.
    """
    return REASONING_PARSERS.get_class(name)


__all__ = ["REASONING_PARSERS", "ReasoningParser", "Split", "get_reasoning_parser"]
