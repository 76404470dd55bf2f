"""Tool calling and reasoning on ``/v1/chat/completions``: request checks, the JSON-schema
constraint that forces calls, and the per-choice parser that turns generated text into
``content`` / ``reasoning`` / ``tool_calls``, whole or streamed.

vLLM's rules (``vllm/entrypoints/openai/chat_completion/serving.py``,
``vllm/tool_parsers/utils.py``):

- ``tool_choice="auto"`` needs ``--enable-auto-tool-choice`` and ``--tool-call-parser``; the
  parser then finds calls in the text.
- A named choice constrains the reply to the function's ``parameters`` schema; the reply is
  that call's arguments. ``"required"`` constrains it to a JSON array of
  ``{"name", "parameters"}`` items (``anyOf`` over the tools, ``minItems`` 1; ``maxItems`` 1
  when ``parallel_tool_calls`` is false).
- ``finish_reason`` is ``"tool_calls"`` when calls were made under "auto" or "required" and
  the engine stopped on its own, ``"stop"`` for a named call (OpenAI's convention).
- With ``parallel_tool_calls`` false only the first call is returned.
- With a reasoning parser, calls are looked for in the content after the reasoning.
"""

from __future__ import annotations

import json

import jsonschema

from jaxpaged.entrypoints.openai.errors import BadRequestError
from jaxpaged.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, DeltaMessage
from jaxpaged.entrypoints.openai.protocol_tools import ChatCompletionNamedToolChoiceParam
from jaxpaged.entrypoints.openai.reasoning_parsers import ReasoningParser, get_reasoning_parser
from jaxpaged.entrypoints.openai.request_checks import FieldValueError, check_body
from jaxpaged.entrypoints.openai.tool_parsers import (
    ParsedCall,
    ParsedOutput,
    ToolParser,
    get_tool_parser,
)
from jaxpaged.entrypoints.openai.tool_parsers.abstract_tool_parser import parsed_calls
from jaxpaged.entrypoints.openai.tool_parsers.json_scan import (
    scan_call_array,
    skip_whitespace,
    value_end,
)

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def resolve_parsers(
    enable_auto_tool_choice: bool, tool_call_parser: str | None, reasoning_parser: str | None
) -> dict:
    """``OpenAIServingChat`` keywords for the parser flags (``tool_parser``,
    ``reasoning_parser`` classes, None where not asked for).

    Raises:
        ValueError: an unknown parser name (the message lists the known ones), or
            --enable-auto-tool-choice without --tool-call-parser.
    """
    if enable_auto_tool_choice and not tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    return dict(
        tool_parser=get_tool_parser(tool_call_parser) if tool_call_parser else None,
        reasoning_parser=get_reasoning_parser(reasoning_parser) if reasoning_parser else None,
    )


def check_tool_request(
    request: ChatCompletionRequest, *, enable_auto_tools: bool, tool_parser: type | None
) -> None:
    """Refuse what the server cannot do with this request's tools.

    Raises:
        BadRequestError: "auto" without --enable-auto-tool-choice / --tool-call-parser
            (vLLM's message, param ``tool_choice``); a tool whose ``parameters`` is not a
            JSON schema (param ``tools.<i>.function.parameters``).
    """
    if request.tool_choice == "auto" and request.tools and not (enable_auto_tools and tool_parser):
        raise BadRequestError(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to '
            "be set",
            param="tool_choice",
        )
    for i, tool in enumerate(request.tools or ()):
        parameters = tool.function.parameters
        if parameters is None:
            continue
        try:
            jsonschema.validators.validator_for(parameters).check_schema(parameters)
        except jsonschema.SchemaError as error:
            raise BadRequestError(
                f"tools[{i}].function.parameters ({tool.function.name!r}) is not a valid JSON "
                f"schema: {error.message}",
                param=f"tools.{i}.function.parameters",
            ) from None


def tool_constraint_schema(request: ChatCompletionRequest) -> dict | None:
    """The JSON schema a named or "required" tool choice constrains the reply to; None for
    "none" and "auto" (vLLM's ``get_json_schema_from_tools``).

    Raises:
        BadRequestError: two tools define the same ``$defs`` name differently.
    """
    choice = request.tool_choice
    if not request.tools or choice in (None, "none", "auto"):
        return None
    if isinstance(choice, ChatCompletionNamedToolChoiceParam):
        tool = next(t for t in request.tools if t.function.name == choice.function.name)
        return tool.function.parameters or dict(_EMPTY_PARAMETERS)
    items, definitions = [], {}
    for i, tool in enumerate(request.tools):
        parameters = dict(tool.function.parameters or _EMPTY_PARAMETERS)
        # $ref "#/$defs/X" inside a tool's schema must resolve from the array's root.
        for name, schema in parameters.pop("$defs", {}).items():
            if definitions.setdefault(name, schema) != schema:
                raise BadRequestError(
                    f"tools[{i}].function.parameters defines $defs {name!r} differently from "
                    "an earlier tool; a required tool choice needs them to agree",
                    param=f"tools.{i}.function.parameters",
                )
        items.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
            }
        )
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if request.parallel_tool_calls is False:
        schema["maxItems"] = 1
    if definitions:
        schema["$defs"] = definitions
    return schema


def template_messages(conversation: list[dict]) -> list[dict]:
    """Messages as chat templates expect them: an assistant's ``tool_calls[*].function.
    arguments`` as a dict, not OpenAI's JSON text (vLLM's ``chat_utils`` does the same);
    arguments that are not a JSON object a request could carry (``request_checks.check_body``:
    nested too deep, an integer beyond 64 bits) stay text. An assistant's ``reasoning`` is also
    given as ``reasoning_content``, the name templates such as Qwen3's read (vLLM's too)."""
    for message in conversation:
        if message.get("role") == "assistant" and message.get("reasoning") is not None:
            message.setdefault("reasoning_content", message["reasoning"])
        for call in message.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, dict) else None
            arguments = function.get("arguments") if isinstance(function, dict) else None
            if isinstance(arguments, str):
                try:
                    value = json.loads(arguments)
                    check_body(value)
                except (json.JSONDecodeError, RecursionError, FieldValueError):
                    continue
                if isinstance(value, dict):
                    function["arguments"] = value
    return conversation


class NamedToolCall(ToolParser):
    """A named choice's reply: the whole text is the one call's arguments, streamed as they
    come; the finished reply is a call only when they are a whole JSON value (one cut off by
    ``max_tokens`` is no call, as in vLLM)."""

    keeps_special_tokens = False

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def parse(self, text: str, *, final: bool) -> ParsedOutput:
        arguments = text.lstrip()
        if not arguments and not final:
            return ParsedOutput("", [])
        whole = final and value_end(arguments, 0, final=True) == len(arguments.rstrip())
        return ParsedOutput("", [ParsedCall(self.name, arguments, whole)])


class RequiredToolCalls(ToolParser):
    """A "required" choice's reply: ``[{"name": ..., "parameters": {...}}, ...]``. A call is
    sent once its object closes, so a reply cut off by ``max_tokens`` gives its complete calls
    only, whole or streamed."""

    keeps_special_tokens = False

    def parse(self, text: str, *, final: bool) -> ParsedOutput:
        objects, _ = scan_call_array(text, skip_whitespace(text, 0), ("parameters",), final=final)
        return ParsedOutput("", parsed_calls(text, [o for o in objects if o.end is not None]))


def tool_mode_parser(
    request: ChatCompletionRequest, auto_parser: type[ToolParser] | None, tokenizer
) -> ToolParser | None:
    """The parser that reads this request's reply for calls; None: the reply is content.
    ``auto_parser``: the --tool-call-parser class when --enable-auto-tool-choice is on (an
    explicit ``tool_choice: null`` with tools reads as "auto" then, as in vLLM)."""
    choice = request.tool_choice
    if not request.tools or choice == "none":
        return None
    if isinstance(choice, ChatCompletionNamedToolChoiceParam):
        return NamedToolCall(choice.function.name)
    if choice == "required":
        return RequiredToolCalls()
    return auto_parser(tokenizer) if auto_parser is not None else None


class ChatChoiceParser:
    """One choice's reply read as reasoning, content and tool calls (whole or streamed).

    Args:
        request: the chat request (tool choice, ``parallel_tool_calls``,
            ``include_reasoning``).
        tool_parser: from ``tool_mode_parser``; None: no calls are looked for.
        reasoning_parser: a fresh ``ReasoningParser``; None: no reasoning split.
    """

    def __init__(
        self,
        request: ChatCompletionRequest,
        tool_parser: ToolParser | None,
        reasoning_parser: ReasoningParser | None,
    ):
        self.named = isinstance(request.tool_choice, ChatCompletionNamedToolChoiceParam)
        self.single_call = request.parallel_tool_calls is False
        self.include_reasoning = request.include_reasoning
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self._sent_content = 0
        self._sent_reasoning = 0
        self.calls_made = False

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """vLLM's rule: "tool_calls" after calls under "auto" / "required" that ended on
        their own; the engine's reason otherwise (a named call finishes "stop")."""
        if self.calls_made and not self.named and engine_reason == "stop":
            return "tool_calls"
        return engine_reason

    def message(self, text: str) -> ChatMessage:
        """The whole reply of a finished choice."""
        reasoning, content = None, text
        if self.reasoning_parser is not None:
            reasoning, content = self.reasoning_parser.extract_reasoning(text)  # content: None
        if not self.include_reasoning:
            reasoning = None
        if self.tool_parser is None:
            return ChatMessage(role="assistant", content=content, reasoning=reasoning)
        info = self.tool_parser.extract_tool_calls(content or "")
        calls = info.tool_calls[:1] if self.single_call else info.tool_calls
        self.calls_made = bool(calls)
        if self.named or isinstance(self.tool_parser, RequiredToolCalls):
            # vLLM: a forced call's content is ""; a reply cut off before a whole call has
            # neither calls nor content.
            return ChatMessage(
                role="assistant",
                content="" if calls else None,
                tool_calls=calls,
                reasoning=reasoning,
            )
        return ChatMessage(
            role="assistant", content=info.content, tool_calls=calls, reasoning=reasoning
        )

    def delta(self, text: str, *, final: bool) -> DeltaMessage | None:
        """What the reply so far (``text``) adds to what was streamed; None when nothing.
        ``final``: the choice finished (held-back text is released)."""
        reasoning = None
        content_text = text
        if self.reasoning_parser is not None:
            split = self.reasoning_parser.split(text, final=final)
            reasoning = split.reasoning[self._sent_reasoning :]
            self._sent_reasoning = max(self._sent_reasoning, len(split.reasoning))
            content_text = split.content
        if not self.include_reasoning:
            reasoning = None
        tool_calls = None
        if self.tool_parser is None:
            content = content_text[self._sent_content :]
            self._sent_content = max(self._sent_content, len(content_text))
        else:
            piece = self.tool_parser.extract_tool_calls_streaming("", content_text, "", final=final)
            content = piece.content if piece is not None else None
            tool_calls = piece.tool_calls if piece is not None else None
            if tool_calls and self.single_call:
                tool_calls = [call for call in tool_calls if call.index == 0] or None
            self.calls_made = self.calls_made or bool(tool_calls)
        if not reasoning and not content and not tool_calls:
            return None
        return DeltaMessage(reasoning=reasoning, content=content or None, tool_calls=tool_calls)
