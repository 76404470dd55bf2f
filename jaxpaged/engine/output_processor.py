"""From a step's sampled tokens to ``RequestOutput``s: text, stop strings, logprobs, delta mode.

The scheduler has already appended each sampled token and applied the token-level stops (EOS,
stop_token_ids, max_tokens, max_model_len). Here each request's detokenizer adds the token's
text; a stop string found in it ends the request through ``Scheduler.finish_sequence`` (blocks
freed at once) and, as in vLLM v1, overrides a ``length`` finish of the same step. Logprob
entries become ``{token_id: Logprob}`` dicts; ``RequestOutputKind`` decides whether an output
carries everything so far (CUMULATIVE), only what is new (DELTA) or comes only at the end
(FINAL_ONLY).
"""

from __future__ import annotations

import dataclasses

from jaxpaged.detokenizer import IncrementalDetokenizer
from jaxpaged.outputs import CompletionOutput, PromptLogprobs, RequestOutput, SampleLogprobs
from jaxpaged.sample.logprobs import LogprobsBuilder, ModelRunnerOutput
from jaxpaged.sampling_params import RequestOutputKind
from jaxpaged.sequence import Sequence, SequenceStatus


@dataclasses.dataclass
class RequestState:
    """Everything the frontend keeps about one unfinished request."""

    seq: Sequence
    prompt_text: str | None
    output_kind: RequestOutputKind
    detokenizer: IncrementalDetokenizer
    logprobs: SampleLogprobs | None
    cumulative_logprob: float | None
    prompt_logprobs: PromptLogprobs | None
    num_sent_tokens: int = 0
    prompt_logprobs_sent: bool = False
    first_token_time: float | None = None
    finished_time: float | None = None


class OutputProcessor:
    """Per-request output state of an engine; ``scheduler`` ends requests on stop strings."""

    def __init__(self, tokenizer, scheduler):
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.logprobs_builder = LogprobsBuilder(tokenizer)
        self.requests: dict[str, RequestState] = {}

    def add_request(
        self, seq: Sequence, prompt_text: str | None, output_kind: RequestOutputKind
    ) -> None:
        params = seq.sampling_params
        wants_logprobs = params.logprobs is not None
        prompt_logprobs = None
        if params.prompt_logprobs is not None:
            prompt_logprobs = [None] * seq.num_prompt_tokens
        self.requests[seq.seq_id] = RequestState(
            seq=seq,
            prompt_text=prompt_text,
            output_kind=output_kind,
            detokenizer=IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, params),
            logprobs=[] if wants_logprobs else None,
            cumulative_logprob=0.0 if wants_logprobs else None,
            prompt_logprobs=prompt_logprobs,
        )

    def abort(self, seq_id: str) -> RequestOutput | None:
        """Forget the request and return its final output (the caller aborted the sequence)."""
        state = self.requests.pop(seq_id, None)
        if state is None:
            return None
        return self._make_output(state, finished=True)

    def process(
        self, runner_output: ModelRunnerOutput, updated: list[Sequence], now: float
    ) -> list[RequestOutput]:
        """Commit one step's text and logprobs; return the outputs due this step.

        Args:
            runner_output: what the model runner returned for the step.
            updated: sequences that got a token this step (``Scheduler.update_from_output``).
            now: ``time.monotonic()`` of the step's end.
        """
        builder = self.logprobs_builder
        for seq_id, entries in runner_output.prompt_logprobs.items():
            state = self.requests.get(seq_id)
            if state is None:
                continue
            num_top = state.seq.sampling_params.prompt_logprobs
            for position, entry in entries:  # recompute overwrites the same positions
                state.prompt_logprobs[position] = builder.build(entry, num_top)

        outputs = []
        for seq in updated:
            state = self.requests[seq.seq_id]
            params = seq.sampling_params
            if state.first_token_time is None:
                state.first_token_time = now
            if state.logprobs is not None:
                entry = runner_output.logprobs[seq.seq_id]
                state.logprobs.append(builder.build(entry, params.logprobs))
                state.cumulative_logprob += entry.logprob
            stop = state.detokenizer.update(
                [seq.last_token_id],
                stop_terminated=seq.status is SequenceStatus.FINISHED_STOPPED,
                finished=seq.is_finished,
            )
            if stop is not None:
                self._finish_on_stop_string(seq, stop)
            finished = seq.is_finished
            if finished:
                state.finished_time = now
                del self.requests[seq.seq_id]
            if finished or state.output_kind is not RequestOutputKind.FINAL_ONLY:
                outputs.append(self._make_output(state, finished=finished))
        return outputs

    def _finish_on_stop_string(self, seq: Sequence, stop: str) -> None:
        if seq.is_finished:
            # Finished by length in the same step: the stop string decides the reason (vLLM).
            seq.status = SequenceStatus.FINISHED_STOPPED
            seq.stop_reason = stop
        else:
            self.scheduler.finish_sequence(seq.seq_id, SequenceStatus.FINISHED_STOPPED, stop)

    def _make_output(self, state: RequestState, *, finished: bool) -> RequestOutput:
        seq = state.seq
        delta = state.output_kind is RequestOutputKind.DELTA
        text = state.detokenizer.get_next_output_text(finished=finished, delta=delta)
        start = state.num_sent_tokens if delta else 0
        state.num_sent_tokens = seq.num_output_tokens
        prompt_logprobs = state.prompt_logprobs
        if delta and state.prompt_logprobs_sent:
            prompt_logprobs = None
        state.prompt_logprobs_sent = True
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=seq.output_token_ids[start:],
            cumulative_logprob=state.cumulative_logprob,
            logprobs=None if state.logprobs is None else state.logprobs[start:],
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
        return RequestOutput(
            request_id=seq.seq_id,
            prompt=state.prompt_text,
            prompt_token_ids=list(seq.prompt_token_ids),
            outputs=[completion],
            finished=finished,
            prompt_logprobs=None if prompt_logprobs is None else list(prompt_logprobs),
            num_cached_tokens=seq.num_cached_tokens,
            metrics={
                "arrival_time": seq.arrival_time,
                "first_token_time": state.first_token_time,
                "finished_time": state.finished_time,
            },
        )
