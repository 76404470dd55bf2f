"""Per-request vocabulary rows kept on the device: penalty counts, prompt set, stop set, bias,
and the ids whose logprobs a request asked for.

Penalties need, per request, how often each vocabulary token was generated and which tokens the
prompt holds; logit_bias / allowed_token_ids and min_tokens need a bias row and a stop-token row;
``logprob_token_ids`` need their ids (``MAX_LOGPROB_TOKEN_IDS`` per row, -1 past the last).
These live in ``LogitsState``, ``[S, vocab_size]`` arrays with one row (a *slot*) per request
that needs them, so a step touches them only by gathering its rows; vLLM's GPU model runner v2
keeps the same per-request buffers. The sampler adds each sampled token to its row inside the
jitted step, so the counts never leave the device.

Slots are a cache, not the truth: the host holds every sequence's tokens, and a request that has
no slot (new, forked from another, or evicted) gets one whose row is rebuilt from the host by
``write_rows``. A slot therefore survives preemption, prefix-cache hits and swaps without any of
those paths knowing about it. The last row (``neutral_slot``) is never written: all-zero counts,
empty sets and zero bias, which leave logits unchanged; rows without state point at it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.sampling_params import MAX_LOGPROB_TOKEN_IDS

# Rows rebuilt per write_rows call: one compiled shape; more rows take several calls.
WRITE_ROWS = 8


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LogitsState:
    """Device rows, one per slot; row ``S - 1`` is the neutral row."""

    output_counts: jax.Array  # i32[S, vocab_size]: times each token was generated.
    prompt_mask: jax.Array  # bool[S, vocab_size]: token occurs in the prompt.
    stop_mask: jax.Array  # bool[S, vocab_size]: EOS (unless ignore_eos) and stop_token_ids.
    # f32[S, vocab_size]: logit_bias, -inf outside allowed_token_ids and on bad_words' tokens.
    logit_bias: jax.Array
    # i32[S, MAX_LOGPROB_TOKEN_IDS]: logprob_token_ids, in the request's order; -1 past them.
    logprob_token_ids: jax.Array

    @property
    def neutral_slot(self) -> int:
        return self.output_counts.shape[0] - 1


def allocate_logits_state(num_slots: int, vocab_size: int) -> LogitsState:
    """Zeroed state with ``num_slots`` request rows plus the neutral row."""
    shape = (num_slots + 1, vocab_size)
    return LogitsState(
        output_counts=jnp.zeros(shape, jnp.int32),
        prompt_mask=jnp.zeros(shape, jnp.bool_),
        stop_mask=jnp.zeros(shape, jnp.bool_),
        logit_bias=jnp.zeros(shape, jnp.float32),
        logprob_token_ids=jnp.full((num_slots + 1, MAX_LOGPROB_TOKEN_IDS), -1, jnp.int32),
    )


@functools.partial(jax.jit, donate_argnames=("state",))
def write_rows(state: LogitsState, slots: jax.Array, rows: LogitsState) -> LogitsState:
    """Overwrite rows ``slots`` (i32[WRITE_ROWS]) with ``rows`` (each ``[WRITE_ROWS, ...]``);
    a slot index past the last row is dropped (padding)."""
    return jax.tree.map(lambda s, r: s.at[slots].set(r, mode="drop"), state, rows)


def host_rows(seqs: list, vocab_size: int) -> LogitsState:
    """Numpy rows for ``seqs`` (``Sequence`` objects), padded to ``WRITE_ROWS``, built from
    the host's token lists and each request's parameters."""
    n = WRITE_ROWS
    counts = np.zeros((n, vocab_size), np.int32)
    prompt = np.zeros((n, vocab_size), np.bool_)
    stop = np.zeros((n, vocab_size), np.bool_)
    bias = np.zeros((n, vocab_size), np.float32)
    logprob_ids = np.full((n, MAX_LOGPROB_TOKEN_IDS), -1, np.int32)
    for i, seq in enumerate(seqs):
        params = seq.sampling_params
        if seq.output_token_ids:
            counts[i] = np.bincount(seq.output_token_ids, minlength=vocab_size)
        prompt[i, seq.prompt_token_ids] = True
        stop[i, list(params.stop_token_ids)] = True
        if not params.ignore_eos and seq.eos_token_id is not None:
            stop[i, seq.eos_token_id] = True
        if params.allowed_token_ids is not None:
            bias[i] = -np.inf
            bias[i, params.allowed_token_ids] = 0.0
        for token_id, value in (params.logit_bias or {}).items():
            bias[i, token_id] += value
        if params.bad_words_token_ids:
            bias[i, params.bad_words_token_ids] = -np.inf
        if params.logprob_token_ids:
            logprob_ids[i, : len(params.logprob_token_ids)] = params.logprob_token_ids
    return LogitsState(counts, prompt, stop, bias, logprob_ids)


class SlotTable:
    """Host map from sequences to LogitsState slots, with lazy eviction.

    A slot stays with its sequence until the slot is needed and the sequence has finished or is
    not in the step being prepared (least recently used first); an evicted sequence that comes
    back is simply rebuilt. ``num_slots`` must be at least the most sequences in one step.
    """

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._owner: dict[str, tuple[int, object]] = {}  # seq_id -> (slot, the Sequence)
        self._last_used: dict[str, int] = {}
        self._clock = itertools.count()

    def __len__(self) -> int:
        return len(self._owner)

    def assign(self, seqs: list) -> tuple[list[int], list[tuple[int, object]]]:
        """Slots for ``seqs`` (distinct sequences of one step) and the ``(slot, seq)`` pairs whose
        rows must be rebuilt before the step runs.

        Raises:
            RuntimeError: if ``seqs`` holds more sequences than there are slots.
        """
        if len(seqs) > self.num_slots:
            raise RuntimeError(f"{len(seqs)} sequences need a slot but {self.num_slots=}")
        now = next(self._clock)
        in_step = {seq.seq_id for seq in seqs}
        slots, rebuild = [], []
        for seq in seqs:
            owned = self._owner.get(seq.seq_id)
            if owned is not None and owned[1] is seq:
                slot = owned[0]
            else:
                if owned is not None:  # the id was reused by a new request
                    self._release(seq.seq_id)
                slot = self._take_slot(in_step)
                self._owner[seq.seq_id] = (slot, seq)
                rebuild.append((slot, seq))
            self._last_used[seq.seq_id] = now
            slots.append(slot)
        return slots, rebuild

    def _take_slot(self, in_step: set[str]) -> int:
        if not self._free:
            finished = [sid for sid, (_, seq) in self._owner.items() if seq.is_finished]
            for seq_id in finished:
                self._release(seq_id)
        if not self._free:
            idle = [sid for sid in self._owner if sid not in in_step]
            self._release(min(idle, key=self._last_used.__getitem__))
        return self._free.pop()

    def _release(self, seq_id: str) -> None:
        slot, _ = self._owner.pop(seq_id)
        del self._last_used[seq_id]
        self._free.append(slot)
