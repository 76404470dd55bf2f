"""``deepseek_r1``: DeepSeek-R1 and its distills.

Format (DeepSeek-R1's chat template; vLLM's ``deepseek_r1_reasoning_parser.py``): the reply
is ``<think>reasoning</think>content``; newer templates put ``<think>\\n`` in the prompt, so
the reply may start directly with the reasoning. A reply without ``</think>`` was cut off
while thinking: all of it is reasoning. As in vLLM, a reply with no reasoning before
``</think>`` (or an empty reply) has ``reasoning`` ``""``, not None.
"""

from __future__ import annotations

from jaxpaged.entrypoints.openai.reasoning_parsers.abstract_reasoning_parser import (
    ReasoningParser,
)


class DeepSeekR1ReasoningParser(ReasoningParser):
    empty_reasoning_is_none = False
