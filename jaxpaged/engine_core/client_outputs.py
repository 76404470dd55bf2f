"""The API process's side of outputs: the core's token deltas -> cumulative ``RequestOutput``s.

The engine core sends only new token ids, logprobs and finish reasons (``core_messages``).
Here each completion's ``IncrementalDetokenizer`` turns them into text and looks for stop
strings, as vLLM v1's frontend ``OutputProcessor`` does (``vllm/v1/engine/output_processor.py``).
A stop string ends the completion at once; when every completion of a request has ended here
but the core still runs it, ``needs_core_abort`` tells the client to abort it there.

Outputs are CUMULATIVE (what the server's handlers consume): text so far (the last
``stop_buffer_length`` characters held back while a stop string may still match), all token
ids, all logprobs. A completion that a stop string ended ignores later tokens from the core.
"""

from __future__ import annotations

import dataclasses

from jaxpaged.beam_search import BeamSearchParams
from jaxpaged.detokenizer import IncrementalDetokenizer
from jaxpaged.engine_core.core_messages import EngineCoreOutput
from jaxpaged.outputs import CompletionOutput, RequestOutput
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams


@dataclasses.dataclass
class _Completion:
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ClientRequestState:
    """One request's output state in the API process.

    Args:
        request_id: the engine request id.
        prompt_text: the prompt as given (None for token-id prompts).
        prompt_token_ids: the tokenized prompt (context for the first output tokens).
        params: the request's ``SamplingParams`` (stop strings, ``n``, logprobs).
        tokenizer: the API process's tokenizer, or None (``skip_tokenizer_init``: no text).
    """

    def __init__(
        self,
        request_id: str,
        prompt_text: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer,
    ):
        self.request_id = request_id
        self.prompt_text = prompt_text
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.tokenizer = tokenizer
        self.completions: dict[int, _Completion] = {}
        self.prompt_logprobs = None
        self.num_cached_tokens = 0
        self.times = [None, None, None]
        self.finished = False
        self.core_finished = False

    @property
    def needs_core_abort(self) -> bool:
        """True once this side finished the request (stop strings) and the core has not."""
        return self.finished and not self.core_finished

    def _completion(self, index: int) -> _Completion:
        completion = self.completions.get(index)
        if completion is None:
            completion = _Completion(
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer, self.prompt_token_ids, self.params
                ),
                logprobs=[] if self.params.logprobs is not None else None,
            )
            self.completions[index] = completion
        return completion

    def update(self, delta: EngineCoreOutput) -> RequestOutput:
        """Commit one step's delta and return the request's cumulative output."""
        self.core_finished = delta.finished
        if delta.times is not None:  # None: a short delta, nothing but a token changed
            self.num_cached_tokens = delta.num_cached_tokens
            self.times = delta.times
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        for new in delta.completions:
            completion = self._completion(new.index)
            if completion.finish_reason is not None:
                continue  # ended here by a stop string; the core's later tokens do not count
            completion.token_ids.extend(new.token_ids)
            if completion.logprobs is not None and new.logprobs:
                completion.logprobs.extend(new.logprobs)
            completion.cumulative_logprob = new.cumulative_logprob
            # The core has no stop strings: its "stop" is EOS or a stop token id.
            stop = completion.detokenizer.update(
                new.token_ids,
                stop_terminated=new.finish_reason == "stop",
                finished=new.finish_reason is not None,
            )
            if stop is not None:  # overrides a "length" of the same step, as in vLLM v1
                completion.finish_reason, completion.stop_reason = "stop", stop
            else:
                completion.finish_reason, completion.stop_reason = (
                    new.finish_reason,
                    new.stop_reason,
                )
        self.finished = delta.finished or (
            len(self.completions) == self.params.n
            and all(c.finish_reason is not None for c in self.completions.values())
        )
        return self._output()

    def _output(self) -> RequestOutput:
        outputs = []
        for index in sorted(self.completions):
            completion = self.completions[index]
            done = self.finished or completion.finish_reason is not None
            outputs.append(
                CompletionOutput(
                    index=index,
                    text=completion.detokenizer.get_next_output_text(finished=done, delta=False),
                    token_ids=list(completion.token_ids),
                    cumulative_logprob=completion.cumulative_logprob,
                    logprobs=None if completion.logprobs is None else list(completion.logprobs),
                    finish_reason=completion.finish_reason
                    if completion.finish_reason is not None or not self.finished
                    else "abort",
                    stop_reason=completion.stop_reason,
                )
            )
        arrival, first_token, finished = self.times
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt_text,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
            metrics={
                "arrival_time": arrival,
                "first_token_time": first_token,
                "finished_time": finished,
            },
        )


def beam_search_view(params: BeamSearchParams) -> SamplingParams:
    """The ``SamplingParams`` the API process's output state reads for a beam search: one
    completion per beam, sent once at the end, detokenized without special tokens (its
    temperature is never used here)."""
    return SamplingParams(
        n=params.beam_width,
        max_tokens=params.max_tokens,
        ignore_eos=params.ignore_eos,
        include_stop_str_in_output=params.include_stop_str_in_output,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
