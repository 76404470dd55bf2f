"""``POST /v1/completions``: one engine request per prompt, answered whole or as SSE chunks.

Behaviour follows vLLM's ``vllm/entrypoints/openai/serving_completion.py``: ``prompt`` may be a
string, a list of strings, a list of token ids or a list of such lists; with several prompts and
``n`` choices each, choice ``index = prompt_index * n + i``; ``echo`` puts the prompt in front of
the text (of the first chunk when streaming); empty deltas are not sent; with
``stream_options.include_usage`` a last chunk with empty ``choices`` carries the usage; the
stream ends with ``data: [DONE]``.

Prompt scoring (``echo`` with ``max_tokens: 0``, as lm-evaluation-harness sends it): one token
is computed (vLLM's way: usage counts it, ``token_ids`` lists it) but not in the text; the
choice holds the prompt's text, and with ``logprobs`` the prompt tokens' logprobs (the first
one null). ``return_token_ids`` adds
``prompt_token_ids`` and ``token_ids`` to each choice, and with ``echo`` leaves the prompt's
text out of ``text`` (vLLM's rule: the ids carry it).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from jaxpaged.beam_search import BeamSearchParams
from jaxpaged.engine_core.core_client import RequestStream
from jaxpaged.entrypoints.openai.errors import BadRequestError, error_from_exception
from jaxpaged.entrypoints.openai.protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from jaxpaged.entrypoints.openai.protocol_base import UsageInfo
from jaxpaged.entrypoints.openai.serving_engine import OpenAIServing, merge_streams, stable_text
from jaxpaged.entrypoints.openai.sse import SSE_DONE, DeltaFrames, sse, sse_error
from jaxpaged.entrypoints.openai.structured_outputs import structured_outputs_from_request
from jaxpaged.outputs import RequestOutput
from jaxpaged.sequence import EMPTY_PROMPT


class OpenAIServingCompletion(OpenAIServing):
    """The completions endpoint over the engine core (see ``OpenAIServing``)."""

    async def create_completion(
        self, request: CompletionRequest
    ) -> CompletionResponse | StreamingResponse:
        """Validate, submit every prompt, and answer (or stream) the completions.

        Raises:
            NotFoundError: unknown ``model``.
            BadRequestError / ValueError: invalid parameters or prompts (HTTP 400).
            QueueFullError: the waiting queue is full (HTTP 429).
        """
        arrival_time = time.monotonic()
        lora_request = self.check_model(request.model)
        if request.use_beam_search:
            self.check_supported(request, allowed=("use_beam_search", "length_penalty"))
            _check_beam_search_fields(request)
        else:
            self.check_supported(request)
        prompts = [self.truncate(p, request) for p in await self._prompts(request)]
        scoring = _is_scoring(request)
        params = []
        for _, ids in prompts:
            if request.use_beam_search:
                self.check_length(len(ids), request.max_tokens, "prompt")
                params.append(self._beam_search_params(request, len(ids)))
                continue
            # Scoring computes one token (vLLM's way), which must fit too.
            self.check_length(len(ids), 1 if scoring else request.max_tokens, "prompt")
            values = self.common_sampling_values(request)
            values["max_tokens"] = (
                1
                if scoring
                else request.max_tokens
                if request.max_tokens is not None
                else self.max_model_len - len(ids)
            )
            values["logprobs"] = None if request.logprob_token_ids else request.logprobs
            prompt_logprobs = request.prompt_logprobs
            if prompt_logprobs is None and request.echo:
                prompt_logprobs = request.logprobs  # echoed prompt tokens get logprobs too
            values["prompt_logprobs"] = prompt_logprobs
            params.append(self.sampling_params(values))
        request_id = self.response_id("cmpl", request)
        streams = await self.add_requests(
            request_id,
            prompts,
            params,
            arrival_time,
            lora_request,
            structured_field=structured_outputs_from_request(request)[1],
        )
        model = self.response_model(lora_request)
        if request.stream:
            return StreamingResponse(
                self._stream(request, request_id, model, streams),
                media_type="text/event-stream",
            )
        return await self._full(request, request_id, model, streams)

    def _beam_search_params(self, request: CompletionRequest, num_prompt_tokens: int):
        """vLLM's beam search of a completion request: ``n`` beams ranked by
        ``log_softmax(logits / temperature)``, where an unset or 0 temperature is 1 (the
        model's own log-probabilities, which vLLM's beam search ranks by), and
        ``length_penalty``."""
        max_tokens = request.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - num_prompt_tokens
        try:
            return BeamSearchParams(
                beam_width=request.n,
                max_tokens=max_tokens,
                ignore_eos=request.ignore_eos,
                temperature=request.temperature or 1.0,
                length_penalty=request.length_penalty,
                include_stop_str_in_output=request.include_stop_str_in_output,
            )
        except ValueError as error:  # SamplingParamsError names its field
            raise BadRequestError(str(error), param=getattr(error, "parameter", None)) from None

    async def _prompts(self, request) -> list[tuple[str | None, list[int]]]:
        """(text or None, token ids) per prompt of ``request``; ``add_special_tokens`` (default):
        text prompts get the tokenizer's BOS, as in ``LLM.generate``. A text too long for the
        context is refused before it is tokenized (``check_text_fits``)."""
        prompt = request.prompt
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        if not prompt:  # [] (None and "" are refused by the protocol, in vLLM's words)
            raise BadRequestError(EMPTY_PROMPT, param="prompt")
        prompts = []
        for p in prompt:
            if isinstance(p, str):
                self.check_text_fits(p, request, "prompt")
                ids = await self.encode(p, add_special_tokens=request.add_special_tokens)
                prompts.append((p, ids))
            else:
                prompts.append((None, list(p)))
        return prompts

    def _prompt_text(self, output: RequestOutput) -> str:
        """The prompt as given, or a token-id prompt decoded with its special tokens (vLLM
        echoes ``tokenizer.decode(ids)``: ``[1, 365]`` comes back as ``"<s> ..."``)."""
        if output.prompt is not None:
            return output.prompt
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(output.prompt_token_ids)

    def _logprobs(self, request, output, completion, start: int, text_offset: int, echo: bool):
        """Logprobs of output tokens ``start:`` (none when scoring) and of the prompt when
        ``echo``, or None."""
        if request.logprobs is None or completion.logprobs is None:
            return None
        scoring = _is_scoring(request)
        token_ids = [] if scoring else list(completion.token_ids[start:])
        steps = [] if scoring else list(completion.logprobs[start:])
        if echo:
            prompt_steps = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
            token_ids = list(output.prompt_token_ids) + token_ids
            steps = list(prompt_steps) + steps
        # -1 (the whole vocabulary) and logprob_token_ids return every entry of a step.
        num_top = None if request.logprobs == -1 or request.logprob_token_ids else request.logprobs
        return self.completion_logprobs(
            token_ids, steps, text_offset, self.as_token_ids(request), num_top
        )

    def _echo_text(self, request: CompletionRequest, output: RequestOutput) -> str:
        """The prompt text put in front of a choice's text: none without ``echo`` or with
        ``return_token_ids`` (vLLM's rule)."""
        if not request.echo or request.return_token_ids:
            return ""
        return self._prompt_text(output)

    async def _full(
        self,
        request: CompletionRequest,
        request_id: str,
        model: str,
        streams: list[RequestStream],
    ) -> CompletionResponse:
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for index, output in merge_streams(streams):
                finals[index] = output
        finally:
            for stream in streams:
                stream.close()
        choices = []
        scoring = _is_scoring(request)
        for prompt_index, output in enumerate(finals):
            prompt_text = self._echo_text(request, output)
            for rank, completion in enumerate(output.outputs):
                # Beams come ranked, best first: their rank is the choice's index.
                position = rank if request.use_beam_search else completion.index
                choices.append(
                    CompletionResponseChoice(
                        index=prompt_index * request.n + position,
                        text=prompt_text + ("" if scoring else completion.text),
                        logprobs=self._logprobs(request, output, completion, 0, 0, request.echo),
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                        prompt_logprobs=self.prompt_logprobs(output),
                        **_token_ids(request, output, completion.token_ids, first=True),
                    )
                )
        return CompletionResponse(
            id=request_id, model=model, choices=choices, usage=self.usage(finals)
        )

    async def _stream(
        self,
        request: CompletionRequest,
        request_id: str,
        model: str,
        streams: list[RequestStream],
    ) -> AsyncIterator[str]:
        created = int(time.time())
        options = request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous_usage = include_usage and bool(options.continuous_usage_stats)
        scoring = _is_scoring(request)
        plain = not (continuous_usage or request.return_token_ids)  # the fast chunk path
        sent_text: dict[int, str] = {}  # choice index -> text streamed so far
        sent_tokens: dict[int, int] = {}
        # Choices whose finish_reason was sent: with n > 1, a choice that stopped early stays
        # in later outputs, and must not be sent again.
        done: set[int] = set()
        latest: list[RequestOutput | None] = [None] * len(streams)
        # The per-token events, cut from this serializer's own event (sse.DeltaFrames).
        frames = DeltaFrames.from_probe(
            sse(
                text_chunk(
                    request_id, created, model, DeltaFrames.INDEX, DeltaFrames.TEXT,
                    DeltaFrames.FINISH, DeltaFrames.STOP,
                )
            )
        )  # fmt: skip
        try:
            async for prompt_index, output in merge_streams(streams):
                latest[prompt_index] = output
                for completion in output.outputs:
                    index = prompt_index * request.n + completion.index
                    if index in done:
                        continue
                    finished = completion.finish_reason is not None
                    text = "" if scoring else stable_text(completion.text, finished)
                    first = index not in sent_text
                    previous = sent_text.get(index, "")
                    delta = text[len(previous) :]
                    new_tokens = len(completion.token_ids) > sent_tokens.get(index, 0)
                    if (
                        not delta
                        and not finished
                        and (self.tokenizer is not None or not new_tokens)
                    ):
                        # Nothing new to show (held-back bytes, prefill chunk). Without a
                        # tokenizer there is no text: each new token is a chunk of "" text.
                        continue
                    echo = request.echo and first
                    prefix = self._echo_text(request, output) if echo else ""
                    start = sent_tokens.get(index, 0)
                    logprobs = self._logprobs(
                        request, output, completion, start, len(previous), echo
                    )
                    sent_text[index] = text
                    sent_tokens[index] = len(completion.token_ids)
                    if finished:
                        done.add(index)
                    if logprobs is None and plain and frames is not None:  # per-token case
                        yield frames.frame(
                            index, prefix + delta, completion.finish_reason,
                            completion.stop_reason,
                        )  # fmt: skip
                        continue
                    chunk = text_chunk(
                        request_id,
                        created,
                        model,
                        index,
                        prefix + delta,
                        completion.finish_reason,
                        completion.stop_reason,
                        logprobs=logprobs,
                        **_token_ids(request, output, completion.token_ids[start:], first=first),
                    )
                    if continuous_usage:  # this choice's, as vLLM counts them
                        prompt_tokens = len(output.prompt_token_ids)
                        chunk.usage = UsageInfo(
                            prompt_tokens=prompt_tokens,
                            completion_tokens=len(completion.token_ids),
                            total_tokens=prompt_tokens + len(completion.token_ids),
                        )
                    yield sse(chunk)
            if include_usage:  # without null keys, as vLLM sends it
                final_chunk = CompletionStreamResponse(
                    id=request_id,
                    created=created,
                    model=model,
                    choices=[],
                    usage=self.usage(latest),
                )
                yield sse(final_chunk.model_dump_json(exclude_none=True))
        except Exception as error:  # headers are sent: report in-band, as vLLM does
            yield sse_error(error_from_exception(error))
        finally:
            for stream in streams:
                stream.close()
        yield SSE_DONE


def text_chunk(
    request_id: str,
    created: int,
    model: str,
    index: int,
    text: str,
    finish_reason,
    stop_reason,
    **fields,
) -> CompletionStreamResponse:
    """One streamed completion chunk of one choice; ``fields``: its other
    ``CompletionResponseStreamChoice`` fields (logprobs, token ids)."""
    choice = CompletionResponseStreamChoice(
        index=index, text=text, finish_reason=finish_reason, stop_reason=stop_reason, **fields
    )
    return CompletionStreamResponse(id=request_id, created=created, model=model, choices=[choice])


# Completion fields beam search does not read -> their neutral values (anything else: a 400).
_BEAM_SEARCH_UNUSED = {
    "best_of": (None,),
    "stream": (False,),
    "echo": (False,),
    "logprobs": (None,),
    "prompt_logprobs": (None,),
    "logprob_token_ids": (None,),
    "top_p": (None, 1.0),
    "top_k": (None, 0, -1),
    "min_p": (None, 0.0),
    "seed": (None,),
    "presence_penalty": (None, 0.0),
    "frequency_penalty": (None, 0.0),
    "repetition_penalty": (None, 1.0),
    "stop": (None, [], ""),
    "stop_token_ids": (None, []),
    "min_tokens": (0,),
    "logit_bias": (None, {}),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "skip_special_tokens": (True,),
}


def _check_beam_search_fields(request: CompletionRequest) -> None:
    """Refuse what beam search would ignore (vLLM ignores it; streaming it refuses too).

    Raises:
        BadRequestError: naming the field (a structured-outputs constraint too: beam search
            is unconstrained).
    """
    field = structured_outputs_from_request(request)[1]
    if field is not None:
        raise BadRequestError(
            f"{field} is not supported with beam search (use_beam_search): beam search does "
            "not take structured-output constraints",
            param=field,
        )
    for name, neutral in _BEAM_SEARCH_UNUSED.items():
        if name not in request.model_fields_set:
            continue
        value = getattr(request, name)
        if not any(value == n and type(value) is type(n) for n in neutral) and value is not None:
            what = "streaming is" if name == "stream" else f"{name} is"
            raise BadRequestError(
                f"{what} not supported with beam search (use_beam_search), got {value!r}",
                param=name,
            )


def _is_scoring(request: CompletionRequest) -> bool:
    """``echo`` with ``max_tokens: 0``: the prompt (and its logprobs) comes back, no output."""
    return request.echo and request.max_tokens == 0


def _token_ids(request: CompletionRequest, output: RequestOutput, new_ids, *, first: bool):
    """A choice's ``prompt_token_ids`` (in its first chunk) and ``token_ids`` with
    ``return_token_ids``; nothing otherwise (the keys stay, null)."""
    if not request.return_token_ids:
        return {}
    return {
        "prompt_token_ids": list(output.prompt_token_ids) if first else None,
        "token_ids": list(new_ids),  # scoring too: the one computed token (vLLM's answer)
    }
