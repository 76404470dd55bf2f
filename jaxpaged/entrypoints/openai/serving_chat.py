"""``POST /v1/chat/completions``: render the chat template, then generate like a completion.

vLLM's rules (``vllm/entrypoints/openai/serving_chat.py``, ``vllm/entrypoints/chat_utils.py``):
the messages are rendered to text with the request's ``chat_template``, else the server's
``--chat-template``, else the tokenizer's own; the text is tokenized *without* adding special
tokens (the template writes them). Text content parts are joined with newlines
(``chat_template.py``). When streaming, each choice first gets a chunk whose delta is
``{"role": "assistant", "content": ""}``, then content deltas, the last with ``finish_reason``
(``chat_stream.py`` writes them). Tool calls and reasoning (``chat_tools``): the reply is read by
a per-choice ``ChatChoiceParser``, streamed as ``reasoning`` / ``content`` / ``tool_calls``
deltas.

A request's own ``chat_template`` is a client's program: it is rendered in a sandboxed worker
process with limits on time, memory, output and ``range`` (``template_sandbox.py``); a failure
is a 400. The server's and the tokenizer's templates are the operator's and render in process
(transformers' ``apply_chat_template``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence

import jinja2
from fastapi.responses import StreamingResponse

from jaxpaged.engine_core.core_client import RequestStream
from jaxpaged.entrypoints.openai.chat_stream import ChatChunks, SentSoFar
from jaxpaged.entrypoints.openai.chat_template import message_dict, render_in_sandbox
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
    ChatMessage,
    ChatMessageParam,
    DeltaMessage,
)
from jaxpaged.entrypoints.openai.protocol_base import CompletionTokenUsageInfo, UsageInfo
from jaxpaged.entrypoints.openai.serving_engine import OpenAIServing, stable_text
from jaxpaged.entrypoints.openai.sse import SSE_DONE, sse_error
from jaxpaged.entrypoints.openai.structured_outputs import structured_outputs_from_request
from jaxpaged.entrypoints.openai.template_sandbox import (
    TemplateLimitError,
    TemplateQueueFullError,
    TemplateSandbox,
)
from jaxpaged.outputs import CompletionOutput, RequestOutput
from jaxpaged.sampling_params import StructuredOutputsParams


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
        conversation = template_messages([message_dict(m, i) for i, m in enumerate(messages)])
        if chat_template:  # the client's own program: sandboxed, in a worker process
            try:
                return await render_in_sandbox(
                    self.template_sandbox,
                    self.tokenizer,
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
        return message_dict(last, len(request.messages) - 1)["content"]

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
        """The SSE events of one chat completion (``chat_stream``: each choice's opening
        chunk, its deltas, the usage chunk, ``[DONE]``); an error after the headers went out
        is an event, as vLLM sends it."""
        chunks = ChatChunks(request, request_id, model)
        sent = SentSoFar()
        echo = self._echo(request)
        final = None
        try:
            first_output = None
            if chunks.opening_needs_output:
                async for output in stream:
                    first_output = output
                    break
            for index in range(request.n):
                yield chunks.opening(index, first_output)
            outputs = stream if first_output is None else _prepend(first_output, stream)
            async for output in outputs:
                final = output
                for completion in output.outputs:
                    event = self._choice_event(request, chunks, sent, echo, output, completion)
                    if event is not None:
                        yield event
            if chunks.include_usage:
                yield chunks.chunk([], self.chat_usage(request, final))
        except Exception as error:  # headers are sent: report in-band, as vLLM does
            yield sse_error(error_from_exception(error))
        finally:
            stream.close()
        yield SSE_DONE

    def _choice_event(
        self,
        request: ChatCompletionRequest,
        chunks: ChatChunks,
        sent: SentSoFar,
        echo: str,
        output: RequestOutput,
        completion: CompletionOutput,
    ) -> str | None:
        """The event of one choice's new text (``echo`` before its first), recorded in
        ``sent``; None when there is nothing to send yet: no new stable text, a choice already
        finished, or a parser holding back a possible marker (its logprobs and token ids go
        with the next event)."""
        index = completion.index
        if index in sent.done:
            return None
        finished = completion.finish_reason is not None
        text = stable_text(completion.text, finished)
        first = index not in sent.text
        delta = text[len(sent.text.get(index, "")) :]
        if not delta and not finished:
            return None
        tokens_sent = sent.tokens.get(index, 0)
        logprobs = self._logprobs(request, completion, tokens_sent)
        new_ids = list(completion.token_ids[tokens_sent:]) if chunks.return_ids else None
        sent.text[index] = text
        sent.tokens[index] = len(completion.token_ids)
        if finished:
            sent.done.add(index)
        if index not in sent.parsers:
            sent.parsers[index] = self.choice_parser(request)
        parser = sent.parsers[index]
        finish_reason = completion.finish_reason
        if parser is not None:
            message = parser.delta(text, final=finished)
            if first and echo:
                message = message or DeltaMessage()
                message.content = echo + (message.content or "")
            finish_reason = parser.finish_reason(finish_reason)
            if message is None and not finished:
                sent.tokens[index] = tokens_sent  # held back: sent with the next
                return None
            message = message or DeltaMessage()
        else:
            content = (echo if first else "") + delta
            if logprobs is None and chunks.frames is not None:  # the per-token common case
                return chunks.frames.frame(index, content, finish_reason, completion.stop_reason)
            message = DeltaMessage(content=content)
        choice = ChatCompletionResponseStreamChoice(
            index=index,
            delta=message,
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=completion.stop_reason,
            token_ids=new_ids,
        )
        return chunks.delta(choice, output, len(completion.token_ids))


async def _prepend(first, stream) -> AsyncIterator:
    """``first``, then the rest of ``stream``."""
    yield first
    async for output in stream:
        yield output
