"""What completions and chat share: model check, prompt length rule, sampling parameters,
submitting requests to the engine core, tokenizing off the event loop, streaming deltas and logprob formatting.

Request rules follow vLLM's ``vllm/entrypoints/openai/serving_engine.py``:

- an unknown ``model`` is a 404 ("The model `X` does not exist.");
- ``prompt_len + max_tokens > max_model_len`` (or ``prompt_len >= max_model_len`` when
  ``max_tokens`` is unset) is a 400 whose message starts "This model's maximum context length
  is N tokens" (client libraries match that prefix);
- an unset ``max_tokens`` means ``max_model_len - prompt_len``.

Every field of vLLM's requests is honoured or refused: ``UNSUPPORTED_FIELDS`` lists those this
server does not implement (beam search through the server, structured outputs, priorities,
logits processors, ...) with their neutral values; any other value is a 400 naming the field,
never silently dropped (``check_supported``).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import uuid
from collections.abc import AsyncIterator, Sequence

from jaxpaged.engine_core.core_client import EngineCoreClient, RequestStream
from jaxpaged.entrypoints.openai.errors import BadRequestError, NotFoundError
from jaxpaged.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    CompletionLogProbs,
    PromptLogprob,
)
from jaxpaged.entrypoints.openai.protocol_base import PromptTokenUsageInfo, UsageInfo
from jaxpaged.entrypoints.openai.structured_outputs import (
    rename_error,
    structured_outputs_from_request,
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

# vLLM request fields this server does not implement -> the values that mean "not used".
# Anything else is refused by name (check_supported).
UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "use_beam_search": (False,),  # completions serve it (serving_completion), chat does not
    "length_penalty": (1.0,),  # only beam search reads it
    "priority": (0,),  # the scheduler is first-come first-served
    "logits_processors": (None, []),
    "cache_salt": (None,),
    "kv_transfer_params": (None, {}),
    "vllm_xargs": (None, {}),
    "mm_processor_kwargs": (None, {}),
    "watermarking": (None, False),
    "ec_transfer_params": (None, {}),
    "repetition_detection": (None,),
    "thinking_token_budget": (None, -1),  # -1: unlimited (vLLM's "unset")
    "stream_interval": (None, 1),  # every token is streamed as it comes
    "session_id": (None,),  # no session-aware routing or caching here
    "routed_experts_prompt_start": (0,),
    "return_token_offsets": (None, False),  # render endpoints only, in vLLM
    "return_mm_kwargs": (True,),
    "return_prompt_text": (None, False),
    "media_io_kwargs": (None, {}),
    "prompt_embeds": (None,),
    "suffix": (None,),
    "reasoning_effort": (None,),
}
# Texts longer than this (characters) are tokenized in a worker thread, so that a multi-MB
# prompt never stalls the event loop (tokenizers releases the GIL while it encodes).
_THREAD_TOKENIZE_CHARS = 4096


# Texts on which a tokenizer's characters-per-token bound is checked before it is trusted:
# whitespace runs (a normalizer or pre-tokenizer may drop or merge them), combining marks
# and Hangul jamo (Unicode normalization may compose several characters into one).
_BOUND_PROBES = (" " * 512, "\n" * 512, "\t" * 512, "a" + " " * 511, "e\u0301" * 256,
                 "\u1100\u1161\u11a8" * 170, "\u00a0" * 512)  # fmt: skip


def chars_per_token_bound(tokenizer) -> int | None:
    """The most characters of text one token of ``tokenizer`` covers, ``L``: the longest token
    string of its vocabulary (added and special tokens included). Byte-level BPE token strings
    spell one character per byte and SentencePiece ones one per character, so no token covers
    more text than its string's length. Tokenizers whose normalizer or pre-tokenizer drops or
    composes characters (WordPiece drops whitespace) break that; the bound is therefore
    checked on ``_BOUND_PROBES`` and refused (None) when any probe holds more than ``L``
    characters per token, or when the tokenizer has no ``convert_ids_to_tokens``.

    Returns:
        ``L`` (int, characters), or None when no bound is known.
    """
    if not hasattr(tokenizer, "convert_ids_to_tokens"):
        return None
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    bound = max((len(t) for t in tokens if t is not None), default=0)
    for probe in _BOUND_PROBES:
        if len(probe) > bound * len(tokenizer.encode(probe, add_special_tokens=False)):
            return None
    return bound or None


# OpenAI clamps -inf logprobs to this for JSON (vLLM does the same).
_MIN_LOGPROB = -9999.0


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIServing:
    """Base of the completion and chat handlers.

    Args:
        engine: the ``EngineCoreClient``.
        tokenizer: the API process's tokenizer; None with ``--skip-tokenizer-init``.
        served_model_names: accepted ``model`` values; the first is echoed in responses.
        max_model_len: the engine's context limit in tokens.
        return_tokens_as_token_ids: ``--return-tokens-as-token-ids``: logprob tokens are
            written ``token_id:<id>`` unless a request says otherwise.
        enable_prompt_tokens_details: ``--enable-prompt-tokens-details``: usage carries
            ``prompt_tokens_details.cached_tokens`` (prompt tokens read from the prefix cache).
    """

    def __init__(
        self,
        engine: EngineCoreClient,
        tokenizer,
        served_model_names: Sequence[str],
        max_model_len: int,
        *,
        return_tokens_as_token_ids: bool = False,
        enable_prompt_tokens_details: bool = False,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.served_model_names = list(served_model_names)
        self.max_model_len = max_model_len
        self.return_tokens_as_token_ids = return_tokens_as_token_ids
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self._sampling_fields = set(inspect.signature(SamplingParams).parameters)
        # Base names and LoRA adapters (``serving_models``); set by the app, None: base only.
        self.models = None

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def response_model(self, lora_request) -> str:
        """The ``model`` field of a response: the adapter's ``lora_name`` when the request
        picked a LoRA adapter (vLLM's answer), else the base model's first served name."""
        return self.model_name if lora_request is None else lora_request.lora_name

    def check_model(self, model: str | None):
        """The LoRA adapter ``model`` names (None: the base model, also for None).

        Raises NotFoundError for a ``model`` that is neither served nor an adapter."""
        if self.models is not None:
            return self.models.lora_request_for(model)
        if model is not None and model not in self.served_model_names:
            raise NotFoundError(f"The model `{model}` does not exist.", param="model")

    def require_tokenizer(self, what: str) -> None:
        """Raises BadRequestError when the server runs without a tokenizer."""
        if self.tokenizer is None:
            raise BadRequestError(
                f"{what} needs a tokenizer, but the server was started with "
                "--skip-tokenizer-init: send prompts as token ids",
                param="prompt",
            )

    async def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; long texts are encoded in a worker thread.

        Raises:
            BadRequestError: there is no tokenizer (``--skip-tokenizer-init``).
        """
        self.require_tokenizer("a text prompt")
        if len(text) <= _THREAD_TOKENIZE_CHARS:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        ids = await asyncio.to_thread(
            self.tokenizer.encode, text, add_special_tokens=add_special_tokens
        )
        return list(ids)

    @functools.cached_property
    def _chars_per_token(self) -> int:
        """``chars_per_token_bound`` of the tokenizer, 0 when it has none (computed once)."""
        return chars_per_token_bound(self.tokenizer) or 0

    def check_text_fits(self, text: str, request, input_name: str) -> None:
        """Refuse, before tokenizing, a text that cannot fit ``max_model_len`` tokens: when no
        token covers more than ``L`` characters of text (``chars_per_token_bound``), a text of
        more than ``max_model_len * L`` characters has more than ``max_model_len`` tokens. A
        rendered hostile chat template of 16 M characters took 18 s of CPU and 5.7 GB to
        tokenize before this check. Requests that truncate their prompt
        (``truncate_prompt_tokens``) are tokenized in full, as asked, and so is every text
        when the tokenizer admits no such bound.

        Raises:
            BadRequestError: naming ``input_name``.
        """
        if self.tokenizer is None or request.truncate_prompt_tokens is not None:
            return
        chars_per_token = self._chars_per_token
        limit = self.max_model_len * chars_per_token
        if chars_per_token and len(text) > limit:
            raise BadRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"the {input_name} hold {len(text)} characters, more than "
                f"{self.max_model_len} tokens of at most {chars_per_token} characters "
                f"each ({limit}). Please reduce the length of the {input_name}.",
                param=input_name,
            )

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

    def check_supported(self, request, allowed: tuple[str, ...] = ()) -> None:
        """Refuse every field of ``UNSUPPORTED_FIELDS`` (but ``allowed``, which the caller
        serves) the request sets to a value other than a neutral one.

        Raises:
            BadRequestError: naming the field and the value.
        """
        # Only fields the body set: every unset one holds its declared default, which is
        # neutral (tests/entrypoints/openai/test_serving_engine.py checks that).
        given = request.model_fields_set & type(request).model_fields.keys()  # no extras
        for name, neutral in UNSUPPORTED_FIELDS.items():
            if name not in given or name in allowed:
                continue
            value = getattr(request, name)
            if any(value == n and type(value) is type(n) for n in neutral) or value is None:
                continue
            raise BadRequestError(
                f"{name} is not supported by this server: {name} must be one of "
                f"{list(neutral)}, got {_short(value)}",
                param=name,
            )

    def response_id(self, prefix: str, request) -> str:
        """``<prefix>-<request_id>`` when the request names one, else a random id."""
        if request.request_id:
            return f"{prefix}-{request.request_id}"
        return random_id(prefix)

    def truncate(
        self, prompt: tuple[str | None, list[int]], request
    ) -> tuple[str | None, list[int]]:
        """Keep ``request.truncate_prompt_tokens`` ids (-1: ``max_model_len``): the last ones
        (``truncation_side`` "left", the default) or the first ones ("right"), as vLLM does; a
        truncated prompt loses its text (echo and outputs decode the ids kept)."""
        text, ids = prompt
        keep = request.truncate_prompt_tokens
        if keep == -1:
            keep = self.max_model_len
        if keep is None or len(ids) <= keep:
            return text, ids
        if request.truncation_side == "right":
            return None, ids[:keep]
        return None, ids[-keep:]

    def as_token_ids(self, request) -> bool:
        """Whether logprob tokens are written ``token_id:<id>``: the request's
        ``return_tokens_as_token_ids``, else the server's flag."""
        if request.return_tokens_as_token_ids is not None:
            return bool(request.return_tokens_as_token_ids)
        return self.return_tokens_as_token_ids

    def usage(self, outputs: Sequence[RequestOutput | None]) -> UsageInfo:
        """``usage_of(outputs)``, with ``prompt_tokens_details`` under
        ``--enable-prompt-tokens-details``."""
        usage = usage_of(outputs)
        if self.enable_prompt_tokens_details:
            cached = sum(o.num_cached_tokens or 0 for o in outputs if o is not None)
            usage.prompt_tokens_details = PromptTokenUsageInfo(cached_tokens=cached)
        return usage

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
        params = SamplingParams(**kwargs)
        # bad_words -> token ids here: the engine core has no tokenizer.
        params.update_from_tokenizer(self.tokenizer)
        return params

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
            spaces_between_special_tokens=request.spaces_between_special_tokens,
            logit_bias=request.logit_bias,
            allowed_token_ids=request.allowed_token_ids,
            bad_words=request.bad_words or None,
            prompt_logprobs=request.prompt_logprobs,
            logprob_token_ids=request.logprob_token_ids,
            # structured_outputs / guided_* / response_format (400 naming a bad or second one)
            structured_outputs=structured_outputs_from_request(request)[0],
        )

    async def add_requests(
        self,
        request_id: str,
        prompts: Sequence[tuple[str | None, list[int]]],
        params: Sequence[SamplingParams],
        arrival_time: float,
        lora_request=None,
        *,
        structured_field: str | None = None,
    ) -> list[RequestStream]:
        """Submit one engine request per prompt (ids ``<request_id>-<i>``); all or none.

        Raises whatever ``EngineCoreClient.add_request`` raises, after closing the streams
        already opened; the engine's refusal of a constraint (a schema, regex or grammar the
        backend cannot compile) names ``structured_field``, the request field that carried it.
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
        except BaseException as error:
            for stream in streams:
                stream.close()
            renamed = rename_error(error, structured_field)
            if renamed is not error:
                raise renamed from None
            raise
        return streams

    # ---------------------------------------------------------------------------- logprobs
    def _token_text(self, token_id: int, logprob, as_token_ids: bool = False) -> str:
        if as_token_ids:  # return_tokens_as_token_ids: vLLM's "token_id:<id>"
            return f"token_id:{token_id}"
        decoded = getattr(logprob, "decoded_token", None)
        if decoded is not None:
            return decoded
        return "" if self.tokenizer is None else self.tokenizer.decode([token_id])

    def prompt_logprobs(self, output: RequestOutput) -> list[dict | None] | None:
        """vLLM's ``prompt_logprobs`` of a response: per prompt token (the first: None),
        ``{token id: {logprob, rank, decoded_token}}`` with -inf clamped for JSON."""
        if output.prompt_logprobs is None:
            return None
        return [
            None
            if step is None
            else {
                token_id: PromptLogprob(
                    logprob=_logprob_value(lp),
                    rank=lp.rank,
                    decoded_token=self._token_text(token_id, lp),
                )
                for token_id, lp in step.items()
            }
            for step in output.prompt_logprobs
        ]

    def completion_logprobs(
        self,
        token_ids: Sequence[int],
        steps: Sequence[dict | None],
        text_offset: int,
        as_token_ids: bool = False,
        num_top: int | None = None,
    ) -> CompletionLogProbs:
        """OpenAI completions ``logprobs`` for ``token_ids``; ``steps[i]`` maps token id ->
        ``Logprob`` (vLLM's shape: the sampled token first, then the top-k), None where there
        are none (the first prompt token). ``text_offset``: where the first token starts in the
        text. ``as_token_ids``: tokens written ``token_id:<id>``. ``top_logprobs`` keeps each
        step's order and its first ``num_top + 1`` entries (vLLM's; None: all of them)."""
        out = CompletionLogProbs()
        for token_id, step in zip(token_ids, steps, strict=True):
            token = self._token_text(token_id, step.get(token_id) if step else None, as_token_ids)
            out.tokens.append(token)
            out.text_offset.append(text_offset)
            text_offset += len(token)
            if not step:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            sampled = step.get(token_id)
            out.token_logprobs.append(None if sampled is None else _logprob_value(sampled))
            entries = list(step.items())
            if num_top is not None:
                entries = entries[: num_top + 1]
            out.top_logprobs.append(
                {self._token_text(t, lp, as_token_ids): _logprob_value(lp) for t, lp in entries}
            )
        return out

    def chat_logprobs(
        self,
        token_ids: Sequence[int],
        steps: Sequence[dict | None],
        num_top: int,
        as_token_ids: bool = False,
    ) -> ChatCompletionLogProbs:
        """OpenAI chat ``logprobs.content`` for ``token_ids`` with the first ``num_top``
        entries of each step as alternatives, in the step's order (the sampled token first, as
        vLLM lists them; -1 or None: all of them); ``as_token_ids``: tokens written
        ``token_id:<id>``."""
        content = []
        for token_id, step in zip(token_ids, steps, strict=True):
            step = step or {}
            token = self._token_text(token_id, step.get(token_id), as_token_ids)
            top = [
                ChatCompletionLogProb(
                    token=(text := self._token_text(t, lp, as_token_ids)),
                    logprob=_logprob_value(lp),
                    bytes=list(text.encode("utf-8", errors="replace")),
                )
                for t, lp in (
                    list(step.items()) if num_top in (None, -1) else list(step.items())[:num_top]
                )
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


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 100 else text[:100] + "..."


def _logprob_value(logprob) -> float:
    value = float(getattr(logprob, "logprob", logprob))
    return max(value, _MIN_LOGPROB)


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
