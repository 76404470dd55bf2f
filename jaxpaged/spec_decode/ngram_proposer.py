"""N-gram (prompt lookup) proposals over each sequence's token history, on the device.

vLLM's n-gram proposer (``vllm/v1/spec_decode/ngram_proposer.py``, after Saxena's prompt lookup
decoding): for a context ``x[0:len]`` (prompt and outputs so far), find the longest ``n`` in
``[prompt_lookup_min, prompt_lookup_max]`` whose suffix ``x[len - n:len]`` also occurs earlier,
at some ``x[p:p + n]`` with ``p < len - n``; among the occurrences of that longest suffix take
the earliest ``p``; propose the tokens that follow it, ``x[p + n:p + n + k]``, with
``k = min(K, max_model_len - len)`` and fewer when the context ends first (the continuation may
run into the suffix itself, which continues a repeating pattern). No match: no drafts.

vLLM 0.34 runs the same search on the GPU (``ngram_gpu``) but breaks ties towards the latest
occurrence and pads short drafts with the last token; the earliest occurrence is kept here
because it gives a periodic context (period shorter than K) all K continuation tokens, where
the latest gives at most one period.

:func:`ngram_propose` is jittable over a padded ``[B, L]`` token buffer: one equality map per
suffix offset ``m < prompt_lookup_max`` (``x[e - m] == x[len - 1 - m]``), whose leading run of
trues at each end position ``e`` is the length of the match ending there; ``O(B * L * max_n)``
compares, no host work. :func:`ngram_propose_reference` is the definition above in plain Python.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


@functools.partial(
    jax.jit, static_argnames=("num_speculative_tokens", "min_n", "max_n", "max_model_len")
)
def ngram_propose(
    token_ids: jax.Array,
    lengths: jax.Array,
    *,
    num_speculative_tokens: int,
    min_n: int,
    max_n: int,
    max_model_len: int,
) -> tuple[jax.Array, jax.Array]:
    """Propose up to ``K = num_speculative_tokens`` tokens per sequence by prompt lookup.

    Args:
        token_ids: i32[B, L] each sequence's tokens (prompt then outputs) from column 0;
            columns at or past its length are ignored (any value).
        lengths: i32[B] tokens of each sequence, in [0, L]; 0 for padding rows.
        num_speculative_tokens: K (static).
        min_n, max_n: ``prompt_lookup_min`` / ``prompt_lookup_max``, 1 <= min_n <= max_n
            (static).
        max_model_len: no draft may take a sequence past this many tokens (static).

    Returns:
        ``(draft_ids i32[B, K], num_draft i32[B])``: the proposals, -1 past ``num_draft``.
    """
    b, width = token_ids.shape
    k = num_speculative_tokens
    cols = jnp.arange(width)[None, :]
    # x[len - 1 - m] for each suffix offset m, and run[b, e] = length of the match ending at e.
    last = lengths[:, None] - 1 - jnp.arange(max_n)[None, :]  # [B, max_n]
    suffix = jnp.take_along_axis(token_ids, jnp.maximum(last, 0), axis=1)
    run = jnp.zeros((b, width), jnp.int32)
    alive = jnp.ones((b, width), jnp.bool_)
    for m in range(max_n):
        shifted = jnp.pad(token_ids, ((0, 0), (m, 0)), constant_values=-1)[:, :width]
        alive &= (shifted == suffix[:, m : m + 1]) & (cols >= m) & (last[:, m : m + 1] >= 0)
        run += alive
    # A match must end before the last token (x[len - 1] is the suffix itself).
    run = jnp.where(cols <= lengths[:, None] - 2, run, 0)
    best_n = jnp.max(run, axis=1)
    found = best_n >= min_n
    end = jnp.argmax(run >= jnp.maximum(best_n, 1)[:, None], axis=1)  # the earliest end
    start = end + 1  # first proposed token, p + n
    count = jnp.minimum(jnp.minimum(k, lengths - start), max_model_len - lengths)
    num_draft = jnp.where(found, jnp.maximum(count, 0), 0).astype(jnp.int32)
    j = jnp.arange(k)[None, :]
    gather = jnp.minimum(start[:, None] + j, width - 1)
    drafts = jnp.take_along_axis(token_ids, gather, axis=1)
    return jnp.where(j < num_draft[:, None], drafts, -1).astype(jnp.int32), num_draft


def ngram_propose_reference(
    context: list[int], *, num_speculative_tokens: int, min_n: int, max_n: int,
    max_model_len: int,
) -> list[int]:  # fmt: skip
    """The proposal for one sequence, straight from the definition (module docstring)."""
    length = len(context)
    k = min(num_speculative_tokens, max_model_len - length)
    if k <= 0:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = context[length - n :]
        for p in range(length - n):
            if context[p : p + n] == suffix:
                return context[p + n : p + n + k]
    return []


def ngram_propose_batch_reference(
    token_ids: np.ndarray, lengths: np.ndarray, **kwargs
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`ngram_propose_reference` row by row, in :func:`ngram_propose`'s output layout."""
    k = kwargs["num_speculative_tokens"]
    drafts = np.full((len(lengths), k), -1, np.int32)
    num = np.zeros(len(lengths), np.int32)
    for i, n in enumerate(lengths):
        proposal = ngram_propose_reference([int(t) for t in token_ids[i, :n]], **kwargs)
        drafts[i, : len(proposal)] = proposal
        num[i] = len(proposal)
    return drafts, num
