"""What every endpoint's wire models share: the base classes, the error body, usage and stream
options (the OpenAI API's shapes, as vLLM's ``vllm/entrypoints/openai/protocol.py`` declares
them).

A request body (``OpenAIRequest``) is checked once for what later stages can carry
(``request_checks.check_body``) and refuses a field its model does not declare, naming it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, model_validator

from jaxpaged.entrypoints.openai.request_checks import FieldValueError, check_body


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class OpenAIRequest(OpenAIBaseModel):
    """A request body: its values must be what every later stage can carry (``check_body``),
    and a field this protocol does not declare is refused by name (``FieldValueError``; vLLM
    logs and ignores it)."""

    @model_validator(mode="before")
    @classmethod
    def _carriable_values(cls, data):
        check_body(data)
        if isinstance(data, dict):
            fields = cls.model_fields  # a descriptor: read once, not once per key
            unknown = [k for k in data if k not in fields]
            if unknown:
                raise FieldValueError(
                    f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: not "
                    "part of this endpoint's protocol (vLLM's), and this server refuses what "
                    "it would otherwise ignore",
                    parameter=unknown[0],
                )
        return data


# ------------------------------------------------------------------------------------ errors
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


# ---------------------------------------------------------------------------- shared pieces
class StreamOptions(OpenAIBaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown option is a 400 naming it

    include_usage: bool | None = False
    """With ``stream``: one extra chunk with empty ``choices`` and the usage, before [DONE]
    (vLLM's default: false, so ``{}`` sends no usage)."""
    continuous_usage_stats: bool | None = False
    """With ``stream`` and ``include_usage``: usage (so far) in every chunk as well, the first
    one included."""


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int | None = None
    """Prompt tokens whose KV came from the prefix cache."""


class CompletionTokenUsageInfo(OpenAIBaseModel):
    reasoning_tokens: int = 0
    """Completion tokens spent reasoning (``ReasoningParser.count_reasoning_tokens``)."""


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None
    """With ``--enable-prompt-tokens-details``: ``{"cached_tokens": n}``."""
    completion_tokens_details: CompletionTokenUsageInfo | None = None
    """Chat with ``--reasoning-parser`` (vLLM's rule): ``{"reasoning_tokens": n}``."""
