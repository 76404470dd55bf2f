"""On-device sampling from per-row parameter arrays (no recompilation when parameters change).

Each row draws from a key derived from ``(seed, step)`` alone, so a seeded request produces the
same tokens whatever else shares its batch (batch invariance), and recompute preemption replays
the same draws. Sampling is the Gumbel-max trick (``argmax(logits / T + Gumbel)`` draws from
``softmax(logits / T)``; Gumbel 1954, as used by vLLM's FlashInfer-free path).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling parameters; every field is ``[B]``, padding rows are greedy."""

    temperature: jax.Array  # f32[B]; 0 means greedy, otherwise already floored at 0.01.
    top_k: jax.Array  # i32[B]; 0 means off.
    top_p: jax.Array  # f32[B]; 1 means off.
    min_p: jax.Array  # f32[B]; 0 means off.
    seed_lo: jax.Array  # u32[B]; low 32 bits of the request's seed.
    seed_hi: jax.Array  # u32[B]; high 32 bits of the request's seed.
    step: jax.Array  # i32[B]; index of the token being sampled (number of outputs so far).


def sample(
    logits: jax.Array, metadata: SamplingMetadata, *, apply_filters: bool | None = None
) -> tuple[jax.Array, jax.Array]:
    """Sample one token per row.

    Args:
        logits: f32[B, vocab_size] raw model logits.
        metadata: per-row parameters, each ``[B]``.
        apply_filters: static choice of the top-k/top-p/min-p pass when the caller knows it
            (True: run it, False: no row filters). None decides on the device with a
            ``lax.cond``, which XLA:GPU implements by copying the predicate to the host and
            waiting for it: a host sync in the middle of the step.

    Returns:
        ``(token_ids i32[B], logprobs f32[B])``; logprobs are the sampled tokens' log-probabilities
        under the raw model distribution (vLLM's default, before temperature and filtering).
    """
    logits = logits.astype(jnp.float32)
    raw_logprobs = jax.nn.log_softmax(logits, axis=-1)
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    is_greedy = metadata.temperature == 0.0
    temperature = jnp.where(is_greedy, 1.0, metadata.temperature)
    scaled = logits / temperature[:, None]
    filters = lambda x: _apply_top_k_top_p_min_p(  # noqa: E731
        x, metadata.top_k, metadata.top_p, metadata.min_p
    )
    if apply_filters is None:
        needs_filter = jnp.any(
            (metadata.top_k > 0) | (metadata.top_p < 1.0) | (metadata.min_p > 0.0)
        )
        # The sort costs O(V log V) per row; skip it when no row filters (the common case).
        scaled = jax.lax.cond(needs_filter, filters, lambda x: x, scaled)
    elif apply_filters:
        scaled = filters(scaled)
    keys = jax.vmap(_row_key)(metadata.seed_lo, metadata.seed_hi, metadata.step)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],), jnp.float32))(keys)
    sampled_ids = jnp.argmax(scaled + gumbel, axis=-1).astype(jnp.int32)

    token_ids = jnp.where(is_greedy, greedy_ids, sampled_ids)
    logprobs = jnp.take_along_axis(raw_logprobs, token_ids[:, None], axis=-1)[:, 0]
    return token_ids, logprobs


def _row_key(seed_lo: jax.Array, seed_hi: jax.Array, step: jax.Array) -> jax.Array:
    key = jax.random.key(0)
    key = jax.random.fold_in(key, seed_lo)
    key = jax.random.fold_in(key, seed_hi)
    return jax.random.fold_in(key, step)


def _apply_top_k_top_p_min_p(
    logits: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array
) -> jax.Array:
    """Mask (to -inf) tokens outside top-k, the top-p nucleus and the min-p floor.

    Follows vLLM's order: top-k, then top-p over the renormalised top-k set; min-p is relative to
    the most likely token. ``logits`` are already divided by the temperature.
    """
    vocab_size = logits.shape[-1]
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]  # descending
    ranks = jnp.arange(vocab_size)[None, :]
    k = jnp.where(top_k > 0, top_k, vocab_size)[:, None]
    sorted_logits = jnp.where(ranks < k, sorted_logits, -jnp.inf)

    sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
    # Exclusive cumulative sum: a token is kept if the mass before it is below top_p, so the
    # token that crosses the threshold stays in (and the top token always does).
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep = (mass_before < top_p[:, None]) | (ranks == 0)
    keep &= sorted_probs >= min_p[:, None] * sorted_probs[:, :1]
    keep &= ranks < k

    # The smallest kept logit is the row's threshold; ties with it stay in.
    threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits >= threshold, logits, -jnp.inf)
