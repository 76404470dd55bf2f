"""Beam-search candidates: the top-k next tokens of each sampled row, by log-probability.

Kept apart from `jaxpaged.sample` (general sampling and logprobs): beam search only needs the
`2 * beam_width` best `(token, logprob)` pairs per beam, computed inside the jitted step from the
same logits so that nothing of size `[B, vocab_size]` leaves the device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def top_logprobs(logits: jax.Array, temperature: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The `k` most likely tokens of each row and their log-probabilities, best first.

    Args:
        logits: f32[B, vocab_size] raw model logits.
        temperature: f32[B]; logits are divided by it first (0, greedy, means 1: vLLM v0's beam
            search scores raw log-probabilities when the temperature is 0).
        k: static count, at most vocab_size.

    Returns:
        `(token_ids i32[B, k], logprobs f32[B, k])` of `log_softmax(logits / temperature)`.
    """
    temperature = jnp.where(temperature == 0.0, 1.0, temperature)
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature[:, None], axis=-1)
    values, token_ids = jax.lax.top_k(logprobs, k)
    return token_ids.astype(jnp.int32), values
