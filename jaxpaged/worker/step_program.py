"""The device side of one step: its stages, and the one function every executable compiles.

One step runs these device stages in order (``STAGES``):

    forward  packed inputs -> input ids (placeholders read from the previous step's tokens)
             -> the model over the step's T tokens, K/V written into the donated cache
             -> logits of the sampling rows f32[B, vocab_size] (hidden states kept for the
             prompt logprobs)
    sample   logits -> grammar bitmask -> LogitsState penalties, filters, sampling (LogitsState
             donated) -> token ids i32[B], their logprobs, top logprobs, prompt logprobs, beam
             candidates; the token ids also become the next step's ``prev_tokens``

An executable runs a *segment*: a contiguous run of stages (``BucketKey.segment``). A step is
usually one segment, the whole ``(forward, sample)``; when the host has work between the stages
(under async scheduling, a grammar's bitmask can be filled only once the previous step's
tokens are on the host) it is two, ``(forward,)`` then ``(sample,)``. Which segments a step runs
is data, chosen by the engine (``engine/step_pipeline.py``). Every segment has one signature::

    step_segment(weights, kv_caches, logits_state, prev_tokens, packed, lora_weights, handed)
        -> (out, kv_caches, logits_state)

``kv_caches`` and ``logits_state`` are donated; a segment without the stage that writes one
returns it untouched (XLA aliases it: no copy). ``handed`` is what the step's previous segment
returned (``{"logits"}``) plus inputs the host made after it launched (``{"token_bitmask"}``),
None for a step's first segment. ``out`` is ``{"logits"}`` after a segment that ends before
``sample``, else the sampled outputs (``worker/step_output.py`` reads them back).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxpaged.sample.logprobs import sampled_logprobs, step_prompt_logprobs
from jaxpaged.sample.metadata import SamplerVariant, SamplingMetadata
from jaxpaged.sample.sampler import sample
from jaxpaged.structured_output.bitmask import apply_token_bitmask
from jaxpaged.worker.beam_candidates import top_logprobs
from jaxpaged.worker.device_weights import DeviceWeights
from jaxpaged.worker.step_buffer import PackedLayout
from models.attention_metadata import AttentionMetadata
from models.lora import LoRABatch

FORWARD = "forward"
SAMPLE = "sample"
# The device stages of a step, in order. A segment is a contiguous run of them.
STAGES = (FORWARD, SAMPLE)
WHOLE = STAGES
_DEFAULT_VARIANT = SamplerVariant()


@dataclasses.dataclass(frozen=True)
class BucketKey:
    """One executable: a segment of the step at a static shape (``T`` tokens, ``B`` sequences,
    decode-only or mixed) with its static options."""

    num_tokens: int
    num_seqs: int
    decode_only: bool
    # Beam search: top-k (token, logprob) pairs returned per row, a power of two; 0 (every
    # bucket compiled at start-up) returns none, so beam steps compile only when beams are used.
    num_beam_candidates: int = 0
    # Optional sampler stages; start-up compiles the default (none), others compile on first use.
    variant: SamplerVariant = _DEFAULT_VARIANT
    # The stages this executable runs (a contiguous run of ``STAGES``).
    segment: tuple[str, ...] = WHOLE

    def for_segment(self, segment: tuple[str, ...]) -> BucketKey:
        """This step's key for one of its segments. A segment without ``sample`` has no
        sampler options: one forward executable per bucket serves every variant.

        Raises:
            ValueError: ``segment`` is not a contiguous run of ``STAGES``, or it samples with
                prompt logprobs or beams without the forward (they read the hidden states and
                come whole).
        """
        if segment == self.segment:  # the common case: a whole step's one segment
            return self
        start = STAGES.index(segment[0]) if segment and segment[0] in STAGES else None
        if start is None or segment != STAGES[start : start + len(segment)]:
            raise ValueError(f"a segment is a contiguous run of {STAGES}, got {segment}")
        if SAMPLE not in segment:
            return dataclasses.replace(
                self, segment=segment, variant=_DEFAULT_VARIANT, num_beam_candidates=0
            )
        if FORWARD not in segment and (self.variant.prompt_logprobs or self.num_beam_candidates):
            raise ValueError("prompt logprobs and beam candidates need the forward in the segment")
        return dataclasses.replace(self, segment=segment)


class StepProgram:
    """The device stages as pure functions of their arrays (the runner jits ``step_segment``).

    Args:
        weights: the model's flat weight list (``DeviceWeights``); ``step_segment`` takes the
            arrays.
        max_logprobs: top logprobs computed per sampled or prompt token (static).
        max_loras: LoRA slots (0: no LoRA).
    """

    def __init__(self, weights: DeviceWeights, *, max_logprobs: int, max_loras: int):
        self.weights = weights
        self.max_logprobs = max_logprobs
        self.max_loras = max_loras

    def step_segment(
        self,
        weights,
        kv_caches,
        logits_state,
        prev_tokens,
        packed,
        lora_weights,
        handed,
        *,
        key: BucketKey,
        layout: PackedLayout,
    ):
        """One segment of a step (module docstring): ``(out, kv_caches, logits_state)``."""
        arrays = layout.unpack(packed)
        hidden = model = None
        if FORWARD in key.segment:
            hidden, logits, kv_caches, model = self.forward(
                weights, kv_caches, prev_tokens, arrays, lora_weights, layout, key.decode_only
            )
        else:
            logits = handed["logits"]
        if SAMPLE not in key.segment:
            return {"logits": logits.astype(jnp.float32)}, kv_caches, logits_state
        bitmask = None
        if key.variant.structured:
            if layout.bitmask_words:  # filled into the packed inputs before the launch
                bitmask = arrays["token_bitmask"].reshape(layout.num_seqs, layout.bitmask_words)
            else:  # filled after an earlier segment launched
                bitmask = handed["token_bitmask"]
        out, logits, logits_state = self.sample(
            logits, logits_state, prev_tokens, arrays, bitmask, key.variant
        )
        sampling = out.pop("sampling")
        if FORWARD in key.segment:
            out["prompt_logprobs"] = step_prompt_logprobs(
                hidden,
                logits,
                model.compute_logits,
                sampling.prompt_target,
                self.max_logprobs,
                decode_only=key.decode_only,
                enabled=key.variant.prompt_logprobs,
            )
        if key.num_beam_candidates:
            out["beams"] = top_logprobs(logits, sampling.temperature, key.num_beam_candidates)
        return out, kv_caches, logits_state

    def forward(self, weights, kv_caches, prev_tokens, arrays, lora_weights, layout, decode_only):
        """The model over the step's tokens: ``(hidden [T, H], logits [B, vocab_size] of the
        sampling rows, kv_caches, model)``."""
        prev_index = arrays["prev_index"]
        input_ids = jnp.where(
            prev_index >= 0, prev_tokens[jnp.maximum(prev_index, 0)], arrays["input_ids"]
        )
        b = layout.num_seqs
        metadata = AttentionMetadata(
            slot_mapping=arrays["slot_mapping"],
            block_tables=arrays["block_tables"].reshape(b, layout.max_blocks),
            seq_lens=arrays["seq_lens"],
            cu_q_lens=arrays["cu_q_lens"],
            decode_only=decode_only,
        )
        model = self.weights.model(weights)
        lora = None
        if lora_weights is not None:
            lora = LoRABatch(arrays["lora_slots"], lora_weights, self.max_loras)
        # Families without LoRA support (GPT-2, BLOOM) take no adapter argument.
        extra = () if lora is None else (lora,)
        hidden, kv_caches = model(input_ids, arrays["positions"], kv_caches, metadata, *extra)
        # Only the rows that sample reach the LM head.
        logits = model.compute_logits(hidden[arrays["logits_indices"]])
        return hidden, logits, kv_caches, model

    def sample(self, logits, logits_state, prev_tokens, arrays, bitmask, variant):
        """Sampling of the rows' logits: ``(out, logits after the bitmask, logits_state)``."""
        sampling = SamplingMetadata.from_arrays(arrays)
        if bitmask is not None:
            # Grammar-disallowed tokens go to -inf before anything reads the logits, so the
            # sampler, the logprobs (raw ones too, as vLLM's) and beam candidates all see it.
            logits = apply_token_bitmask(logits.astype(jnp.float32), bitmask)
        token_ids, logprobs, logits_state = sample(
            logits, sampling, logits_state, num_logprobs=self.max_logprobs, variant=variant
        )
        out = {
            "token_ids": token_ids,
            "next_prev_tokens": jnp.zeros_like(prev_tokens).at[: token_ids.shape[0]].set(token_ids),
            "sampled_logprobs": sampled_logprobs(logits, token_ids, sampling, logprobs),
            "logprobs": logprobs,
            "sampling": sampling,
        }
        return out, logits, logits_state
