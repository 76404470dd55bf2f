"""The packed step buffer: every small array of one step in a single int32 host buffer.

One host-to-device transfer per step carries it (docs/architecture.md, "One engine step"); the jitted step slices it back
into arrays by static offsets and bit-casts the float and unsigned sampling columns back to
their dtypes (``PackedLayout.unpack``). This module is the one place that says which
sections exist, in what order, how long each is for a bucket of ``T`` tokens and ``B``
sequences, what a padding row or token holds, and the dtype each sampling column really has.
``input_prep.PackedInputBuilder`` fills it; ``model_runner.ModelRunner`` compiles against it.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

# The LogitsState row that holds no request's data: its index depends on the engine
# (``LogitsState.neutral_slot``), so the template takes it as an argument.
NEUTRAL_SLOT = "neutral_slot"

# (name, length, dtype, padding). Length is in the shape letters of ``pallas_kernels``: "T"
# tokens, "B" sequences, "B+1", or "B*max_blocks". Non-int32 dtypes travel as int32 bit patterns.
SECTIONS: tuple[tuple[str, str, type, object], ...] = (
    ("input_ids", "T", np.int32, 0),
    ("positions", "T", np.int32, 0),
    ("slot_mapping", "T", np.int32, -1),  # -1: a padding token's K/V is dropped
    ("block_tables", "B*max_blocks", np.int32, 0),  # [B, max_blocks] row-major
    ("seq_lens", "B", np.int32, 0),
    # Padding entries repeat the number of real tokens (the builder writes them), so padding
    # sequences hold no query token.
    ("cu_q_lens", "B+1", np.int32, 0),
    ("logits_indices", "B", np.int32, 0),
    # Per token: the row of the previous step's sampled tokens that holds this token's id
    # (async scheduling's placeholders), or -1 to use ``input_ids``.
    ("prev_index", "T", np.int32, -1),
    # Per token: its LoRA adapter's device slot, -1 = base model (``models.lora``).
    ("lora_slots", "T", np.int32, -1),
    # Sampling columns, one per sequence; padding rows are neutral (greedy, no filter, no
    # penalty, no logprobs). See ``SamplingMetadata`` for each column's meaning.
    ("temperature", "B", np.float32, 0.0),
    ("top_k", "B", np.int32, 0),
    ("top_p", "B", np.float32, 1.0),
    ("min_p", "B", np.float32, 0.0),
    ("seed_lo", "B", np.uint32, 0),
    ("seed_hi", "B", np.uint32, 0),
    ("step", "B", np.int32, 0),
    ("presence_penalty", "B", np.float32, 0.0),
    ("frequency_penalty", "B", np.float32, 0.0),
    ("repetition_penalty", "B", np.float32, 1.0),
    ("state_slot", "B", np.int32, NEUTRAL_SLOT),
    ("suppress_stop", "B", np.int32, 0),
    ("count_sampled", "B", np.int32, 0),
    ("num_logprobs", "B", np.int32, -1),
    ("logprobs_mode", "B", np.int32, 0),
    # Per token: the prompt token that follows it (whose prompt logprob its logits give), or -1.
    ("prompt_target", "T", np.int32, -1),
    # Structured outputs: the packed token bitmask i32[B, bitmask_words] row-major
    # (``structured_output/bitmask.py``); -1 (all allowed) for unconstrained and padding rows.
    # Empty unless the layout's ``bitmask_words`` is set (steps where some row is constrained).
    ("token_bitmask", "B*bitmask_words", np.int32, -1),
)
_FIRST_SAMPLING = [name for name, *_ in SECTIONS].index("temperature")
# The sampling columns in packed order, with their real dtypes.
SAMPLING_COLUMNS: dict[str, type] = {
    name: dtype for name, per, dtype, _ in SECTIONS[_FIRST_SAMPLING:] if per == "B"
}


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """Offsets of every section inside the packed int32 buffer of one bucket (static: the
    jitted step is compiled per layout)."""

    num_tokens: int
    num_seqs: int
    max_blocks: int
    bitmask_words: int = 0  # W of the token bitmask; 0: no bitmask section

    def sections(self) -> list[tuple[str, int]]:
        """(name, int32 length) of every section, in buffer order."""
        lengths = {
            "T": self.num_tokens,
            "B": self.num_seqs,
            "B+1": self.num_seqs + 1,
            "B*max_blocks": self.num_seqs * self.max_blocks,
            "B*bitmask_words": self.num_seqs * self.bitmask_words,
        }
        return [(name, lengths[per]) for name, per, _, _ in SECTIONS]

    @property
    def size(self) -> int:
        return sum(n for _, n in self.sections())

    def spans(self) -> dict[str, slice]:
        """Each section's slice of the buffer."""
        spans, offset = {}, 0
        for name, n in self.sections():
            spans[name] = slice(offset, offset + n)
            offset += n
        return spans

    def unpack(self, packed) -> dict:
        """Section name -> its slice of ``packed`` (i32[size], on the device inside the jitted
        step, or on the host), bit-cast back to the section's dtype (``SECTIONS``)."""
        on_host = isinstance(packed, np.ndarray)
        arrays = {}
        for (name, _, dtype, _), span in zip(SECTIONS, self.spans().values(), strict=True):
            x = packed[span]
            if dtype is not np.int32:
                x = x.view(dtype) if on_host else jax.lax.bitcast_convert_type(x, dtype)
            arrays[name] = x
        return arrays

    def template(self, neutral_slot: int) -> np.ndarray:
        """The buffer of an empty step: i32[size], every section at its padding value
        (float and unsigned values as their bit patterns)."""
        parts = []
        for (_, _, dtype, padding), (_, n) in zip(SECTIONS, self.sections(), strict=True):
            value = neutral_slot if padding == NEUTRAL_SLOT else padding
            parts.append(np.full(n, value, dtype).view(np.int32))
        return np.concatenate(parts)
