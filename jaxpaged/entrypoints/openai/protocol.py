"""Pydantic models of the OpenAI-compatible wire format (requests, responses, stream chunks).

Field names, defaults and shapes follow the OpenAI API and vLLM's
``vllm/entrypoints/openai/protocol.py``: vLLM-only sampling knobs (``top_k``, ``min_p``,
``ignore_eos``, ``stop_token_ids``, ...) ride in the request body. Every field of vLLM's
completion and chat requests is declared here; the handlers honour it or, for a value other
than its neutral one, answer 400 naming it (``serving_engine.UNSUPPORTED_FIELDS``). A top-level
field this protocol does not declare is a 400 naming it as well: where vLLM logs and ignores
it, nothing a client sends is silently dropped here. (Messages keep their extra keys, such as
``tool_calls``: the chat template reads them.)
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    field_validator,
    model_serializer,
    model_validator,
)

from jaxpaged.entrypoints.openai.request_checks import FieldValueError, check_body
from jaxpaged.sequence import is_token_id_list


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


# vLLM's bounds of 64-bit request integers (``seed``, ``priority``).
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


class _SamplingFields(OpenAIRequest):
    """Fields shared by completions and chat: OpenAI's, then vLLM's extras (sampling, then
    request options). Unsupported ones are declared with vLLM's defaults so that a non-neutral
    value is refused by name (``serving_engine.UNSUPPORTED_FIELDS``)."""

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    """Any 64-bit integer (vLLM's range); -1 or None: the engine's seed."""
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=INT64_MAX)
    """Keep only k tokens of the prompt (``truncation_side``), before the length check; -1:
    ``max_model_len`` tokens (vLLM's); 0 is refused (no prompt would be left)."""
    truncation_side: Literal["left", "right"] | None = None
    """With ``truncate_prompt_tokens``: "left" (default) keeps the last k tokens, "right" the
    first k."""
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[str] | None = None
    """Words never generated; each must be one token (``SamplingParams.bad_words``)."""
    prompt_logprobs: int | None = None
    """Logprobs of each prompt token and its top k; -1: the whole vocabulary."""
    logprob_token_ids: Annotated[list[StrictInt], Field(min_length=1)] | None = None
    """vLLM's: logprobs of these token ids at each generated position (with the sampled
    token's) instead of the top-k; needs ``logprobs`` (chat: ``logprobs: true``)."""
    return_tokens_as_token_ids: bool | None = None
    """With logprobs: tokens are written ``token_id:<id>`` (for tokens JSON cannot carry);
    None: the server's ``--return-tokens-as-token-ids``."""
    return_token_ids: bool | None = None
    """Add ``prompt_token_ids`` and each choice's ``token_ids`` to the response (streamed:
    prompt ids in the first chunk, each chunk's new ids)."""
    request_id: str | None = None
    """The response's id becomes ``<cmpl|chatcmpl>-<request_id>``; None: a random one."""
    # Structured outputs (entrypoints/openai/structured_outputs.py): at most one of
    # structured_outputs, guided_json / _regex / _choice / _grammar, structural_tag and a
    # response_format other than text.
    structured_outputs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structural_tag: str | None = None
    # Refused unless neutral (serving_engine.UNSUPPORTED_FIELDS):
    use_beam_search: bool = False
    length_penalty: float = 1.0
    priority: int = 0
    logits_processors: list[Any] | None = None
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    # Later vLLM releases' fields, refused unless neutral as well:
    watermarking: bool | None = None
    ec_transfer_params: dict[str, Any] | None = None
    repetition_detection: dict[str, Any] | None = None
    thinking_token_budget: int | None = None
    stream_interval: int | None = None
    session_id: str | None = None
    routed_experts_prompt_start: int = 0
    return_token_offsets: bool | None = False
    return_mm_kwargs: bool = True

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise FieldValueError(
                "stream_options can only be set when stream is true", parameter="stream_options"
            )
        if self.stream and self.prompt_logprobs is not None:
            # vLLM's rule: prompt logprobs come with the whole response only.
            raise FieldValueError(
                "prompt_logprobs are not available when stream is true",
                parameter="prompt_logprobs",
            )
        if self.prompt_logprobs is not None and self.prompt_logprobs < -1:
            raise FieldValueError(
                f"prompt_logprobs must be a non-negative value or -1, got {self.prompt_logprobs}",
                parameter="prompt_logprobs",
            )
        if self.truncate_prompt_tokens == 0:
            raise FieldValueError(
                "truncate_prompt_tokens must be at least 1 or -1 (max_model_len), got 0",
                parameter="truncate_prompt_tokens",
            )
        if self.logprob_token_ids is not None and self.use_beam_search:
            raise FieldValueError(
                "logprob_token_ids is not supported with beam search",
                parameter="logprob_token_ids",
            )
        return self


# ------------------------------------------------------------------------------ completions
class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: a string, strings, token ids, or lists of ids."""

    # Token ids before strings: pydantic's smart union tries the members in order, and a
    # list of 128 ids failing as list[str] first cost 20 us of error building per request.
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]] | None = None
    """Required unless ``prompt_embeds`` is given (which this server refuses by name)."""
    max_tokens: int | None = 16
    """Tokens to generate; 0 only with ``echo`` (prompt scoring: the prompt and its logprobs
    come back, nothing is generated)."""
    echo: bool = False
    logprobs: int | None = None
    """Top logprobs per token (the sampled token's too, listed first); -1: the whole
    vocabulary, where ``--max-logprobs`` allows it."""
    suffix: str | None = None
    add_special_tokens: bool = True
    """Add the tokenizer's special tokens (BOS) to text prompts."""
    prompt_embeds: Any = None

    @model_validator(mode="before")
    @classmethod
    def _prompt_or_embeds(cls, data):
        # vLLM's check and message (its tests match it): "" counts as no prompt, [] as no
        # embeddings.
        if isinstance(data, dict):
            prompt, embeds = data.get("prompt"), data.get("prompt_embeds")
            if (prompt is None or prompt == "") and (embeds is None or embeds == []):
                raise FieldValueError(
                    "Either prompt or prompt_embeds must be provided and non-empty.",
                    parameter="prompt",
                )
        return data

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value):
        # One clear message instead of pydantic's one error per member of the union.
        if isinstance(value, str):
            return value
        if isinstance(value, list) and (
            is_token_id_list(value)
            or all(isinstance(v, str) for v in value)
            or all(isinstance(v, list) and is_token_id_list(v) for v in value)
        ):
            return value
        raise ValueError(
            "must be a string, a list of strings, a list of token ids or a list of token-id lists"
        )

    @model_validator(mode="after")
    def _check_completion_fields(self):
        if self.logprobs is not None and self.logprobs < -1:
            raise FieldValueError(
                f"logprobs must be a non-negative value or -1, got {self.logprobs}",
                parameter="logprobs",
            )
        if self.max_tokens is not None and self.max_tokens < (0 if self.echo else 1):
            raise FieldValueError(
                f"max_tokens must be at least 1, got {self.max_tokens} (0 is allowed with echo: "
                "prompt scoring)",
                parameter="max_tokens",
            )
        if self.logprob_token_ids is not None:
            if self.logprobs is None:
                raise FieldValueError(
                    "logprob_token_ids needs logprobs to be set", parameter="logprob_token_ids"
                )
            if self.echo and self.max_tokens == 0:
                raise FieldValueError(
                    "logprob_token_ids is not supported with echo and max_tokens 0 (no tokens "
                    "are generated)",
                    parameter="logprob_token_ids",
                )
        return self


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIBaseModel):
    """One entry of ``prompt_logprobs`` (vLLM's ``Logprob``, serialized)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt token: {token id: PromptLogprob} with the prompt token and the top k; the first
# token has none (null). JSON object keys are the ids as strings.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    """With ``return_token_ids``: the generated ids (vLLM puts them on each choice)."""
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    """With ``return_token_ids``: the prompt's ids; the key is always present (null)."""


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    """With ``return_token_ids``: the prompt's ids, in the choice's first chunk only."""
    token_ids: list[int] | None = None
    """With ``return_token_ids``: this chunk's new ids."""


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ------------------------------------------------------------------------------------- chat
class ChatMessageParam(OpenAIBaseModel):
    """One input message; ``content`` may be text or a list of ``{"type": "text", ...}`` parts.
    An assistant message may carry ``tool_calls`` (OpenAI's shape, ``arguments`` a JSON string)
    and a tool result ``tool_call_id``; these and other fields pass through to the chat
    template (``chat_tools.template_message``)."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None
    """An assistant message's reasoning; the deprecated ``reasoning_content`` is renamed to it
    (a ``reasoning`` given as well wins), as vLLM does."""

    @model_validator(mode="before")
    @classmethod
    def _rename_reasoning_content(cls, data):
        if isinstance(data, dict) and "reasoning_content" in data:
            data = dict(data)
            reasoning_content = data.pop("reasoning_content")
            if data.get("reasoning") is None:
                data["reasoning"] = reasoning_content
        return data


# ------------------------------------------------------------------------------------ tools
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


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: int | None = None
    """Deprecated by OpenAI in favour of max_completion_tokens; None: fill the context."""
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    """Alternatives per token with ``logprobs``; -1: the whole vocabulary (vLLM's)."""
    tools: list[ChatCompletionToolsParam] | None = None
    """Functions the model may call (``chat_tools``); the chat template renders them."""
    tool_choice: Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam | None = (
        "none"
    )
    """"none": never call; "auto": the tool parser finds calls in the text (needs
    --enable-auto-tool-choice); "required" or a named function: a JSON-schema constraint
    forces calls. Default: "auto" when ``tools`` are given, else "none" (vLLM's rule)."""
    parallel_tool_calls: bool | None = True
    """False: at most one call per reply."""
    reasoning_effort: str | None = None
    include_reasoning: bool = True
    """With --reasoning-parser: False drops ``reasoning`` from the reply."""
    echo: bool = False
    """Prepend the last message's content to the reply when it is the assistant's."""
    add_special_tokens: bool = False
    """Add the tokenizer's special tokens on top of what the chat template writes."""
    documents: list[dict[str, str]] | None = None
    """Passed to the chat template (retrieval-augmented generation templates use it)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_prompt_text: bool | None = None  # refused unless neutral (UNSUPPORTED_FIELDS)
    media_io_kwargs: dict[str, Any] | None = None  # no multimodal inputs

    @model_validator(mode="before")
    @classmethod
    def _default_tool_choice(cls, data):
        # vLLM's rules: ``tools: []`` is no tools (OpenAI's), so "auto" / "required" have
        # nothing to call and read as "none" (a named choice keeps [] and is refused by
        # name); tools without tool_choice mean "auto".
        if not isinstance(data, dict):
            return data
        if data.get("tools") == [] and not isinstance(data.get("tool_choice"), dict):
            data = {**data, "tools": None}
            if data.get("tool_choice") in ("auto", "required"):
                data["tool_choice"] = "none"
        if data.get("tools") and "tool_choice" not in data:
            data = {**data, "tool_choice": "auto"}
        _check_tool_choice_shape(data.get("tool_choice"))
        return data

    @model_validator(mode="after")
    def _check_chat_fields(self):
        if self.top_logprobs is not None and self.top_logprobs < -1:
            raise FieldValueError(
                f"top_logprobs must be a non-negative value or -1, got {self.top_logprobs}",
                parameter="top_logprobs",
            )
        if self.top_logprobs is not None and self.top_logprobs != 0 and not self.logprobs:
            raise FieldValueError(
                "top_logprobs requires logprobs to be true", parameter="top_logprobs"
            )
        if self.logprob_token_ids is not None and not self.logprobs:
            raise FieldValueError(
                "logprob_token_ids needs logprobs to be true", parameter="logprob_token_ids"
            )
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
        self._check_tools()
        return self

    def _check_tools(self) -> None:
        """vLLM's tool rules (``check_tool_usage``): a ``tool_choice`` other than "none" needs
        ``tools``, a named choice must name one of them; function names are unique (a call
        names its function)."""
        names = [tool.function.name for tool in self.tools or ()]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise FieldValueError(
                f"tools: function names must be unique, and {repeated} appear more than once",
                parameter="tools",
            )
        choice = self.tool_choice
        if choice is None or choice == "none":
            return
        if self.tools is None:
            raise FieldValueError(
                "When using `tool_choice`, `tools` must be set.", parameter="tool_choice"
            )
        if isinstance(choice, ChatCompletionNamedToolChoiceParam):
            if choice.function.name not in names:
                raise FieldValueError(
                    f"The tool `{choice.function.name}` specified in `tool_choice` does not "
                    f"match any of the specified `tools` ({names})",
                    parameter="tool_choice",
                )


def _check_tool_choice_shape(choice) -> None:
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


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    """Left out of the JSON when empty (vLLM's serializer)."""
    reasoning: str | None = None
    """The text between ``<think>`` and ``</think>`` with --reasoning-parser (vLLM's field
    name since it retired ``reasoning_content``)."""

    @model_serializer(mode="wrap")
    def _drop_empty_tool_calls(self, handler):
        data = handler(self)
        if not data.get("tool_calls"):
            data.pop("tool_calls", None)
        return data


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    """With ``return_token_ids``: the generated ids."""


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    """With ``return_token_ids``: the rendered prompt's ids (vLLM: on the response, not the
    choices)."""


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    """With ``return_token_ids``: this chunk's new ids."""


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
    """With ``return_token_ids``: the prompt's ids, in the first chunk only."""


# ----------------------------------------------------------------------------------- models
class ModelPermission(OpenAIBaseModel):
    id: str
    object: str = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(OpenAIBaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "jaxpaged"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=list)


class ModelList(OpenAIBaseModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


# ------------------------------------------------------------------------- (de)tokenization
class TokenizeRequest(OpenAIRequest):
    """``POST /tokenize``: either ``prompt`` (text) or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_special_tokens: bool | None = None
    """Default: True for ``prompt``, False for ``messages`` (the template adds them)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionToolsParam] | None = None
    """With ``messages``: passed to the chat template, as on ``/v1/chat/completions``."""
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _exactly_one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
