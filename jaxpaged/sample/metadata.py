"""Per-row sampling parameters: built on the host in numpy, read on the device as a pytree.

Every field travels inside the model runner's single packed int32 buffer (floats and unsigned
seeds as bit patterns), so changing any request's parameters changes only data, never a shape:
one compiled step per bucket serves every mix of parameters.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

# Per-row fields in packed order with their dtype; padding rows take the neutral value (greedy,
# no filter, no penalty, no logprobs), except ``state_slot`` which the builder sets.
_ROW_FIELDS: tuple[tuple[str, type, float], ...] = (
    ("temperature", np.float32, 0.0),
    ("top_k", np.int32, 0),
    ("top_p", np.float32, 1.0),
    ("min_p", np.float32, 0.0),
    ("seed_lo", np.uint32, 0),
    ("seed_hi", np.uint32, 0),
    ("step", np.int32, 0),
    ("presence_penalty", np.float32, 0.0),
    ("frequency_penalty", np.float32, 0.0),
    ("repetition_penalty", np.float32, 1.0),
    ("state_slot", np.int32, 0),
    ("suppress_stop", np.int32, 0),
    ("count_sampled", np.int32, 0),
    ("num_logprobs", np.int32, -1),
    ("processed_logprobs", np.int32, 0),
)
_JNP = {np.float32: jnp.float32, np.int32: jnp.int32, np.uint32: jnp.uint32}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    """Per-row (``[B]``) and per-token (``[T]``) sampling inputs of one step."""

    temperature: jax.Array  # f32[B]; 0 means greedy, otherwise already floored at 0.01.
    top_k: jax.Array  # i32[B]; 0 means off.
    top_p: jax.Array  # f32[B]; 1 means off.
    min_p: jax.Array  # f32[B]; 0 means off.
    seed_lo: jax.Array  # u32[B]; low 32 bits of the request's seed.
    seed_hi: jax.Array  # u32[B]; high 32 bits of the request's seed.
    step: jax.Array  # i32[B]; index of the token being sampled (number of outputs so far).
    presence_penalty: jax.Array  # f32[B]; 0 means off.
    frequency_penalty: jax.Array  # f32[B]; 0 means off.
    repetition_penalty: jax.Array  # f32[B]; 1 means off.
    # i32[B]: the request's row in LogitsState; the state's last (all-neutral) row for requests
    # that need none and for padding.
    state_slot: jax.Array
    suppress_stop: jax.Array  # i32[B]; 1 while fewer than min_tokens outputs exist.
    count_sampled: jax.Array  # i32[B]; 1 when the sampled token is real and enters the counts.
    num_logprobs: jax.Array  # i32[B]; top-k logprobs wanted, -1 for none.
    processed_logprobs: jax.Array  # i32[B]; 1: logprobs of the sampled-from distribution.
    # i32[T]: for each token, the prompt token that follows it (whose prompt logprob its logits
    # give), or -1 when that is not wanted (not a prompt-logprobs request, or past the prompt).
    prompt_target: jax.Array

    @classmethod
    def from_packed(cls, arrays: dict[str, jax.Array]) -> SamplingMetadata:
        """Reinterpret the int32 sections named by ``packed_sections`` with their real dtypes."""
        values = {}
        for name, dtype, _ in _ROW_FIELDS:
            x = arrays[name]
            values[name] = x if dtype is np.int32 else jax.lax.bitcast_convert_type(x, _JNP[dtype])
        return cls(**values, prompt_target=arrays["prompt_target"])


@dataclasses.dataclass(frozen=True)
class SamplerVariant:
    """The optional sampler stages one compiled step contains (static).

    The host, which knows every row's parameters, picks the variant per step. Deciding on the
    device instead (``lax.cond``) makes XLA:GPU copy each predicate to the host and wait for it
    mid-step, which serialises the host with the device and defeats async scheduling.
    """

    uses_state: bool = False  # some row has penalties, bias, allowed ids or min_tokens
    filters: bool = False  # some sampled row has top-k, top-p or min-p
    logprobs: bool = False  # some sampled row wants logprobs
    prompt_logprobs: bool = False  # some token wants its prompt logprob

    @classmethod
    def for_step(cls, scheduled, slots: list) -> SamplerVariant:
        """The variant for ``scheduled`` (``ScheduledSequence``s); ``slots[i]`` is row i's
        LogitsState slot or None."""
        filters = logprobs = prompt_logprobs = False
        for s in scheduled:
            params = s.seq.sampling_params
            if params.prompt_logprobs is not None:
                prompt_logprobs = True
            if s.do_sample:
                filters = filters or params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0
                logprobs = logprobs or params.logprobs is not None
        return cls(
            uses_state=any(slot is not None for slot in slots),
            filters=filters,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )


def packed_sections(num_tokens: int, num_seqs: int) -> list[tuple[str, int]]:
    """(name, int32 length) of every sampling section of the packed buffer, in order."""
    return [(name, num_seqs) for name, _, _ in _ROW_FIELDS] + [("prompt_target", num_tokens)]


class SamplingArrays:
    """Host numpy arrays for one step, padded to ``num_seqs`` rows and ``num_tokens`` tokens.

    Args:
        neutral_slot: the LogitsState row that holds no request's data (its last row).
    """

    def __init__(self, num_tokens: int, num_seqs: int, neutral_slot: int):
        self.rows = {name: np.full(num_seqs, value, dtype) for name, dtype, value in _ROW_FIELDS}
        self.rows["state_slot"][:] = neutral_slot
        self.prompt_target = np.full(num_tokens, -1, np.int32)

    def set_row(self, i: int, seq, *, seed: int, do_sample: bool, state_slot: int | None) -> None:
        """Fill row ``i`` from ``seq`` (a ``Sequence``); ``state_slot`` None: no LogitsState."""
        params, rows = seq.sampling_params, self.rows
        rows["temperature"][i] = params.effective_temperature
        rows["top_k"][i] = params.top_k
        rows["top_p"][i] = params.top_p
        rows["min_p"][i] = params.min_p
        rows["seed_lo"][i] = seed & 0xFFFFFFFF
        rows["seed_hi"][i] = seed >> 32
        rows["step"][i] = seq.num_output_tokens
        rows["presence_penalty"][i] = params.presence_penalty
        rows["frequency_penalty"][i] = params.frequency_penalty
        rows["repetition_penalty"][i] = params.repetition_penalty
        if state_slot is not None:
            rows["state_slot"][i] = state_slot
            rows["suppress_stop"][i] = seq.num_output_tokens < params.min_tokens
            rows["count_sampled"][i] = do_sample
        if do_sample and params.logprobs is not None:
            rows["num_logprobs"][i] = params.logprobs
            rows["processed_logprobs"][i] = params.logprobs_mode == "processed_logprobs"

    def set_prompt_targets(self, t: int, seq, num_computed_tokens: int, num_new_tokens: int):
        """Tokens ``t .. t + num_new_tokens - 1`` of the step are ``seq``'s positions from
        ``num_computed_tokens``; mark those whose next position is still in the prompt."""
        if seq.sampling_params.prompt_logprobs is None:
            return
        first_next = num_computed_tokens + 1
        last_next = min(num_computed_tokens + num_new_tokens, seq.num_prompt_tokens - 1)
        if last_next >= first_next:
            n = last_next - first_next + 1
            self.prompt_target[t : t + n] = seq.prompt_token_ids[first_next : last_next + 1]

    def packed(self) -> dict[str, np.ndarray]:
        """Every section as int32 (bit patterns for float and unsigned fields)."""
        out = {name: array.view(np.int32) for name, array in self.rows.items()}
        out["prompt_target"] = self.prompt_target
        return out
