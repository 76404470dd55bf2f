"""Token deltas: what one step reports of a request when the caller detokenizes it itself.

``LLMEngine.step(token_deltas=True)`` (``OutputProcessor.process``) hands these out instead of
``RequestOutput``s: text-free, with only what is new since the request's previous delta. They are
plain lists of ints, floats, strings and None in the layouts below, built straight from the
sequences: the engine core sends them across the process boundary as they are (msgpack,
``engine_core.core_messages``), and the common decode step costs one two-element list.

- Short delta, ``token_delta``: ``[request_id, token_id]``, one new token for the request's only
  completion (index 0), which is unfinished and has no logprobs; nothing else changed since
  the previous delta (``num_cached_tokens``, the times and prompt logprobs went with an earlier
  full delta).
- Full delta, ``request_delta``: ``[request_id, finished, num_cached_tokens, [arrival_time,
  first_token_time, finished_time], completions, prompt_logprobs]``; a completion
  (``completion_delta``) is ``[index, new token ids, cumulative_logprob, new logprobs,
  finish_reason, stop_reason]``; logprobs positions (``logprobs_delta``) are ``[[token_id,
  logprob, rank], ...]`` or None each.
"""

from __future__ import annotations


def logprobs_delta(steps: list | None) -> list | None:
    """Logprobs positions (``{token_id: Logprob}`` or None each; a beam's are ``{token_id:
    float}``, rank None) as ``[[token_id, logprob, rank], ...]`` or None each (the decoded
    text stays behind); None stays None."""
    if steps is None:
        return None
    return [
        None
        if step is None
        else [
            [t, lp, None] if isinstance(lp, float) else [t, lp.logprob, lp.rank]
            for t, lp in step.items()
        ]
        for step in steps
    ]


def completion_delta(
    index: int,
    token_ids: list[int],
    cumulative_logprob: float | None,
    logprobs: list | None,
    finish_reason: str | None,
    stop_reason: int | str | None,
) -> list:
    """One completion's delta: ``[index, new token ids (list of int), cumulative_logprob,
    new logprobs (logprobs_delta), finish_reason, stop_reason]``. The token ids are a list:
    one or two per step pack faster than an array."""
    return [index, token_ids, cumulative_logprob, logprobs, finish_reason, stop_reason]


def request_delta(
    request_id: str,
    finished: bool,
    num_cached_tokens: int,
    times: list,
    completions: list,
    prompt_logprobs: list | None,
) -> list:
    """One request's full delta: ``[request_id, finished, num_cached_tokens, [arrival,
    first_token, finished] times (time.monotonic() or None each), completions
    (completion_delta), prompt_logprobs (logprobs_delta)]``."""
    return [request_id, finished, num_cached_tokens, times, completions, prompt_logprobs]


def token_delta(request_id: str, token_id: int) -> list:
    """The short delta of the common decode step, ``[request_id, token_id]`` (about a quarter
    of a full delta's msgpack cost)."""
    return [request_id, token_id]


def delta_finished(delta: list) -> bool:
    """Whether a delta (full or short) ends its request."""
    return len(delta) > 2 and delta[1]
