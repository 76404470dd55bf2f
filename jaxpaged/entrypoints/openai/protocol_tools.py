"""The chat API's tool-calling models: the ``tools`` a request offers, a ``tool_choice`` naming
one function, and the calls a reply carries, whole (``tool_calls``) or streamed in fragments
(OpenAI's shapes, as vLLM's protocol declares them).

How the server uses them (checks, forced choices, parsers): ``chat_tools.py`` and
docs/tool_calling.md.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from jaxpaged.entrypoints.openai.protocol_base import OpenAIBaseModel
from jaxpaged.entrypoints.openai.request_checks import FieldValueError


class FunctionDefinition(OpenAIBaseModel):
    """A tool's function: ``parameters`` is a JSON schema of its arguments (an object)."""

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(OpenAIBaseModel):
    """One entry of ``tools``; only function tools exist in the chat API."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionNamedFunction(OpenAIBaseModel):
    name: str


class ChatCompletionNamedToolChoiceParam(OpenAIBaseModel):
    """``tool_choice`` naming one function: ``{"type": "function", "function": {"name"}}``."""

    function: ChatCompletionNamedFunction
    type: Literal["function"] = "function"


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str
    """The arguments as a JSON text (OpenAI's shape)."""


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    """A streamed tool-call fragment: the first of a call has ``id``, ``type`` and
    ``function.name``; later ones append to ``function.arguments``; ``index`` tells calls
    apart."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


def check_tool_choice_shape(choice) -> None:
    """Refuse a ``tool_choice`` that is none of its forms, naming the field plainly (pydantic's
    union error names its internal path, ``tool_choice.literal['none','auto','required']``).

    Raises:
        FieldValueError: naming ``tool_choice``.
    """
    if choice is None or isinstance(choice, str) and choice in ("none", "auto", "required"):
        return
    named = isinstance(choice, dict) and choice.get("type", "function") == "function"
    function = choice.get("function") if named else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise FieldValueError(
            f'Invalid value for `tool_choice`: {choice!r}; use "none", "auto", "required" '
            'or a named function, `{"type": "function", "function": {"name": "my_function"}}`',
            parameter="tool_choice",
        )
