"""The tool parser interface: tool calls out of a model's text, whole or streamed.

vLLM's interface (``vllm/tool_parsers/abstract_tool_parser.py``): ``extract_tool_calls`` on a
finished text, ``extract_tool_calls_streaming`` on each new piece of a streamed one. Here a
parser implements one method, ``parse(text, final)``: what the text says so far, as content
plus calls whose name is known once closed and whose arguments text only grows. Both public
methods derive from it: the non-streamed one parses once, the streamed one parses the text
so far and sends what is new since the previous call. So the concatenated stream equals the
non-streamed answer by construction, and a parser has no delta bookkeeping of its own. (One
exception, vLLM's: text after the calls, ``ParsedOutput.trailing``, is streamed as content but
dropped from the non-streamed answer.)

This module builds on ``json_scan`` (which knows nothing of the parser types); ``parsed_calls``
turns its scanned objects into ``ParsedCall``s.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence

from jaxpaged.entrypoints.openai.protocol import DeltaMessage
from jaxpaged.entrypoints.openai.protocol_tools import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from jaxpaged.entrypoints.openai.tool_parsers.json_scan import CallObject, MalformedToolCall


def make_tool_call_id() -> str:
    """A tool call's id, ``chatcmpl-tool-<32 hex>`` as vLLM writes them."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclasses.dataclass
class ParsedCall:
    """One call as far as the text goes: ``name`` None until known (``""`` is a known, empty
    name); ``arguments`` a prefix of the final arguments JSON text; ``complete`` once the
    call's text is closed."""

    name: str | None
    arguments: str
    complete: bool


@dataclasses.dataclass
class ParsedOutput:
    """``content``: the text that is not a call, a prefix of the final content (a possible
    start of a call marker at the end is held back); ``calls`` in order; ``trailing``: text
    after the last call that the format does not read (streamed as content after the calls,
    left out of the non-streamed answer, as vLLM does)."""

    content: str
    calls: list[ParsedCall]
    trailing: str = ""


def parsed_calls(text: str, objects: list[CallObject]) -> list[ParsedCall]:
    """``ParsedCall``s of the call objects ``json_scan`` found in ``text``."""
    return [ParsedCall(o.name, o.arguments(text), o.end is not None) for o in objects]


@dataclasses.dataclass
class ExtractedToolCallInformation:
    """vLLM's result of ``extract_tool_calls``: ``content`` None when empty."""

    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None


def hold_back_marker(text: str, *markers: str) -> str:
    """``text`` without the longest suffix that could be the start of one of ``markers``
    (streamed text stops anywhere, e.g. at ``<tool_`` of ``<tool_call>``)."""
    longest = max(len(marker) for marker in markers) - 1
    for size in range(min(longest, len(text)), 0, -1):
        if any(text.endswith(marker[:size]) for marker in markers if size < len(marker)):
            return text[:-size]
    return text


class ToolParser:
    """Base of the parsers; one instance per streamed choice (it keeps what it has sent).

    Args:
        tokenizer: the server's tokenizer (unused by the text-format parsers here, kept for
            vLLM's constructor shape).
    """

    #: Whether the format's markers are special tokens that detokenization must keep
    #: (vLLM's parsers set ``skip_special_tokens = False`` in ``adjust_request``).
    keeps_special_tokens = True

    def __init__(self, tokenizer=None):
        self.model_tokenizer = tokenizer
        self._sent_content = 0
        self._sent_calls: list[list] = []  # per call: [id, name sent, arguments chars sent]

    def parse(self, text: str, *, final: bool) -> ParsedOutput:
        """Content and calls of ``text``; ``final``: the text is complete (nothing held back).

        Raises:
            MalformedToolCall: the text cannot be this format's calls.
        """
        raise NotImplementedError

    def make_call_id(self) -> str:
        """A new call's ``id`` (vLLM's ``chatcmpl-tool-<32 hex>``; a format may need its own)."""
        return make_tool_call_id()

    def extract_tool_calls(self, model_output: str, request=None) -> ExtractedToolCallInformation:
        """The calls of a finished output. A text that is not well-formed calls (cut off by
        ``max_tokens``, or not the format) is content, with no calls, as in vLLM."""
        try:
            parsed = self.parse(model_output, final=True)
        except MalformedToolCall:
            return ExtractedToolCallInformation(False, [], model_output)
        if not parsed.calls:
            return ExtractedToolCallInformation(False, [], parsed.content or None)
        if not all(c.complete and c.name is not None for c in parsed.calls):
            return ExtractedToolCallInformation(False, [], model_output or None)
        calls = [
            ToolCall(
                id=self.make_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)
            )
            for c in parsed.calls
        ]
        return ExtractedToolCallInformation(True, calls, parsed.content or None)

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int] = (),
        current_token_ids: Sequence[int] = (),
        delta_token_ids: Sequence[int] = (),
        request=None,
        *,
        final: bool = False,
    ) -> DeltaMessage | None:
        """What ``current_text`` adds to what this parser has sent: content, then per call
        first ``{index, id, type, function: {name, arguments: ""}}``, then argument
        fragments. None when nothing is new. ``final`` (an extension of vLLM's signature):
        the output is finished, so held-back text is released. A text that turns out
        malformed stops the calls where they are (what was sent cannot be taken back)."""
        try:
            parsed = self.parse(current_text, final=final)
        except MalformedToolCall:
            return None
        streamed = parsed.content + parsed.trailing
        content = streamed[self._sent_content :]
        self._sent_content = max(self._sent_content, len(streamed))
        deltas = []
        for index, call in enumerate(parsed.calls):
            if call.name is None:
                break  # arguments wait for their name; later calls wait for this one
            if index == len(self._sent_calls):
                self._sent_calls.append([self.make_call_id(), False, 0])
            call_id, name_sent, sent = self._sent_calls[index]
            fragment = call.arguments[sent:]
            if not name_sent:
                function = DeltaFunctionCall(name=call.name, arguments=fragment)
                deltas.append(
                    DeltaToolCall(index=index, id=call_id, type="function", function=function)
                )
            elif fragment:
                deltas.append(
                    DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=fragment))
                )
            self._sent_calls[index][1:] = [True, len(call.arguments)]
        if not content and not deltas:
            return None
        return DeltaMessage(content=content or None, tool_calls=deltas or None)

    @property
    def num_calls_sent(self) -> int:
        """Calls whose name has been streamed."""
        return len(self._sent_calls)
