"""From a step's sampled tokens to ``RequestOutput``s: text, stop strings, logprobs, delta mode.

The scheduler has already appended each sampled token and applied the token-level stops (EOS,
stop_token_ids, max_tokens, max_model_len). Here each sequence's detokenizer adds the token's
text; a stop string found in it ends that sequence through ``Scheduler.finish_sequence`` (blocks
freed at once; the request ends with its last sequence) and, as in vLLM v1, overrides a
``length`` finish of the same step. Logprob entries become ``{token_id: Logprob}`` dicts;
``RequestOutputKind`` decides whether an output carries everything so far (CUMULATIVE), only
what is new (DELTA) or comes only at the end (FINAL_ONLY).

The engine core's path (``process(token_deltas=True)``) skips the text: each due output is its
token delta (``engine/deltas.py``), built straight from the sequences, without
``RequestOutput`` objects, a prompt copy or a detokenizer call; the API process, which has the
text, detokenizes and looks for stop strings (``client_outputs``).

A request is a ``SequenceGroup``: one sequence, the ``best_of`` samples of parallel sampling or
the beams of a beam search. Each sequence keeps its own detokenizer and logprobs; which of them
are reported, and in what order, is ``group_outputs.ranked_completions``.
"""

from __future__ import annotations

import dataclasses

from jaxpaged.detokenizer import IncrementalDetokenizer
from jaxpaged.engine.deltas import completion_delta, logprobs_delta, request_delta, token_delta
from jaxpaged.engine.group_outputs import ranked_completions
from jaxpaged.outputs import CompletionOutput, PromptLogprobs, RequestOutput, SampleLogprobs
from jaxpaged.sample.logprobs import LogprobsBuilder
from jaxpaged.sampling_params import RequestOutputKind
from jaxpaged.sequence import Sequence, SequenceGroup, SequenceStatus
from jaxpaged.worker.step_output import ModelRunnerOutput


@dataclasses.dataclass
class SequenceState:
    """Output state of one sequence of a request."""

    detokenizer: IncrementalDetokenizer
    logprobs: SampleLogprobs | None
    num_fed_tokens: int = 0  # output tokens committed (given to the detokenizer) so far
    num_sent_tokens: int = 0  # output tokens already reported (DELTA mode)


@dataclasses.dataclass
class RequestState:
    """Everything the frontend keeps about one unfinished request."""

    group: SequenceGroup
    prompt_text: str | None
    output_kind: RequestOutputKind
    prompt_logprobs: PromptLogprobs | None
    seqs: dict[str, SequenceState] = dataclasses.field(default_factory=dict)
    prompt_logprobs_sent: bool = False
    first_token_time: float | None = None
    finished_time: float | None = None


class OutputProcessor:
    """Per-request output state of an engine; ``scheduler`` ends sequences on stop strings."""

    def __init__(self, tokenizer, scheduler):
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.logprobs_builder = LogprobsBuilder(tokenizer)
        self.requests: dict[str, RequestState] = {}

    def add_request(
        self, group: SequenceGroup, prompt_text: str | None, output_kind: RequestOutputKind
    ) -> None:
        """Track ``group`` (its first sequence holds the prompt). Beam searches report only
        their final output: beams are ranked only once the search ends."""
        seq = group.seqs[0]
        prompt_logprobs = None
        if getattr(seq.sampling_params, "prompt_logprobs", None) is not None:
            prompt_logprobs = [None] * seq.num_prompt_tokens
        if group.is_beam_search:
            output_kind = RequestOutputKind.FINAL_ONLY
        state = RequestState(
            group=group,
            prompt_text=prompt_text,
            output_kind=output_kind,
            prompt_logprobs=prompt_logprobs,
        )
        self.requests[group.request_id] = state
        self._seq_state(state, seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Forget the request and return its final output (the caller aborted its sequences)."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        return self._make_output(state, finished=True)

    def process(
        self,
        runner_output: ModelRunnerOutput,
        updated: list[Sequence],
        now: float,
        *,
        token_deltas: bool = False,
    ) -> list[RequestOutput] | list[list]:
        """Commit one step's text and logprobs; return the outputs due this step, one per
        request that advanced or finished.

        Args:
            runner_output: what the model runner returned for the step.
            updated: sequences that got a token this step (``Scheduler.update_from_output``),
                or finished while it was scheduled.
            now: ``time.monotonic()`` of the step's end.
            token_deltas: return token deltas (``engine/deltas.py``) instead of
                ``RequestOutput``s, and run no detokenizer (no text, no stop strings: the
                engine core's requests have none; the API process looks for them).
        """
        builder = self.logprobs_builder
        for seq_id, entries in runner_output.prompt_logprobs.items():
            state = self._state_of_seq(seq_id)
            if state is None:
                continue
            num_top = state.group.sampling_params.prompt_logprobs
            for position, entry in entries:  # recompute overwrites the same positions
                state.prompt_logprobs[position] = builder.build(entry, num_top)

        advanced: dict[str, RequestState] = {}
        for seq in updated:
            state = self.requests.get(seq.group.request_id)
            if state is None:
                continue
            advanced[seq.group.request_id] = state
            if state.first_token_time is None and seq.output_token_ids:
                state.first_token_time = now
            self._commit_tokens(state, seq, runner_output, detokenize=not token_deltas)

        make_output = self._make_delta if token_deltas else self._make_output
        outputs = []
        for request_id, state in advanced.items():
            finished = state.group.is_finished
            if finished:
                state.finished_time = now
                del self.requests[request_id]
            if finished or state.output_kind is not RequestOutputKind.FINAL_ONLY:
                outputs.append(make_output(state, finished=finished))
        return outputs

    def _commit_tokens(
        self,
        state: RequestState,
        seq: Sequence,
        runner_output: ModelRunnerOutput,
        *,
        detokenize: bool,
    ) -> None:
        seq_state = self._seq_state(state, seq)
        new_ids = seq.output_token_ids[seq_state.num_fed_tokens :]
        seq_state.num_fed_tokens = seq.num_output_tokens
        if not new_ids:  # finished while scheduled (aborted or ignored): nothing new
            return
        params = seq.sampling_params
        entry = runner_output.logprobs.get(seq.seq_id)
        if seq_state.logprobs is not None and entry is not None:
            seq_state.logprobs.append(
                self.logprobs_builder.build(entry, params.logprobs, params.logprob_token_ids)
            )
        if not detokenize:
            return
        stop = seq_state.detokenizer.update(
            new_ids,
            stop_terminated=seq.status is SequenceStatus.FINISHED_STOPPED,
            finished=seq.is_finished,
        )
        if stop is not None:
            self._finish_on_stop_string(seq, stop)

    def _seq_state(self, state: RequestState, seq: Sequence) -> SequenceState:
        """The sequence's output state, created on first sight (forked sequences appear when
        the scheduler forks them: parallel samples before their first token, beams with their
        parent's tokens, which the next update feeds to the new detokenizer at once)."""
        seq_state = state.seqs.get(seq.seq_id)
        if seq_state is None:
            params = seq.sampling_params
            wants_logprobs = getattr(params, "logprobs", None) is not None
            seq_state = SequenceState(
                detokenizer=IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, params),
                logprobs=[] if wants_logprobs else None,
            )
            state.seqs[seq.seq_id] = seq_state
        return seq_state

    def _state_of_seq(self, seq_id: str) -> RequestState | None:
        state = self.requests.get(seq_id)
        if state is not None:
            return state
        for state in self.requests.values():  # a forked sequence: "<request_id>#<k>"
            if any(seq.seq_id == seq_id for seq in state.group.seqs):
                return state
        return None

    def _finish_on_stop_string(self, seq: Sequence, stop: str) -> None:
        if seq.is_finished:
            # Finished by length in the same step: the stop string decides the reason (vLLM).
            seq.status = SequenceStatus.FINISHED_STOPPED
            seq.stop_reason = stop
        else:
            self.scheduler.finish_sequence(seq.seq_id, SequenceStatus.FINISHED_STOPPED, stop)

    def _make_output(self, state: RequestState, *, finished: bool) -> RequestOutput:
        group = state.group
        delta = state.output_kind is RequestOutputKind.DELTA
        completions = []
        for index, seq in enumerate(ranked_completions(group)):
            seq_state = self._seq_state(state, seq)
            if seq_state.num_fed_tokens < seq.num_output_tokens:  # e.g. a beam never updated
                seq_state.detokenizer.update(
                    seq.output_token_ids[seq_state.num_fed_tokens :],
                    stop_terminated=seq.status is SequenceStatus.FINISHED_STOPPED,
                    finished=finished,
                )
                seq_state.num_fed_tokens = seq.num_output_tokens
            seq_finished = finished or seq.is_finished
            text = seq_state.detokenizer.get_next_output_text(finished=seq_finished, delta=delta)
            start, logprobs, cumulative_logprob = _take_new(group, seq_state, seq, delta)
            completions.append(
                CompletionOutput(
                    index=index,
                    text=text,
                    token_ids=seq.output_token_ids[start:],
                    cumulative_logprob=cumulative_logprob,
                    logprobs=logprobs,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        prompt_logprobs = _take_prompt_logprobs(state, delta)
        parent = group.seqs[0]
        return RequestOutput(
            request_id=group.request_id,
            prompt=state.prompt_text,
            prompt_token_ids=list(parent.prompt_token_ids),
            outputs=completions,
            finished=finished,
            prompt_logprobs=None if prompt_logprobs is None else list(prompt_logprobs),
            num_cached_tokens=group.num_cached_tokens or 0,
            metrics={
                "arrival_time": group.arrival_time,
                "first_scheduled_time": group.first_scheduled_time,
                "first_token_time": state.first_token_time,
                "finished_time": state.finished_time,
            },
        )

    def _make_delta(self, state: RequestState, *, finished: bool) -> list:
        """``_make_output``'s content as a token delta, without text: the same completions,
        token ids, logprobs and reasons (``deltas.request_delta``), or just the new token
        (``deltas.token_delta``) when nothing else changed."""
        group = state.group
        delta = state.output_kind is RequestOutputKind.DELTA
        if delta and not finished and len(group.seqs) == 1:
            seq = group.seqs[0]
            seq_state = self._seq_state(state, seq)
            sent = seq_state.num_sent_tokens
            # After the first output (which carried the times, cached count and prompt
            # logprobs), one new token of a running sequence without logprobs.
            if sent and seq.num_output_tokens == sent + 1 and seq_state.logprobs is None:
                seq_state.num_sent_tokens = sent + 1
                return token_delta(group.request_id, seq.output_token_ids[-1])
        completions = []
        for index, seq in enumerate(ranked_completions(group)):
            start, logprobs, cumulative_logprob = _take_new(
                group, self._seq_state(state, seq), seq, delta
            )
            completions.append(
                completion_delta(
                    index,
                    seq.output_token_ids[start:],
                    cumulative_logprob,
                    logprobs_delta(logprobs),
                    seq.finish_reason,
                    seq.stop_reason,
                )
            )
        prompt_logprobs = _take_prompt_logprobs(state, delta)
        return request_delta(
            group.request_id,
            finished,
            group.num_cached_tokens or 0,
            [group.arrival_time, state.first_token_time, state.finished_time],
            completions,
            logprobs_delta(prompt_logprobs),
        )


def _take_new(
    group: SequenceGroup, seq_state: SequenceState, seq: Sequence, delta: bool
) -> tuple[int, SampleLogprobs | None, float | None]:
    """What an output reports of ``seq``: ``(start, logprobs, cumulative_logprob)``, its
    output tokens from ``start`` on (all, or in DELTA mode those not reported before), and
    marks them reported."""
    start = seq_state.num_sent_tokens if delta else 0
    seq_state.num_sent_tokens = seq.num_output_tokens
    if group.is_beam_search:
        # Beams report their candidates' logprobs and score whatever was asked.
        return start, list(seq.beam_logprobs), seq.cumulative_logprob
    if seq_state.logprobs is not None:
        return start, seq_state.logprobs[start:], seq.cumulative_logprob
    return start, None, None  # vLLM v1: a cumulative logprob only with logprobs


def _take_prompt_logprobs(state: RequestState, delta: bool) -> PromptLogprobs | None:
    """The prompt logprobs an output reports (in DELTA mode only the first output has them)."""
    prompt_logprobs = state.prompt_logprobs
    if delta and state.prompt_logprobs_sent:
        prompt_logprobs = None
    state.prompt_logprobs_sent = True
    return prompt_logprobs
