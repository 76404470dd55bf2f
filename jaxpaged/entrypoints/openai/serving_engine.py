"""What completions and chat share: model check, prompt length rule, sampling parameters,
submitting requests to the ``AsyncLLMEngine``, streaming deltas and logprob formatting.

Request rules follow vLLM's ``vllm/entrypoints/openai/serving_engine.py``:

- an unknown ``model`` is a 404 ("The model `X` does not exist.");
- ``prompt_len + max_tokens > max_model_len`` (or ``prompt_len >= max_model_len`` when
  ``max_tokens`` is unset) is a 400 whose message starts "This model's maximum context length
  is N tokens" (client libraries match that prefix);
- an unset ``max_tokens`` means ``max_model_len - prompt_len``.

Request fields the engine's ``SamplingParams`` does not accept yet (stop strings, logprobs,
penalties, ... until their branches land) are passed through when its constructor takes them;
a non-neutral value for one it does not take is a 400 naming the field, never silently dropped.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import uuid
from collections.abc import AsyncIterator, Sequence

from pydantic import BaseModel

from jaxpaged.engine.async_llm_engine import AsyncLLMEngine, RequestStream
from jaxpaged.entrypoints.openai.errors import BadRequestError, NotFoundError
from jaxpaged.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    CompletionLogProbs,
    ErrorResponse,
    UsageInfo,
)
from jaxpaged.outputs import RequestOutput
from jaxpaged.sampling_params import SamplingParams

# Values that mean "feature off": a field the engine does not support yet may still be sent
# with these (clients often send the OpenAI defaults explicitly).
_NEUTRAL_VALUES = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_tokens": 0,
    "include_stop_str_in_output": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "logit_bias": {},
    "stop": [],
    "stop_token_ids": [],
}

# OpenAI clamps -inf logprobs to this for JSON (vLLM does the same).
_MIN_LOGPROB = -9999.0


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(payload: BaseModel | str) -> str:
    """One server-sent event: ``data: <json>`` and a blank line."""
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(error: ErrorResponse) -> str:
    """An error after the response started: vLLM sends it as an event before ``[DONE]``."""
    return f"data: {json.dumps(error.model_dump())}\n\n"


class OpenAIServing:
    """Base of the completion and chat handlers.

    Args:
        engine: the started ``AsyncLLMEngine``.
        tokenizer: the frontend's own tokenizer instance (not the engine thread's).
        served_model_names: accepted ``model`` values; the first is echoed in responses.
        max_model_len: the engine's context limit in tokens.
    """

    def __init__(
        self,
        engine: AsyncLLMEngine,
        tokenizer,
        served_model_names: Sequence[str],
        max_model_len: int,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.served_model_names = list(served_model_names)
        self.max_model_len = max_model_len
        self._sampling_fields = set(inspect.signature(SamplingParams).parameters)
        # Base names and LoRA adapters (``serving_models``); set by the app, None: base only.
        self.models = None

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None):
        """The LoRA adapter ``model`` names (None: the base model, also for None).

        Raises NotFoundError for a ``model`` that is neither served nor an adapter."""
        if self.models is not None:
            return self.models.lora_request_for(model)
        if model is not None and model not in self.served_model_names:
            raise NotFoundError(f"The model `{model}` does not exist.", param="model")

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None, input_name: str):
        """vLLM's context-length rule; ``input_name`` is "prompt" or "messages"."""
        limit = self.max_model_len
        if max_tokens is None:
            if num_prompt_tokens >= limit:
                raise BadRequestError(
                    f"This model's maximum context length is {limit} tokens. However, your "
                    f"request has {num_prompt_tokens} input tokens in the {input_name}, which "
                    "leaves no room for output. Please reduce the length of the input.",
                    param=input_name,
                )
        elif num_prompt_tokens + max_tokens > limit:
            raise BadRequestError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in "
                f"the {input_name}, {max_tokens} in the completion). Please reduce the length "
                f"of the {input_name} or completion.",
                param=input_name,
            )

    def sampling_params(self, values: dict) -> SamplingParams:
        """``SamplingParams`` from request fields; None values take the engine's defaults.

        Raises:
            BadRequestError: a field this engine does not support, with a non-neutral value.
            SamplingParamsError: a value out of range (HTTP 400 naming the field).
        """
        kwargs = {}
        for name, value in values.items():
            if value is None:
                continue
            if name in _NEUTRAL_VALUES and value == _NEUTRAL_VALUES[name]:
                continue
            if name not in self._sampling_fields:
                raise BadRequestError(
                    f"{name} is not supported by this server yet, got {value!r}", param=name
                )
            kwargs[name] = value
        return SamplingParams(**kwargs)

    def common_sampling_values(self, request) -> dict:
        """The sampling fields completions and chat share, by their SamplingParams names."""
        stop = request.stop
        if isinstance(stop, str):
            stop = [stop]
        best_of = request.best_of
        if best_of is not None and best_of == request.n:
            best_of = None  # best_of == n is plain sampling
        return dict(
            n=request.n,
            best_of=best_of,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            min_p=request.min_p,
            seed=request.seed,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=request.repetition_penalty,
            min_tokens=request.min_tokens,
            ignore_eos=request.ignore_eos,
            stop=stop,
            stop_token_ids=request.stop_token_ids,
            include_stop_str_in_output=request.include_stop_str_in_output,
            skip_special_tokens=request.skip_special_tokens,
            logit_bias=request.logit_bias,
        )

    async def add_requests(
        self,
        request_id: str,
        prompts: Sequence[tuple[str | None, list[int]]],
        params: Sequence[SamplingParams],
        arrival_time: float,
        lora_request=None,
    ) -> list[RequestStream]:
        """Submit one engine request per prompt (ids ``<request_id>-<i>``); all or none.

        Raises whatever ``AsyncLLMEngine.add_request`` raises, after closing the streams
        already opened.
        """
        streams: list[RequestStream] = []
        lora = {} if lora_request is None else {"lora_request": lora_request}
        try:
            for i, ((text, ids), p) in enumerate(zip(prompts, params, strict=True)):
                prompt = {"prompt_token_ids": ids, "prompt": text}
                streams.append(
                    await self.engine.add_request(
                        f"{request_id}-{i}", prompt, p, arrival_time=arrival_time, **lora
                    )
                )
        except BaseException:
            for stream in streams:
                stream.close()
            raise
        return streams

    # ---------------------------------------------------------------------------- logprobs
    def _token_text(self, token_id: int, logprob) -> str:
        decoded = getattr(logprob, "decoded_token", None)
        return decoded if decoded is not None else self.tokenizer.decode([token_id])

    def completion_logprobs(
        self, token_ids: Sequence[int], steps: Sequence[dict | None], text_offset: int
    ) -> CompletionLogProbs:
        """OpenAI completions ``logprobs`` for ``token_ids``; ``steps[i]`` maps token id ->
        ``Logprob`` (vLLM's shape; the sampled token and the top-k), None where there are none
        (the first prompt token). ``text_offset``: where the first token starts in the text."""
        out = CompletionLogProbs()
        for token_id, step in zip(token_ids, steps, strict=True):
            token = self._token_text(token_id, step.get(token_id) if step else None)
            out.tokens.append(token)
            out.text_offset.append(text_offset)
            text_offset += len(token)
            if not step:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            sampled = step.get(token_id)
            out.token_logprobs.append(None if sampled is None else _logprob_value(sampled))
            out.top_logprobs.append(
                {self._token_text(t, lp): _logprob_value(lp) for t, lp in _ranked(step)}
            )
        return out

    def chat_logprobs(
        self, token_ids: Sequence[int], steps: Sequence[dict | None], num_top: int
    ) -> ChatCompletionLogProbs:
        """OpenAI chat ``logprobs.content`` for ``token_ids`` with ``num_top`` alternatives."""
        content = []
        for token_id, step in zip(token_ids, steps, strict=True):
            step = step or {}
            token = self._token_text(token_id, step.get(token_id))
            top = [
                ChatCompletionLogProb(
                    token=(text := self._token_text(t, lp)),
                    logprob=_logprob_value(lp),
                    bytes=list(text.encode("utf-8", errors="replace")),
                )
                for t, lp in _ranked(step)[:num_top]
            ]
            sampled = step.get(token_id)
            content.append(
                ChatCompletionLogProbsContent(
                    token=token,
                    logprob=_MIN_LOGPROB if sampled is None else _logprob_value(sampled),
                    bytes=list(token.encode("utf-8", errors="replace")),
                    top_logprobs=top,
                )
            )
        return ChatCompletionLogProbs(content=content)


def _logprob_value(logprob) -> float:
    value = float(getattr(logprob, "logprob", logprob))
    return max(value, _MIN_LOGPROB)


def _ranked(step: dict) -> list:
    """(token id, Logprob) pairs by rank (or by descending logprob when there is no rank)."""

    def key(item):
        rank = getattr(item[1], "rank", None)
        return (rank if rank is not None else 0, -_logprob_value(item[1]))

    return sorted(step.items(), key=key)


def usage_of(outputs: Sequence[RequestOutput | None]) -> UsageInfo:
    """Prompt tokens counted once per prompt, completion tokens over every choice."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs if o is not None)
    completion = sum(len(c.token_ids) for o in outputs if o is not None for c in o.outputs)
    return UsageInfo(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def stable_text(text: str, finished: bool) -> str:
    """Text safe to stream: while unfinished, a trailing U+FFFD may be the first bytes of a
    character that the next token completes, so it is held back."""
    return text if finished else text.rstrip("\ufffd")


async def merge_streams(
    streams: Sequence[RequestStream],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as ``(stream index, output)`` in arrival order."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output))
        except Exception as error:  # handed to the consumer, which re-raises it
            queue.put_nowait((index, error))
        queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
