"""On-device sampling from per-row parameter arrays (no recompilation when parameters change).

One row per sequence, in vLLM v1's order (``vllm/v1/sample/sampler.py``): request rows from
``LogitsState`` (allowed ids, logit bias, min_tokens, penalties; see ``penalties.py``), greedy
argmax of the result, then temperature, min-p, top-k and top-p (renormalised over what min-p and
top-k kept), then a draw. Work that no row of the step needs (the state gather, the sort behind
the filters, log-softmax and top-k for logprobs) is left out of the compiled step by the
host-chosen ``SamplerVariant``.

Each row draws from a key derived from ``(seed, step)`` alone, so a seeded request produces the
same tokens whatever else shares its batch (batch invariance), and recompute preemption replays
the same draws. The draw is the Gumbel-max trick: ``argmax(logits / T + Gumbel)`` is distributed
as ``softmax(logits / T)`` (Gumbel 1954); vLLM's exponential race ``argmax(p / Exp(1))`` is the
same trick.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpaged.sample.logits_state import LogitsState
from jaxpaged.sample.logprobs import TopLogprobs, top_logprobs
from jaxpaged.sample.metadata import SamplerVariant, SamplingMetadata
from jaxpaged.sample.penalties import apply_logits_state, count_sampled


def sample(
    logits: jax.Array,
    metadata: SamplingMetadata,
    state: LogitsState,
    *,
    num_logprobs: int,
    variant: SamplerVariant,
) -> tuple[jax.Array, TopLogprobs, LogitsState]:
    """Sample one token per row.

    Args:
        logits: f32[B, vocab_size] raw model logits.
        metadata: per-row parameters, each ``[B]``.
        state: per-request rows; rows that sampled for real (``count_sampled``) get their token
            counted.
        num_logprobs: top logprobs computed per row (static; the engine's ``max_logprobs``).
        variant: the optional stages this step runs (static); a stage left out behaves as if
            no row asked for it.

    Returns:
        ``(token_ids i32[B], logprobs, state)``. ``logprobs`` report each row's
        ``logprobs_mode`` (:func:`logprobs_by_mode`); zeros unless ``variant.logprobs``.
    """
    logits = logits.astype(jnp.float32)
    processed = apply_logits_state(logits, state, metadata) if variant.uses_state else logits
    greedy_ids = jnp.argmax(processed, axis=-1).astype(jnp.int32)

    is_greedy = metadata.temperature == 0.0
    temperature = jnp.where(is_greedy, 1.0, metadata.temperature)
    scaled = processed / temperature[:, None]
    if variant.filters:
        scaled = apply_min_p_top_k_top_p(scaled, metadata.min_p, metadata.top_k, metadata.top_p)
    keys = jax.vmap(row_key)(metadata.seed_lo, metadata.seed_hi, metadata.step)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],), jnp.float32))(keys)
    sampled_ids = jnp.argmax(scaled + gumbel, axis=-1).astype(jnp.int32)
    token_ids = jnp.where(is_greedy, greedy_ids, sampled_ids)

    if variant.logprobs:
        chosen = logprobs_by_mode(logits, scaled, metadata.logprobs_mode)
        wanted = state.logprob_token_ids[metadata.state_slot] if variant.token_logprobs else None
        logprobs = top_logprobs(chosen, token_ids, num_logprobs, wanted)
    else:
        logprobs = TopLogprobs.zeros(logits.shape[0], num_logprobs)
    if variant.uses_state:
        uses_state = metadata.state_slot != state.neutral_slot
        count = jnp.where(uses_state, metadata.count_sampled, 0)
        state = count_sampled(state, metadata.state_slot, token_ids, count)
    return token_ids, logprobs, state


def logprobs_by_mode(logits: jax.Array, scaled: jax.Array, mode: jax.Array) -> jax.Array:
    """f32[B, vocab_size]: per row, what its ``logprobs_mode`` reports (vLLM v1's sampler):
    raw = the model's float32 logits (``logits``) before any processing, processed = what was
    sampled from (``scaled``: after penalties, bias, temperature and min-p/top-k/top-p, whose
    dropped tokens are -inf; greedy rows: after penalties); bit 0 of ``mode`` picks processed,
    bit 1 logits rather than their log-softmax."""
    processed = (mode & 1)[:, None] != 0
    as_logits = (mode & 2)[:, None] != 0
    values = jnp.where(processed, scaled, logits)
    return jnp.where(as_logits, values, jax.nn.log_softmax(values, axis=-1))


def row_key(seed_lo: jax.Array, seed_hi: jax.Array, step: jax.Array) -> jax.Array:
    """The PRNG key of one row's draw for its output token number ``step`` (u32, u32, i32
    scalars); the same for a request's token wherever and whenever it is sampled."""
    key = jax.random.key(0)
    key = jax.random.fold_in(key, seed_lo)
    key = jax.random.fold_in(key, seed_hi)
    return jax.random.fold_in(key, step)


def apply_min_p_top_k_top_p(
    logits: jax.Array, min_p: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> jax.Array:
    """Mask (to -inf) tokens below the min-p floor, outside the top-k, or outside the top-p
    nucleus of what min-p and top-k kept (vLLM v1's order).

    Args:
        logits: f32[B, vocab_size], already divided by the temperature.
        min_p: f32[B]; keep tokens with ``p >= min_p * p_max``; 0 means off.
        top_k: i32[B]; keep the ``top_k`` most likely; 0 means off.
        top_p: f32[B]; keep the most likely tokens until their renormalised mass reaches top_p
            (the token that crosses it stays in); 1 means off.

    Returns:
        f32[B, vocab_size]; tokens tied with the least likely kept one are kept too.
    """
    vocab_size = logits.shape[-1]
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]  # descending
    ranks = jnp.arange(vocab_size)[None, :]
    # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p); log(0) = -inf keeps all.
    keep = sorted_logits >= sorted_logits[:, :1] + jnp.log(min_p)[:, None]
    keep &= ranks < jnp.where(top_k > 0, top_k, vocab_size)[:, None]

    sorted_probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    # Exclusive cumulative sum: a token is kept if the mass before it is below top_p, so the
    # token that crosses the threshold stays in (and the top token always does). top_p = 1 is
    # tested apart: the float32 cumsum can reach 1 before the tail, which would drop tokens.
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep &= (mass_before < top_p[:, None]) | (ranks == 0) | (top_p >= 1.0)[:, None]

    # The smallest kept logit is the row's threshold; ties with it stay in.
    threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits >= threshold, logits, -jnp.inf)
