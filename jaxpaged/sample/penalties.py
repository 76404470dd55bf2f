"""Logit processing from per-request rows: allowed ids, logit bias, min_tokens, penalties.

The order is vLLM v1's (``vllm/v1/sample/sampler.py``): allowed_token_ids mask, then min_tokens
(EOS and stop_token_ids to -inf) and logit_bias, then the penalties, all before temperature.
Penalties follow vLLM's ``apply_penalties``:

* repetition (HF transformers' ``RepetitionPenaltyLogitsProcessor``, Keskar et al. 2019, CTRL):
  for tokens in the prompt or the output, positive logits are divided by the penalty and
  negative ones multiplied;
* frequency and presence (OpenAI): ``logit -= frequency * count + presence * (count > 0)`` over
  generated tokens only.

Neutral parameters (penalties 0/0/1, zero bias, no suppression) leave logits bit-identical.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxpaged.sample.logits_state import LogitsState
from jaxpaged.sample.metadata import SamplingMetadata


def apply_penalties(
    logits: jax.Array,
    output_counts: jax.Array,
    prompt_mask: jax.Array,
    presence_penalty: jax.Array,
    frequency_penalty: jax.Array,
    repetition_penalty: jax.Array,
) -> jax.Array:
    """Repetition, then frequency and presence penalties.

    Args:
        logits: f32[B, vocab_size].
        output_counts: i32[B, vocab_size], times each token was generated.
        prompt_mask: bool[B, vocab_size], token occurs in the prompt.
        presence_penalty, frequency_penalty, repetition_penalty: f32[B].

    Returns:
        f32[B, vocab_size].
    """
    seen = prompt_mask | (output_counts > 0)
    rep = repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    counts = output_counts.astype(jnp.float32)
    logits = logits - frequency_penalty[:, None] * counts
    return logits - presence_penalty[:, None] * (counts > 0)


def apply_logits_state(
    logits: jax.Array, state: LogitsState, metadata: SamplingMetadata
) -> jax.Array:
    """Apply every row-based processor to ``logits`` (f32[B, vocab_size]) in vLLM's order."""
    slots = metadata.state_slot
    logits = logits + state.logit_bias[slots]
    suppress = (metadata.suppress_stop != 0)[:, None] & state.stop_mask[slots]
    logits = jnp.where(suppress, -jnp.inf, logits)
    return apply_penalties(
        logits,
        state.output_counts[slots],
        state.prompt_mask[slots],
        metadata.presence_penalty,
        metadata.frequency_penalty,
        metadata.repetition_penalty,
    )


def count_sampled(
    state: LogitsState, slots: jax.Array, token_ids: jax.Array, count: jax.Array
) -> LogitsState:
    """Add ``count`` (i32[B], 0 or 1) to ``output_counts[slots, token_ids]``."""
    counts = state.output_counts.at[slots, token_ids].add(count)
    return dataclasses.replace(state, output_counts=counts)
