"""Each sequence's tokens on the device, for the n-gram proposer inside the step.

The proposer (``ngram_proposer.ngram_propose``) reads every token of a sequence (prompt and
outputs) at every step; sending them with each step would move ``B * max_model_len`` ints per
step. Instead they live on the device as ``TokenHistory`` rows, one per *slot*, kept like
``sample.logits_state.LogitsState``: the host's ``Sequence`` is the truth, a sequence without a
slot (new, forked, evicted by ``sample.logits_state.SlotTable``) gets its row rebuilt from its
host tokens (:func:`host_rows`, :func:`write_rows`), and the verify stage appends what it emits
(:func:`append_tokens`), so the row never leaves the device. A row is rebuilt only from tokens
that are all on the host (not past a placeholder of async scheduling), as LogitsState's rows.

The last row is the neutral row: length 0, never written; padding rows point at it and get no
drafts.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.spec_decode.ngram_proposer import ngram_propose

# Rows rebuilt per write_rows call: one compiled shape; more rows take several calls.
WRITE_ROWS = 8


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenHistory:
    """Device rows, one per slot; row ``S - 1`` is the neutral row."""

    token_ids: jax.Array  # i32[S, L]: a sequence's tokens from column 0; junk past its length
    lengths: jax.Array  # i32[S]: tokens in the row

    @property
    def neutral_slot(self) -> int:
        return self.lengths.shape[0] - 1


def allocate_token_history(num_slots: int, max_model_len: int) -> TokenHistory:
    """Empty history with ``num_slots`` request rows plus the neutral row, ``max_model_len``
    columns each (``(num_slots + 1) * max_model_len * 4`` bytes)."""
    return TokenHistory(
        jnp.zeros((num_slots + 1, max_model_len), jnp.int32), jnp.zeros(num_slots + 1, jnp.int32)
    )


def host_rows(token_lists: list[list[int]], max_model_len: int) -> tuple[np.ndarray, np.ndarray]:
    """``(i32[WRITE_ROWS, L] tokens, i32[WRITE_ROWS] lengths)`` for up to ``WRITE_ROWS``
    sequences' tokens (prompt then outputs), padded with empty rows.

    Raises:
        ValueError: more than ``WRITE_ROWS`` lists, or one longer than ``max_model_len``.
    """
    if len(token_lists) > WRITE_ROWS:
        raise ValueError(f"at most {WRITE_ROWS} rows per write, got {len(token_lists)}")
    rows = np.zeros((WRITE_ROWS, max_model_len), np.int32)
    lengths = np.zeros(WRITE_ROWS, np.int32)
    for i, tokens in enumerate(token_lists):
        if len(tokens) > max_model_len:
            raise ValueError(f"a sequence of {len(tokens)} tokens exceeds {max_model_len=}")
        rows[i, : len(tokens)] = tokens
        lengths[i] = len(tokens)
    return rows, lengths


@functools.partial(jax.jit, donate_argnames=("history",))
def write_rows(
    history: TokenHistory, slots: jax.Array, rows: jax.Array, lengths: jax.Array
) -> TokenHistory:
    """Overwrite rows ``slots`` (i32[WRITE_ROWS]; an index past the last row is dropped) with
    ``rows`` / ``lengths`` from :func:`host_rows`."""
    return TokenHistory(
        history.token_ids.at[slots].set(rows, mode="drop"),
        history.lengths.at[slots].set(lengths, mode="drop"),
    )


def append_tokens(
    history: TokenHistory, slots: jax.Array, token_ids: jax.Array, num_tokens: jax.Array
) -> TokenHistory:
    """Append each row's first ``num_tokens[b]`` of ``token_ids[b]`` (i32[B, P]) to slot
    ``slots[b]`` (i32[B]); the neutral slot and tokens past ``max_model_len`` are dropped.
    Jittable; meant for the verify stage, with ``history`` donated by the step."""
    width = history.token_ids.shape[1]
    neutral = history.neutral_slot
    start = history.lengths[slots]  # [B]
    j = jnp.arange(token_ids.shape[1])[None, :]
    columns = start[:, None] + j
    keep = (j < num_tokens[:, None]) & (columns < width) & (slots != neutral)[:, None]
    rows = jnp.where(keep, jnp.broadcast_to(slots[:, None], columns.shape), neutral + 1)
    token_ids = history.token_ids.at[rows, columns].set(token_ids, mode="drop")
    grown = jnp.minimum(start + jnp.where(slots != neutral, num_tokens, 0), width)
    lengths = history.lengths.at[jnp.where(slots != neutral, slots, neutral + 1)].set(
        grown, mode="drop"
    )
    return TokenHistory(token_ids, lengths)


def propose_from_history(
    history: TokenHistory, slots: jax.Array, **kwargs
) -> tuple[jax.Array, jax.Array]:
    """:func:`ngram_propose` over the rows of ``slots`` (i32[B]; the neutral slot proposes
    nothing); ``kwargs`` are its static arguments."""
    return ngram_propose(history.token_ids[slots], history.lengths[slots], **kwargs)
