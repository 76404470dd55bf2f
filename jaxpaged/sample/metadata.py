"""Per-row sampling parameters as the device reads them, and the sampler stages a step needs.

Every field travels inside the step's packed int32 buffer (its sections, padding values and real
dtypes are the worker's step buffer's to define), so changing any request's parameters changes
only data, never a shape: one compiled step per bucket serves every mix.
"""

from __future__ import annotations

import dataclasses

import jax


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
    # i32[B]; what logprobs report (``sampling_params.LOGPROBS_MODE_CODES``): bit 0 processed (the
    # distribution sampled from), bit 1 logits instead of log-probabilities.
    logprobs_mode: jax.Array
    # i32[T]: for each token, the prompt token that follows it (whose prompt logprob its logits
    # give), or -1 when that is not wanted (not a prompt-logprobs request, or past the prompt).
    prompt_target: jax.Array

    @classmethod
    def from_arrays(cls, arrays: dict[str, jax.Array]) -> SamplingMetadata:
        """The fields of ``arrays`` (a step's unpacked inputs, already in the dtypes above;
        other keys are ignored)."""
        return cls(**{field.name: arrays[field.name] for field in dataclasses.fields(cls)})


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
    structured: bool = False  # some sampled row is constrained: the step takes a token bitmask
    token_logprobs: bool = False  # some sampled row wants logprob_token_ids (their ranks too)

    @classmethod
    def for_step(cls, scheduled, slots: list) -> SamplerVariant:
        """The variant for ``scheduled`` (``ScheduledSequence``s); ``slots[i]`` is row i's
        LogitsState slot or None."""
        filters = logprobs = prompt_logprobs = token_logprobs = False
        for s in scheduled:
            params = s.seq.sampling_params
            if params.prompt_logprobs is not None:
                prompt_logprobs = True
            if s.do_sample:
                filters = filters or params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0
                logprobs = logprobs or params.logprobs is not None
                token_logprobs = token_logprobs or params.logprob_token_ids is not None
        return cls(
            uses_state=any(slot is not None for slot in slots),
            filters=filters,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            token_logprobs=token_logprobs,
        )
