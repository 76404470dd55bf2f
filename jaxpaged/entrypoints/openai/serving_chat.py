"""``POST /v1/chat/completions``: render the chat template, then generate like a completion.

vLLM's rules (``vllm/entrypoints/openai/serving_chat.py``, ``vllm/entrypoints/chat_utils.py``):
the messages are rendered to text with the request's ``chat_template``, else the server's
``--chat-template``, else the tokenizer's own; the text is tokenized *without* adding special
tokens (the template writes them). Text content parts are joined with newlines. When streaming,
each choice first gets a chunk whose delta is ``{"role": "assistant", "content": ""}``, then
content deltas, the last with ``finish_reason``. Tool calls and reasoning (``chat_tools``): the
reply is read by a per-choice ``ChatChoiceParser``, streamed as ``reasoning`` / ``content`` /
``tool_calls`` deltas.

A request's own ``chat_template`` is a client's program: it is rendered in a sandboxed worker
process with limits on time, memory, output and ``range`` (``template_sandbox.py``); a failure
is a 400. The server's and the tokenizer's templates are the operator's and render in process
(transformers' ``apply_chat_template``).
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Sequence

import jinja2
from fastapi.responses import StreamingResponse

from jaxpaged.engine_core.core_client import RequestStream
from jaxpaged.entrypoints.openai.chat_tools import (
    ChatChoiceParser,
    check_tool_request,
    template_messages,
    tool_constraint_schema,
    tool_mode_parser,
)
from jaxpaged.entrypoints.openai.errors import (
    BadRequestError,
    ServiceUnavailableError,
    error_from_exception,
)
from jaxpaged.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatMessageParam,
    CompletionTokenUsageInfo,
    DeltaMessage,
    UsageInfo,
)
from jaxpaged.entrypoints.openai.serving_engine import OpenAIServing, stable_text
from jaxpaged.entrypoints.openai.sse import SSE_DONE, DeltaFrames, sse, sse_error
from jaxpaged.entrypoints.openai.structured_outputs import structured_outputs_from_request
from jaxpaged.entrypoints.openai.template_sandbox import (
    TemplateLimitError,
    TemplateQueueFullError,
    TemplateSandbox,
)
from jaxpaged.sampling_params import StructuredOutputsParams


def load_chat_template(chat_template: str | None) -> str | None:
    """``--chat-template``: a file path (read) or an inline Jinja template (kept as is).

    Raises:
        ValueError: the value is neither an existing file nor looks like Jinja.
    """
    if chat_template is None:
        return None
    if os.path.isfile(chat_template):
        with open(chat_template, encoding="utf-8") as f:
            return f.read()
    if any(marker in chat_template for marker in ("{{", "{%", "\n")):
        return chat_template
    raise ValueError(
        f"chat_template must be a file path or an inline Jinja template, got "
        f"{chat_template!r} (no such file, and no '{{{{' or '{{%' in it)"
    )


class OpenAIServingChat(OpenAIServing):
    """The chat endpoint.

    Args:
        chat_template: the server-wide template text (or None).
        enable_auto_tool_choice: ``--enable-auto-tool-choice``: "auto" tool choice is served.
        tool_parser: the ``--tool-call-parser`` class (``tool_parsers.get_tool_parser``).
        reasoning_parser: the ``--reasoning-parser`` class
            (``reasoning_parsers.get_reasoning_parser``).
        template_sandbox: renders requests' own templates (None: a ``TemplateSandbox`` with
            its default limits); closed by ``close``.
    """

    def __init__(
        self,
        *args,
        chat_template: str | None = None,
        enable_auto_tool_choice: bool = False,
        tool_parser: type | None = None,
        reasoning_parser: type | None = None,
        template_sandbox: TemplateSandbox | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.chat_template = chat_template
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        # "auto" reads calls only with --enable-auto-tool-choice (vLLM's rule).
        self._auto_tool_parser = tool_parser if enable_auto_tool_choice else None
        # Its workers start on first use.
        self.template_sandbox = template_sandbox or TemplateSandbox()

    def close(self) -> None:
        """Stop the template sandbox's worker process (if it runs)."""
        self.template_sandbox.close()

    async def render_messages(
        self,
        messages: Sequence[ChatMessageParam],
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        documents: list[dict] | None = None,
        tools: list[dict] | None = None,
    ) -> str:
        """The prompt text for ``messages``; ``tools`` (OpenAI's tool dicts) are passed to
        the template, which may render them (vLLM passes them the same way).

        Raises:
            BadRequestError: no template anywhere, a non-text content part, a template error,
                or a request's template breaking a sandbox limit.
            ServiceUnavailableError: the sandbox's queue is full (503 with ``Retry-After``).
        """
        self.require_tokenizer("a chat request")
        # A request's template is inline Jinja only: reading a path a client names would let
        # it render any server file into a prompt.
        template = (
            chat_template or self.chat_template or getattr(self.tokenizer, "chat_template", None)
        )
        if not template:
            raise BadRequestError(
                "this model's tokenizer has no chat template: start the server with "
                "--chat-template or send chat_template in the request",
                param="messages",
            )
        conversation = template_messages([_message_dict(m, i) for i, m in enumerate(messages)])
        if chat_template:  # the client's own program: sandboxed, in a worker process
            try:
                return await self._render_sandboxed(
                    chat_template,
                    conversation,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    documents=documents,
                    tools=tools,
                    chat_template_kwargs=chat_template_kwargs or {},
                )
            except TemplateLimitError as error:
                raise BadRequestError(str(error), param="chat_template") from error
            except TemplateQueueFullError as error:
                raise ServiceUnavailableError(str(error)) from error
        try:
            return self.tokenizer.apply_chat_template(
                conversation,
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                documents=documents,
                tools=tools,
                tokenize=False,
                **(chat_template_kwargs or {}),
            )
        except (jinja2.TemplateError, ValueError, TypeError, OverflowError) as error:
            raise BadRequestError(
                f"the chat template failed on these messages: {error}", param="messages"
            ) from error

    async def _render_sandboxed(
        self,
        template: str,
        conversation: list[dict],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        documents,
        tools: list[dict] | None,
        chat_template_kwargs: dict,
    ) -> str:
        """What ``apply_chat_template(tokenize=False)`` gives, rendered by the sandbox: the
        template sees the tokenizer's special tokens, ``chat_template_kwargs``, ``messages``,
        ``tools``, ``documents`` and ``add_generation_prompt``; ``continue_final_message``
        cuts the text after the last message, as transformers does (a marker after it).

        Raises:
            TemplateLimitError: the sandbox's, or the final message lost by the template.
        """
        if continue_final_message:
            conversation = [dict(m) for m in conversation]
            final = conversation[-1]["content"]
            conversation[-1]["content"] = final + _CONTINUE_MARK
        special = {
            key: value
            for key, value in getattr(self.tokenizer, "special_tokens_map", {}).items()
            if isinstance(value, (str, list))
        }
        context = {
            **special,
            **chat_template_kwargs,
            "messages": conversation,
            "tools": tools,
            "documents": documents,
            "add_generation_prompt": add_generation_prompt,
        }
        text = await self.template_sandbox.render_async(template, context)
        if continue_final_message:
            where = text.rfind(_CONTINUE_MARK.strip())
            if where < 0 or final.strip() not in text:
                raise TemplateLimitError(
                    "continue_final_message is set but the chat template dropped the final message"
                )
            if text[where : where + len(_CONTINUE_MARK)] == _CONTINUE_MARK:
                text = text[:where]
            else:  # the template trimmed the spacing after the message
                text = text[:where].rstrip()
        return text

    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> ChatCompletionResponse | StreamingResponse:
        """Validate, render, submit and answer (or stream) one chat completion.

        Raises:
            NotFoundError: unknown ``model``.
            BadRequestError / ValueError: invalid parameters or messages (HTTP 400).
            QueueFullError: the waiting queue is full (HTTP 429).
        """
        arrival_time = time.monotonic()
        lora_request = self.check_model(request.model)
        self.check_supported(request)
        check_tool_request(
            request, enable_auto_tools=self.enable_auto_tool_choice, tool_parser=self.tool_parser
        )
        prompt_text = await self.render_messages(
            request.messages,
            chat_template=request.chat_template,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template_kwargs=request.chat_template_kwargs,
            documents=request.documents,
            tools=[tool.model_dump(exclude_none=True) for tool in request.tools]
            if request.tools
            else None,
        )
        self.check_text_fits(prompt_text, request, "messages")
        # The template writes the special tokens; add_special_tokens adds the tokenizer's too.
        prompt_text, ids = self.truncate(
            (
                prompt_text,
                await self.encode(prompt_text, add_special_tokens=request.add_special_tokens),
            ),
            request,
        )
        max_tokens = request.max_completion_tokens
        if max_tokens is None:
            max_tokens = request.max_tokens
        self.check_length(len(ids), max_tokens, "messages")
        values = self.common_sampling_values(request)
        values["max_tokens"] = (
            max_tokens if max_tokens is not None else self.max_model_len - len(ids)
        )
        values["logprobs"] = (
            (request.top_logprobs or 0)
            if request.logprobs and not request.logprob_token_ids
            else None
        )
        if request.echo and request.prompt_logprobs is None and request.logprobs:
            values["prompt_logprobs"] = request.top_logprobs or 0  # vLLM's rule
        structured_field = self._constraint_values(request, values)
        params = self.sampling_params(values)
        request_id = self.response_id("chatcmpl", request)
        (stream,) = await self.add_requests(
            request_id,
            [(prompt_text, ids)],
            [params],
            arrival_time,
            lora_request,
            structured_field=structured_field,
        )
        model = self.response_model(lora_request)
        if request.stream:
            return StreamingResponse(
                self._stream(request, request_id, model, stream), media_type="text/event-stream"
            )
        return await self._full(request, request_id, model, stream)

    def _constraint_values(self, request: ChatCompletionRequest, values: dict) -> str | None:
        """Set the request's constraint in ``values``; returns the request field it came from
        (for the engine's errors), None when unconstrained.

        A named or "required" tool choice constrains the reply to a JSON schema built from the
        tools (vLLM's rule), and refuses a second constraint from the request (vLLM refuses
        it for a named choice and overrides it for "required"; here neither is silently
        dropped). With --reasoning-parser any constraint starts after the reasoning. A parser
        whose markers are special tokens needs them kept in the text.

        Raises:
            BadRequestError: a tool choice and a structured-output field together.
        """
        field = structured_outputs_from_request(request)[1]
        schema = tool_constraint_schema(request)
        if schema is not None:
            if field is not None:
                raise BadRequestError(
                    "You can only either use constraints for structured outputs or tools, not "
                    f'both: {field} cannot be combined with a named or "required" tool_choice',
                    param=field,
                )
            values["structured_outputs"] = StructuredOutputsParams(json=schema)
            field = "tools"
        constraint = values.get("structured_outputs")
        end_ids = self.reasoning_end_token_ids(request) if constraint is not None else None
        if end_ids is not None and constraint.reasoning_end_token_ids is None:
            constraint.reasoning_end_token_ids, implicit = end_ids
            constraint.reasoning_implicit_end_token_ids = implicit or None
        parser = tool_mode_parser(request, self._auto_tool_parser, self.tokenizer)
        if parser is not None and parser.keeps_special_tokens:
            values["skip_special_tokens"] = False
        return field

    def reasoning_end_token_ids(self, request: ChatCompletionRequest) -> tuple | None:
        """With --reasoning-parser, ``(end ids, implicit end ids)``: a constraint starts after
        the first, or at one of the second (None: no parser, or thinking switched off)."""
        if self.reasoning_parser is None:
            return None
        parser = self.reasoning_parser(
            self.tokenizer, chat_template_kwargs=request.chat_template_kwargs
        )
        if not parser.missing_end_is_reasoning():
            return None
        return parser.end_token_ids(), parser.implicit_end_token_ids()

    def chat_usage(self, request: ChatCompletionRequest, output) -> UsageInfo:
        """``usage`` of ``output``; with --reasoning-parser (vLLM's rule: the parser alone
        decides) also ``completion_tokens_details.reasoning_tokens`` over its choices."""
        usage = self.usage([output])
        if self.reasoning_parser is not None and output is not None:
            parser = self.reasoning_parser(
                self.tokenizer, chat_template_kwargs=request.chat_template_kwargs
            )
            count = sum(parser.count_reasoning_tokens(c.token_ids) for c in output.outputs)
            usage.completion_tokens_details = CompletionTokenUsageInfo(reasoning_tokens=count)
        return usage

    def choice_parser(self, request: ChatCompletionRequest) -> ChatChoiceParser | None:
        """A fresh reader of one choice's reply; None when the reply is plain content."""
        tool_parser = tool_mode_parser(request, self._auto_tool_parser, self.tokenizer)
        reasoning_parser = None
        if self.reasoning_parser is not None:
            reasoning_parser = self.reasoning_parser(
                self.tokenizer, chat_template_kwargs=request.chat_template_kwargs
            )
        if tool_parser is None and reasoning_parser is None:
            return None
        return ChatChoiceParser(request, tool_parser, reasoning_parser)

    def _logprobs(self, request, completion, start: int):
        if not request.logprobs or completion.logprobs is None:
            return None
        # logprob_token_ids: every requested id is an alternative (vLLM's return_all).
        num_top = None if request.logprob_token_ids else request.top_logprobs or 0
        return self.chat_logprobs(
            completion.token_ids[start:],
            completion.logprobs[start:],
            num_top,
            self.as_token_ids(request),
        )

    @staticmethod
    def _echo(request: ChatCompletionRequest) -> str:
        """With ``echo``: the last message's text when it is the assistant's (the reply
        continues it; vLLM's rule), else ""."""
        if not request.echo or not request.messages:
            return ""
        last = request.messages[-1]
        if last.role != "assistant":
            return ""
        return _message_dict(last, len(request.messages) - 1)["content"]

    async def _full(
        self, request: ChatCompletionRequest, request_id: str, model: str, stream: RequestStream
    ) -> ChatCompletionResponse:
        final = None
        try:
            async for output in stream:
                final = output
        finally:
            stream.close()
        echo = self._echo(request)
        choices = []
        for completion in final.outputs:
            parser = self.choice_parser(request)
            finish_reason = completion.finish_reason
            if parser is None:
                message = ChatMessage(role="assistant", content=completion.text)
            else:
                message = parser.message(completion.text)
                finish_reason = parser.finish_reason(finish_reason)
            if echo:
                message.content = echo + (message.content or "")
            choices.append(
                ChatCompletionResponseChoice(
                    index=completion.index,
                    message=message,
                    logprobs=self._logprobs(request, completion, 0),
                    finish_reason=finish_reason,
                    stop_reason=completion.stop_reason,
                    token_ids=list(completion.token_ids) if request.return_token_ids else None,
                )
            )
        return ChatCompletionResponse(
            id=request_id,
            model=model,
            choices=choices,
            usage=self.chat_usage(request, final),
            prompt_logprobs=self.prompt_logprobs(final),
            prompt_token_ids=list(final.prompt_token_ids) if request.return_token_ids else None,
        )

    async def _stream(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        model: str,
        stream: RequestStream,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        options = request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous_usage = include_usage and bool(options.continuous_usage_stats)
        return_ids = bool(request.return_token_ids)
        plain = not (continuous_usage or return_ids)  # the fast chunk path

        def chunk(choices, usage=None, prompt_token_ids=None) -> str:
            response = ChatCompletionStreamResponse(
                id=request_id, created=created, model=model, choices=choices
            )
            data = response.model_dump()
            for choice, model_choice in zip(data["choices"], choices, strict=True):
                # A delta carries only what it adds (role first, then content), as OpenAI's do.
                choice["delta"] = model_choice.delta.model_dump(exclude_none=True)
                if not return_ids:
                    del choice["token_ids"]
            if usage is None:
                del data["usage"]
            else:
                data["usage"] = usage.model_dump(exclude_none=True)
            if prompt_token_ids is None:
                del data["prompt_token_ids"]
            else:
                data["prompt_token_ids"] = list(prompt_token_ids)
            return sse(data)

        def running_usage(output, completion_tokens: int) -> UsageInfo:
            prompt_tokens = len(output.prompt_token_ids)
            return UsageInfo(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens,
            )

        sent_text: dict[int, str] = {}
        sent_tokens: dict[int, int] = {}
        done: set[int] = set()  # choices whose finish_reason was sent (once each)
        echo = self._echo(request)
        final = None
        # The per-token events, cut from ``chunk``'s own event (sse.DeltaFrames).
        probe = ChatCompletionResponseStreamChoice(
            index=DeltaFrames.INDEX,
            delta=DeltaMessage(content=DeltaFrames.TEXT),
            finish_reason=DeltaFrames.FINISH,
            stop_reason=DeltaFrames.STOP,
        )
        frames = DeltaFrames.from_probe(chunk([probe])) if plain else None
        parsers: dict[int, ChatChoiceParser | None] = {}
        try:
            first_output = None
            if continuous_usage or return_ids:
                # The first chunk carries the prompt's usage / ids: wait for the core's first
                # output, which knows them.
                async for output in stream:
                    first_output = output
                    break
            for index in range(request.n):
                yield chunk(
                    [
                        ChatCompletionResponseStreamChoice(
                            index=index,
                            delta=DeltaMessage(role="assistant", content=""),
                            token_ids=[] if return_ids else None,
                        )
                    ],
                    usage=(
                        running_usage(first_output, 0)
                        if continuous_usage and first_output is not None
                        else None
                    ),
                    prompt_token_ids=(
                        first_output.prompt_token_ids
                        if return_ids and index == 0 and first_output is not None
                        else None
                    ),
                )
            outputs = stream if first_output is None else _prepend(first_output, stream)
            async for output in outputs:
                final = output
                for completion in output.outputs:
                    index = completion.index
                    if index in done:
                        continue
                    finished = completion.finish_reason is not None
                    text = stable_text(completion.text, finished)
                    first = index not in sent_text
                    previous = sent_text.get(index, "")
                    delta = text[len(previous) :]
                    if not delta and not finished:
                        continue
                    tokens_sent = sent_tokens.get(index, 0)
                    logprobs = self._logprobs(request, completion, tokens_sent)
                    new_ids = list(completion.token_ids[tokens_sent:]) if return_ids else None
                    sent_text[index] = text
                    sent_tokens[index] = len(completion.token_ids)
                    if finished:
                        done.add(index)
                    if index not in parsers:
                        parsers[index] = self.choice_parser(request)
                    parser = parsers[index]
                    if parser is not None:
                        message = parser.delta(text, final=finished)
                        if first and echo:
                            message = message or DeltaMessage()
                            message.content = echo + (message.content or "")
                        finish_reason = parser.finish_reason(completion.finish_reason)
                        if message is None and not finished:
                            # Held back (a possible marker): its logprobs and token ids go
                            # with the next.
                            sent_tokens[index] = tokens_sent
                            continue
                        choice = ChatCompletionResponseStreamChoice(
                            index=index,
                            delta=message or DeltaMessage(),
                            logprobs=logprobs,
                            finish_reason=finish_reason,
                            stop_reason=completion.stop_reason,
                            token_ids=new_ids,
                        )
                        usage = running_usage(output, len(completion.token_ids))
                        yield chunk([choice], usage if continuous_usage else None)
                        continue
                    content = (echo if first else "") + delta
                    if logprobs is None and frames is not None:  # the per-token common case
                        yield frames.frame(
                            index, content, completion.finish_reason, completion.stop_reason
                        )
                        continue
                    choice = ChatCompletionResponseStreamChoice(
                        index=index,
                        delta=DeltaMessage(content=content),
                        logprobs=logprobs,
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                        token_ids=new_ids,
                    )
                    usage = running_usage(output, len(completion.token_ids))
                    yield chunk([choice], usage if continuous_usage else None)
            if include_usage:
                yield chunk([], self.chat_usage(request, final))
        except Exception as error:  # headers are sent: report in-band, as vLLM does
            yield sse_error(error_from_exception(error))
        finally:
            stream.close()
        yield SSE_DONE


# transformers' marker (``render_jinja_template``) for the end of the message to continue.
_CONTINUE_MARK = "CONTINUE_FINAL_MESSAGE_TAG "


async def _prepend(first, stream) -> AsyncIterator:
    """``first``, then the rest of ``stream``."""
    yield first
    async for output in stream:
        yield output


def _message_dict(message: ChatMessageParam, position: int) -> dict:
    """A template-ready message: text parts joined by newlines; other fields passed through."""
    data = message.model_dump(exclude_none=True)
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequestError(
                    f"messages[{position}].content: only text parts are supported, got a part "
                    f"of type {part.get('type')!r}",
                    param=f"messages.{position}.content",
                )
            texts.append(part["text"])
        data["content"] = "\n".join(texts)
    elif content is None:
        data["content"] = ""
    return data
