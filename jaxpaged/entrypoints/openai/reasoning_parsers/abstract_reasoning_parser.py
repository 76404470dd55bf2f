"""The reasoning parser interface: a thinking model's ``<think>…</think>`` out of its reply.

vLLM's interface (``vllm/reasoning/abs_reasoning_parsers.py``): ``extract_reasoning`` on a
finished text returns ``(reasoning, content)``; ``extract_reasoning_streaming`` returns the
delta of each new piece. As with the tool parsers, a parser here implements one method,
``split(text, final)``, and the streamed deltas are what each split adds to the previous one,
so the concatenated stream equals the non-streamed split by construction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxpaged.entrypoints.openai.protocol import DeltaMessage
from jaxpaged.entrypoints.openai.tool_parsers.abstract_tool_parser import hold_back_marker


@dataclasses.dataclass
class Split:
    """``reasoning`` and ``content`` known so far (each a prefix of its final value);
    ``ended``: the end-of-reasoning marker has been seen."""

    reasoning: str
    content: str
    ended: bool


class ReasoningParser:
    """Base: the reasoning is the text between ``start_token`` and ``end_token``.

    Args:
        tokenizer: the server's tokenizer; ``end_token_ids`` encodes the end marker with it.
        chat_template_kwargs: the request's; a parser may read switches such as Qwen3's
            ``enable_thinking``.
    """

    start_token = "<think>"
    end_token = "</think>"
    #: Markers that end the reasoning when they come before ``end_token`` (kept in the
    #: content): Qwen3 may start a tool call without closing its thinking.
    implicit_end_markers: tuple[str, ...] = ()
    #: Whether ``extract_reasoning`` gives None for empty reasoning; vLLM's DeepSeek-R1 parser
    #: gives ``""`` (e.g. for ``</think>rest``), its Qwen3 parser None.
    empty_reasoning_is_none = True

    def __init__(self, tokenizer=None, chat_template_kwargs: dict | None = None):
        self.model_tokenizer = tokenizer
        self.chat_template_kwargs = chat_template_kwargs or {}
        self._sent_reasoning = 0
        self._sent_content = 0

    def missing_end_is_reasoning(self) -> bool:
        """Whether a reply without ``end_token`` is all reasoning (True: it was cut off while
        thinking) or all content (False: the model did not think)."""
        return True

    def split(self, text: str, *, final: bool) -> Split:
        """Reasoning and content of ``text``; unless ``final``, a possible start of a marker at
        the end is held back, and so is whitespace that may precede ``start_token``. A
        leading ``start_token`` is dropped (templates that put it in the prompt leave only
        ``end_token`` in the reply)."""
        if not final and self.start_token.startswith(text.lstrip()):
            return Split("", "", False)  # may be (whitespace before) the start marker: wait
        before, found, after = text.partition(self.start_token)
        if found and not before.strip():
            text = after
        thinking = self.missing_end_is_reasoning()
        markers = (self.end_token, *self.implicit_end_markers) if thinking else (self.end_token,)
        where, marker = min(
            ((text.find(m), m) for m in markers if m in text), default=(-1, self.end_token)
        )
        if where >= 0:
            kept = 0 if marker == self.end_token else len(marker)  # an implicit end is content
            return Split(text[:where], text[where + len(marker) - kept :], True)
        held = text if final else hold_back_marker(text, *markers)
        return Split(held, "", False) if thinking else Split("", held, False)

    def extract_reasoning(self, model_output: str, request=None) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a finished reply; content None when empty, reasoning
        too unless ``empty_reasoning_is_none`` is off (then only when there is no thinking)."""
        split = self.split(model_output, final=True)
        thinking = self.missing_end_is_reasoning() or split.ended
        empty = None if self.empty_reasoning_is_none or not thinking else ""
        return split.reasoning or empty, split.content or None

    def extract_reasoning_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int] = (),
        current_token_ids: Sequence[int] = (),
        delta_token_ids: Sequence[int] = (),
        *,
        final: bool = False,
    ) -> DeltaMessage | None:
        """What ``current_text`` adds: ``reasoning`` and/or ``content``; None when nothing.
        ``final`` (an extension of vLLM's signature): release held-back text."""
        split = self.split(current_text, final=final)
        reasoning = split.reasoning[self._sent_reasoning :]
        content = split.content[self._sent_content :]
        self._sent_reasoning = max(self._sent_reasoning, len(split.reasoning))
        self._sent_content = max(self._sent_content, len(split.content))
        if not reasoning and not content:
            return None
        return DeltaMessage(reasoning=reasoning or None, content=content or None)

    def end_token_ids(self) -> list[int]:
        """``end_token``'s token ids (one id where it is a special token): structured output
        starts after the reply contains them."""
        if self.model_tokenizer is None:
            raise ValueError("a reasoning parser needs the tokenizer to find its end token")
        return list(self.model_tokenizer.encode(self.end_token, add_special_tokens=False))

    def count_reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        """Output tokens spent reasoning (``usage.completion_tokens_details.reasoning_tokens``):
        those before the end marker or an implicit end, after a leading start marker, the
        markers not counted; a reply with no end counts whole if it is reasoning
        (``missing_end_is_reasoning``), else 0. The markers are found as token ids (a thinking
        model's are special tokens, one id each). vLLM's DeepSeek-R1 parser counts only
        tokens between a ``<think>`` and a ``</think>`` of the output: 0 where the template
        opens the thinking in the prompt; here those tokens count."""
        ids = list(token_ids)
        start = self.model_tokenizer.encode(self.start_token, add_special_tokens=False)
        begin = len(start) if start and ids[: len(start)] == start else 0
        end, implicit = self.end_token_ids(), set(self.implicit_end_token_ids())
        for i in range(begin, len(ids)):
            if ids[i] in implicit or ids[i : i + len(end)] == end:
                return i - begin
        return len(ids) - begin if self.missing_end_is_reasoning() else 0

    def implicit_end_token_ids(self) -> list[int]:
        """The ids of ``implicit_end_markers`` that are one token of the vocabulary (Qwen3's
        ``<tool_call>``), where structured output starts at that token; a marker the
        vocabulary spells in several tokens has none (vLLM's reasoners know their ends only
        as token ids)."""
        tokenizer = self.model_tokenizer
        if tokenizer is None or not self.missing_end_is_reasoning():
            return []
        ids = []
        for marker in self.implicit_end_markers:
            token_id = tokenizer.convert_tokens_to_ids(marker)
            if token_id is not None and tokenizer.convert_ids_to_tokens(token_id) == marker:
                ids.append(token_id)
        return ids
