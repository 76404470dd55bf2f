"""Verify drafted tokens against the target's logits: accept a prefix, then one more token.

Speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding", Alg. 1; Chen et al. 2023, arXiv:2302.01318, Alg. 2): with the draft distribution
``q`` and the target distribution ``p`` at each drafted position, draft ``x_j`` is accepted with
probability ``min(1, p_j(x_j) / q_j(x_j))``; at the first rejection one token is drawn from
``normalize(max(0, p_j - q_j))`` and the row stops; when every draft is accepted one bonus token
is drawn from ``p`` at the next position. Each emitted token is then distributed exactly as the
target would sample it. Greedy rows (temperature 0) accept while the draft equals the target's
argmax and emit the argmax at the first mismatch (or as the bonus).

vLLM 0.34's choices (``vllm/v1/worker/gpu/spec_decode/rejection_sampler*.py``), kept here:

- A draft without probabilities (n-gram, greedy EAGLE / draft-model drafts) is one-hot:
  ``q(x) = 1``, so ``x`` is accepted iff ``p(x) > u`` and the residual is ``p`` with ``x``
  removed. This is exact for any deterministic draft.
- A draft id of -1 is a placeholder: rejected, and the token at its position is drawn from ``p``.
- ``p`` is the distribution the ordinary sampler draws from: ``jaxpaged.sample``'s processing
  (allowed ids, logit bias, min_tokens, penalties; then temperature, min-p, top-k, top-p) with
  each position's history, i.e. the request's outputs plus the drafts before that position.

Randomness: position ``j`` of a row is output token number ``step + j`` of its request and
draws from ``sample.sampler.row_key(seed, step + j)`` (Gumbel noise, as the ordinary sampler,
for the emitted token; a uniform from a fold of the same key for the accept test), so a seeded
request's tokens do not depend on the rest of the batch. Shape letters: ``B`` rows, ``K``
drafts per row, ``V`` the vocabulary.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxpaged.sample.logits_state import LogitsState
from jaxpaged.sample.logprobs import TopLogprobs, sampled_logprobs, top_logprobs
from jaxpaged.sample.metadata import SamplerVariant, SamplingMetadata
from jaxpaged.sample.penalties import apply_penalties, count_sampled
from jaxpaged.sample.sampler import apply_min_p_top_k_top_p, logprobs_by_mode, row_key

# fold_in constant that separates the accept test's uniform from the token's Gumbel noise.
_ACCEPT_STREAM = 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RejectionOutput:
    """What one verify step emits per row."""

    # i32[B, K + 1]: the accepted drafts, then the recovered or bonus token; -1 after that.
    token_ids: jax.Array
    # i32[B]: tokens emitted, in [1, num_draft + 1] (accepted drafts = num_tokens - 1).
    num_tokens: jax.Array
    # f32[B, K + 1]: each emitted token's logprob for cumulative_logprob
    # (``sample.logprobs.sampled_logprobs``: the reported one when asked, else raw).
    token_logprobs: jax.Array
    # Over the B * (K + 1) positions, row-major: each position's emitted token under its
    # row's logprobs_mode (zeros unless ``variant.logprobs``; junk past num_tokens).
    logprobs: TopLogprobs


def rejection_sample(
    logits: jax.Array,
    draft_ids: jax.Array,
    num_draft: jax.Array,
    metadata: SamplingMetadata,
    state: LogitsState,
    draft_probs: jax.Array | None = None,
    *,
    variant: SamplerVariant,
    num_logprobs: int,
) -> tuple[RejectionOutput, LogitsState]:
    """Accept a prefix of each row's drafts and emit one more token (module docstring).

    Args:
        logits: f32[B, K + 1, V] raw target logits (any float dtype; a structured-output bitmask
            already applied); position ``j < K`` is the distribution of the token after
            ``j`` drafts, so it verifies ``draft_ids[:, j]``; position ``num_draft`` gives the
            bonus token.
        draft_ids: i32[B, K] proposed tokens; -1 is a placeholder (always rejected); entries at
            or past ``num_draft`` are ignored.
        num_draft: i32[B] drafts of each row, in [0, K]; 0 makes the row an ordinary sample.
        metadata: the rows' ``[B]`` sampling parameters, as the ordinary sampler reads them,
            except ``suppress_stop``, read as a count: the stop tokens are suppressed at
            positions ``j < suppress_stop`` (min_tokens - outputs so far; 1 means the first
            position only, which is the ordinary sampler's meaning); ``step`` is the row's
            number of outputs before this step.
        state: the requests' LogitsState rows; every emitted token of a row with
            ``count_sampled`` is added to its counts.
        draft_probs: f32[B, K, V] the draft's own distribution at each position (already
            processed by its sampling parameters), or None for drafts without probabilities
            (one-hot ``q``).
        variant: the optional sampler stages this step runs (static), as for ``sample``.
        num_logprobs: top logprobs per position (static; the engine's ``max_logprobs``).

    Returns:
        ``(RejectionOutput, state)``.
    """
    b, positions, vocab = logits.shape
    k = positions - 1
    flat = _repeat_rows(metadata, positions)  # [B * (K + 1)] rows, position-major within a row
    raw = logits.astype(jnp.float32).reshape(b * positions, vocab)
    processed = raw
    if variant.uses_state:
        processed = _processed_logits(raw, draft_ids, num_draft, flat, state, positions)
    greedy_ids = jnp.argmax(processed, axis=-1).astype(jnp.int32).reshape(b, positions)

    is_greedy = metadata.temperature == 0.0
    temperature = jnp.where(flat.temperature == 0.0, 1.0, flat.temperature)
    scaled = processed / temperature[:, None]
    if variant.filters:
        scaled = apply_min_p_top_k_top_p(scaled, flat.min_p, flat.top_k, flat.top_p)
    probs = jax.nn.softmax(scaled, axis=-1).reshape(b, positions, vocab)
    keys = jax.vmap(row_key)(flat.seed_lo, flat.seed_hi, flat.step).reshape(b, positions)

    # Accept test at the K drafted positions.
    j = jnp.arange(k)[None, :]
    real = (j < num_draft[:, None]) & (draft_ids >= 0)
    safe_ids = jnp.maximum(draft_ids, 0)
    p_draft = jnp.take_along_axis(probs[:, :k], safe_ids[..., None], axis=-1)[..., 0]
    q_draft = 1.0
    if draft_probs is not None:
        q_draft = jnp.take_along_axis(draft_probs, safe_ids[..., None], axis=-1)[..., 0]
    uniform = jax.vmap(jax.vmap(_accept_uniform))(keys[:, :k])
    accepted = jnp.where(
        is_greedy[:, None], safe_ids == greedy_ids[:, :k], p_draft > uniform * q_draft
    )
    accepted &= real
    num_accepted = jnp.sum(jnp.cumprod(accepted, axis=1), axis=1).astype(jnp.int32)

    # The token at the first unaccepted position: the residual on a rejection of a real draft,
    # else (bonus, placeholder) the target itself.
    rows = jnp.arange(b)
    p_last = probs[rows, num_accepted]  # [B, V]
    if k:
        at = jnp.minimum(num_accepted, k - 1)  # the rejected draft, when there is one
        rejected = (num_accepted < num_draft) & (draft_ids[rows, at] >= 0)
        if draft_probs is None:
            q_last = jax.nn.one_hot(safe_ids[rows, at], vocab, dtype=jnp.float32)
        else:
            q_last = draft_probs[rows, at].astype(jnp.float32)
    else:
        rejected, q_last = jnp.zeros(b, jnp.bool_), jnp.zeros_like(p_last)
    residual = jnp.where(rejected[:, None], jnp.maximum(p_last - q_last, 0.0), p_last)
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_last)
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (vocab,), jnp.float32))(
        keys[rows, num_accepted]
    )
    sampled = jnp.argmax(jnp.log(residual) + gumbel, axis=-1).astype(jnp.int32)
    last = jnp.where(is_greedy, greedy_ids[rows, num_accepted], sampled)

    pos = jnp.arange(positions)[None, :]
    drafts = jnp.pad(draft_ids, ((0, 0), (0, 1)), constant_values=-1)
    token_ids = jnp.where(pos < num_accepted[:, None], drafts, -1)
    token_ids = jnp.where(pos == num_accepted[:, None], last[:, None], token_ids)
    num_tokens = num_accepted + 1

    flat_ids = jnp.maximum(token_ids, 0).reshape(-1)
    if variant.logprobs:
        chosen = logprobs_by_mode(raw, scaled, flat.logprobs_mode)
        logprobs = top_logprobs(chosen, flat_ids, num_logprobs)
    else:
        logprobs = TopLogprobs.zeros(b * positions, num_logprobs)
    token_logprobs = sampled_logprobs(raw, flat_ids, flat, logprobs).reshape(b, positions)
    if variant.uses_state:
        emitted = (pos < num_tokens[:, None]).reshape(-1)
        uses_state = flat.state_slot != state.neutral_slot
        count = jnp.where(uses_state & emitted, flat.count_sampled, 0)
        state = count_sampled(state, flat.state_slot, flat_ids, count)
    return RejectionOutput(token_ids, num_tokens, token_logprobs, logprobs), state


def _accept_uniform(key: jax.Array) -> jax.Array:
    """U(0, 1) with 0 excluded (u = 0 would accept a token the target gives probability 0)."""
    key = jax.random.fold_in(key, _ACCEPT_STREAM)
    return jax.random.uniform(key, (), jnp.float32, minval=jnp.finfo(jnp.float32).tiny)


def _repeat_rows(metadata: SamplingMetadata, positions: int) -> SamplingMetadata:
    """The ``[B]`` rows as ``[B * positions]``: position ``j`` of a row is its output number
    ``step + j``, with the stop tokens suppressed while ``j < suppress_stop``."""
    j = jnp.tile(jnp.arange(positions, dtype=jnp.int32), metadata.temperature.shape[0])
    values = {
        f.name: jnp.repeat(getattr(metadata, f.name), positions)
        for f in dataclasses.fields(SamplingMetadata)
        if f.name != "prompt_target"
    }
    values["step"] = values["step"] + j
    values["suppress_stop"] = (j < values["suppress_stop"]).astype(jnp.int32)
    return SamplingMetadata(**values, prompt_target=metadata.prompt_target)


def _processed_logits(
    raw: jax.Array,
    draft_ids: jax.Array,
    num_draft: jax.Array,
    flat: SamplingMetadata,
    state: LogitsState,
    positions: int,
) -> jax.Array:
    """``sample.penalties.apply_logits_state`` at every position, with the drafts before a
    position counted as generated there.

    Each position is first processed with the request's own counts (the same bias, stop
    suppression and penalties as ``apply_logits_state``); then only the (position, earlier
    draft token) entries, whose counts the drafts raise, are recomputed with
    ``apply_penalties`` (``B * (K + 1) * K`` values instead of a count row per position).
    """
    slots = flat.state_slot
    stop = (flat.suppress_stop != 0)[:, None] & state.stop_mask[slots]
    biased = jnp.where(stop, -jnp.inf, raw + state.logit_bias[slots])  # [N, V]
    counts, prompt_mask = state.output_counts[slots], state.prompt_mask[slots]
    processed = apply_penalties(
        biased, counts, prompt_mask, flat.presence_penalty,
        flat.frequency_penalty, flat.repetition_penalty,
    )  # fmt: skip
    k = positions - 1
    if k == 0:
        return processed
    n, b = raw.shape[0], draft_ids.shape[0]
    # For position j and each draft i < j: its token, and how often it occurs in drafts < j.
    valid = (jnp.arange(k)[None, :] < num_draft[:, None]) & (draft_ids >= 0)  # [B, K]
    tokens = jnp.maximum(draft_ids, 0)
    before = jnp.arange(positions)[:, None] > jnp.arange(k)[None, :]  # [P, K]: i < j
    live = before[None] & valid[:, None, :]  # [B, P, K]
    same = tokens[:, :, None] == tokens[:, None, :]  # [B, K, K]
    extra = jnp.einsum("bpi,bki->bpk", live.astype(jnp.int32), same.astype(jnp.int32))
    rows = jnp.arange(n).reshape(b, positions)[:, :, None]  # [B, P, 1]
    ids = jnp.broadcast_to(tokens[:, None, :], live.shape)
    fixed = apply_penalties(
        biased[rows, ids].reshape(-1, 1),
        (counts[rows, ids] + extra).reshape(-1, 1),
        prompt_mask[rows, ids].reshape(-1, 1),
        *(jnp.repeat(x, k) for x in (
            flat.presence_penalty, flat.frequency_penalty, flat.repetition_penalty,
        )),
    )  # fmt: skip
    row_idx = jnp.where(live, jnp.broadcast_to(rows, live.shape), n)  # n: dropped
    return processed.at[row_idx.reshape(-1), ids.reshape(-1)].set(fixed[:, 0], mode="drop")
