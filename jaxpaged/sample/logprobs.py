"""Log-probabilities: top-k and ranks on the device, ``Logprob`` dicts on the host.

vLLM's conventions (``vllm/v1/sample/sampler.py``, ``vllm/v1/engine/logprobs.py``): the chosen
token's rank is 1 + the number of vocabulary tokens with a strictly higher logprob; the top-k
entries have ranks 1..k; each position's dict holds the chosen token plus the top-k (k or k + 1
entries). ``k`` is static (the engine's ``max_logprobs``) so one compiled step serves every
request's ``logprobs``; the host keeps the first ``logprobs`` of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxpaged.outputs import Logprob

# Prompt positions whose logits are materialised at once: bounds the [chunk, vocab] buffer.
PROMPT_LOGPROBS_CHUNK = 256


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TopLogprobs:
    """Per row: the chosen token's logprob and rank, the ``k`` best tokens and, for rows that
    asked for ``logprob_token_ids``, those ids' logprobs and ranks (``M`` columns: 0, or
    ``MAX_LOGPROB_TOKEN_IDS`` in a step where some row asked)."""

    logprobs: jax.Array  # f32[N]: logprob of the chosen token.
    ranks: jax.Array  # i32[N]: rank of the chosen token (1 = best).
    top_ids: jax.Array  # i32[N, k], best first.
    top_logprobs: jax.Array  # f32[N, k].
    wanted_logprobs: jax.Array  # f32[N, M]: of the row's logprob_token_ids, in its order.
    wanted_ranks: jax.Array  # i32[N, M].

    @classmethod
    def zeros(cls, n: int, k: int) -> TopLogprobs:
        return cls(
            jnp.zeros(n, jnp.float32),
            jnp.zeros(n, jnp.int32),
            jnp.zeros((n, k), jnp.int32),
            jnp.zeros((n, k), jnp.float32),
            jnp.zeros((n, 0), jnp.float32),
            jnp.zeros((n, 0), jnp.int32),
        )


def top_logprobs(
    logprobs: jax.Array, token_ids: jax.Array, k: int, wanted: jax.Array | None = None
) -> TopLogprobs:
    """Rank and top-k of ``token_ids`` (i32[N]) under ``logprobs`` (f32[N, vocab_size]), and
    the logprobs and ranks of ``wanted`` (i32[N, M], -1 where a row wants no more ids; None:
    none wanted)."""
    n = logprobs.shape[0]
    chosen = jnp.take_along_axis(logprobs, token_ids[:, None], axis=-1)
    ranks = 1 + jnp.sum(logprobs > chosen, axis=-1, dtype=jnp.int32)
    if k == 0:
        top_values = jnp.zeros((n, 0), jnp.float32)
        top_ids = jnp.zeros((n, 0), jnp.int32)
    else:
        top_values, top_ids = jax.lax.top_k(logprobs, k)
    wanted_values, wanted_ranks = jnp.zeros((n, 0), jnp.float32), jnp.zeros((n, 0), jnp.int32)
    if wanted is not None:
        wanted_values = jnp.take_along_axis(logprobs, jnp.maximum(wanted, 0), axis=-1)
        # One id column at a time: each is a compare-and-count over [N, vocab_size] that XLA
        # fuses, where all M at once could hold an [N, M, vocab_size] mask.
        above = jax.lax.map(
            lambda column: jnp.sum(logprobs > column[:, None], axis=-1, dtype=jnp.int32),
            wanted_values.T,
        ).T
        wanted_ranks = jnp.where(wanted >= 0, 1 + above, 0)  # 0: no id in that column
    return TopLogprobs(
        chosen[:, 0], ranks, top_ids.astype(jnp.int32), top_values, wanted_values, wanted_ranks
    )


def sampled_logprobs(
    logits: jax.Array, token_ids: jax.Array, metadata, top: TopLogprobs
) -> jax.Array:
    """f32[B]: the logprob of each row's sampled token, for ``cumulative_logprob``.

    Rows that asked for logprobs take the value they report (``top.logprobs``, raw or processed
    by their ``logprobs_mode``), so the cumulative logprob is the sum of the reported ones as in
    vLLM v1; other rows take the raw model logprob (``logits[token] - logsumexp(logits)``), one
    reduction over the vocabulary, which best_of ranking needs even without logprobs.

    Args:
        logits: f32[B, vocab_size] raw model logits; token_ids: i32[B], the sampled tokens.
        metadata: the step's ``SamplingMetadata`` (``num_logprobs``, ``[B]``).
        top: the sampler's ``TopLogprobs`` (zeros unless some row asked).
    """
    logits = logits.astype(jnp.float32)
    chosen = jnp.take_along_axis(logits, token_ids[:, None], axis=-1)[:, 0]
    raw = chosen - jax.nn.logsumexp(logits, axis=-1)
    return jnp.where(metadata.num_logprobs >= 0, top.logprobs, raw)


def prompt_top_logprobs(
    hidden: jax.Array,
    compute_logits: Callable[[jax.Array], jax.Array],
    targets: jax.Array,
    k: int,
) -> TopLogprobs:
    """Raw logprobs of each token's successor in the prompt, for every token of the step.

    Args:
        hidden: [T, hidden_size], the model's final hidden state per token.
        compute_logits: the LM head, ``[N, hidden_size] -> f32[N, vocab_size]``.
        targets: i32[T], the next prompt token per token; -1 where none is wanted (its result is
            garbage and ignored by the host).
        k: top logprobs per position (static).

    Returns:
        ``TopLogprobs`` with ``N = T``. Logits are computed ``PROMPT_LOGPROBS_CHUNK`` tokens at a
        time, so memory stays at ``[chunk, vocab_size]`` whatever ``T`` is.
    """
    t = hidden.shape[0]
    targets = jnp.maximum(targets, 0)

    def one_chunk(args):
        h, ids = args
        logprobs = jax.nn.log_softmax(compute_logits(h).astype(jnp.float32), axis=-1)
        return top_logprobs(logprobs, ids, k)

    if t <= PROMPT_LOGPROBS_CHUNK:
        return one_chunk((hidden, targets))
    chunk = PROMPT_LOGPROBS_CHUNK
    num_chunks = -(-t // chunk)
    pad = num_chunks * chunk - t
    hidden = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(num_chunks, chunk, -1)
    targets = jnp.pad(targets, (0, pad)).reshape(num_chunks, chunk)
    out = jax.lax.map(one_chunk, (hidden, targets))
    return jax.tree.map(lambda x: x.reshape(num_chunks * chunk, *x.shape[2:])[:t], out)


def step_prompt_logprobs(
    hidden: jax.Array,
    logits: jax.Array,
    compute_logits: Callable[[jax.Array], jax.Array],
    targets: jax.Array,
    k: int,
    *,
    decode_only: bool,
    enabled: bool,
) -> TopLogprobs:
    """``prompt_top_logprobs`` for a step; zeros unless ``enabled`` (static: the host knows
    whether some token wants its prompt logprob).

    Args:
        hidden: [T, hidden_size]; logits: f32[B, vocab_size], the sampled rows' logits.
        decode_only: static; then token ``i`` is row ``i`` of ``logits`` (``T == B``), which
            serve as they are instead of a second pass through the LM head.
    """

    if not enabled:
        return TopLogprobs.zeros(hidden.shape[0], k)
    if decode_only:
        logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return top_logprobs(logprobs, jnp.maximum(targets, 0), k)
    return prompt_top_logprobs(hidden, compute_logits, targets, k)


class TokenLogprobs(NamedTuple):
    """Host copy of one position's logprobs: the chosen token, the top-k (best first) and the
    request's ``logprob_token_ids`` (in its order; empty when it gave none)."""

    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]
    wanted_logprobs: list[float] = []
    wanted_ranks: list[int] = []


class LogprobsBuilder:
    """Turns ``TokenLogprobs`` into vLLM's ``{token_id: Logprob}`` dicts.

    ``decoded_token`` is ``tokenizer.decode([token_id])`` with the leading space that
    SentencePiece's decode strips put back (as current vLLM does), cached per id.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def decoded(self, token_id: int) -> str | None:
        if self.tokenizer is None:  # skip_tokenizer_init: no text, as vLLM reports None
            return None
        text = self._text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) or ""
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and piece.startswith("\u2581") and not text.startswith(" "):
                text = " " + text
            self._text[token_id] = text
        return text

    def build(
        self, entry: TokenLogprobs, num_top: int, only: list[int] | None = None
    ) -> dict[int, Logprob]:
        """The chosen token first, then the ``num_top`` best tokens (ranks 1..num_top) or,
        with ``only`` (``logprob_token_ids``), those ids in their order with their logprobs and
        true ranks (``entry.wanted_*``, computed for the same ids in the same order)."""
        out = {entry.token_id: Logprob(entry.logprob, entry.rank, self.decoded(entry.token_id))}
        if only is not None:
            for token_id, logprob, rank in zip(
                only, entry.wanted_logprobs, entry.wanted_ranks, strict=True
            ):
                if token_id not in out:
                    out[token_id] = Logprob(logprob, rank, self.decoded(token_id))
            return out
        for rank, (token_id, logprob) in enumerate(
            zip(entry.top_ids[:num_top], entry.top_logprobs[:num_top], strict=True), start=1
        ):
            if token_id not in out:
                out[token_id] = Logprob(logprob, rank, self.decoded(token_id))
        return out
