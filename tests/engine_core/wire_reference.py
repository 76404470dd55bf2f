"""The engine core's wire delta of a ``RequestOutput``: the path the core took before it built
deltas from the sequences (``OutputProcessor.process(token_deltas=True)``), kept as the
reference the tests compare that path with."""

from __future__ import annotations

from jaxpaged.engine.deltas import completion_delta, logprobs_delta, request_delta
from jaxpaged.outputs import RequestOutput


def encode_output(output: RequestOutput) -> list:
    """The wire delta (``deltas.request_delta``) of a ``RequestOutput`` whose completions hold only
    what is new (DELTA). Text and the prompt stay behind: the API process has them."""
    metrics = output.metrics or {}
    completions = [
        completion_delta(
            c.index,
            list(c.token_ids),
            c.cumulative_logprob,
            logprobs_delta(c.logprobs),
            c.finish_reason,
            c.stop_reason,
        )
        for c in output.outputs
    ]
    return request_delta(
        output.request_id,
        output.finished,
        output.num_cached_tokens,
        [metrics.get(k) for k in ("arrival_time", "first_token_time", "finished_time")],
        completions,
        logprobs_delta(output.prompt_logprobs),
    )
