"""``qwen3``: Qwen3 thinking models.

Format (Qwen3's chat template; vLLM's ``qwen3_reasoning_parser.py``): ``<think>reasoning
</think>content``, the ``<think>`` possibly in the prompt. The request's
``chat_template_kwargs={"enable_thinking": false}`` switches thinking off: then a reply without
``</think>`` is all content; with thinking on (the default) it is reasoning cut off, unless
a ``<tool_call>`` starts first: then the reasoning ends there and the call is content (vLLM's
Qwen3 parser; the tool parser reads it).
"""

from __future__ import annotations

from jaxpaged.entrypoints.openai.reasoning_parsers.abstract_reasoning_parser import (
    ReasoningParser,
)


class Qwen3ReasoningParser(ReasoningParser):
    implicit_end_markers = ("<tool_call>",)

    def missing_end_is_reasoning(self) -> bool:
        return self.chat_template_kwargs.get("enable_thinking", True) is not False
