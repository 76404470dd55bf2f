"""Reasoning parsers, chosen by ``--reasoning-parser NAME`` (vLLM's names): ``deepseek_r1``
and ``qwen3``, both splitting ``<think>…</think>`` from the reply (see their modules)."""

from __future__ import annotations

import importlib

from jaxpaged.entrypoints.openai.reasoning_parsers.abstract_reasoning_parser import (
    ReasoningParser,
    Split,
)

REASONING_PARSERS = {
    "deepseek_r1": "deepseek_r1_reasoning_parser:DeepSeekR1ReasoningParser",
    "qwen3": "qwen3_reasoning_parser:Qwen3ReasoningParser",
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as ``name``.

    Raises:
        ValueError: an unknown name; the message lists the known ones.
    """
    if name not in REASONING_PARSERS:
        raise ValueError(
            f"--reasoning-parser {name!r} is not a known reasoning parser; choose one of "
            f"{sorted(REASONING_PARSERS)}"
        )
    module, _, cls = REASONING_PARSERS[name].partition(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


__all__ = ["REASONING_PARSERS", "ReasoningParser", "Split", "get_reasoning_parser"]
