"""The model runner's packed int32 step buffer, built with whole-array numpy operations.

At a batch of hundreds of sequences the per-sequence numpy calls of a straightforward builder
(a block table converted from its list, fifteen scalar writes of sampling fields, a slice per
token range) cost milliseconds per step, as much as the device step itself. Here one Python
pass per step only gathers a few scalars per sequence; everything else is array arithmetic:

- each sequence's block table is kept as an int32 row that grows with its list (the scheduler's
  tables are only ever appended to while a sequence holds them; a replaced list is re-read);
- each sequence's constant sampling fields (temperature, filters, seed halves, penalties) are
  converted to their packed bit patterns once;
- padding comes from a per-layout template holding every section's neutral values.

The buffer is byte-for-byte the one ``step_buffer.PackedLayout`` defines
(``tests/worker/test_prepare_inputs_fast.py`` checks it against a straightforward per-sequence
builder).
"""

from __future__ import annotations

import numpy as np

from jaxpaged.sampling_params import LOGPROBS_MODE_CODES
from jaxpaged.sequence import PLACEHOLDER_TOKEN_ID

# Per-sequence constants, in column order of the builder's constant rows: the first nine are
# packed fields copied as they are; the rest feed the per-step fields.
_CONSTANT_FIELDS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed_lo",
    "seed_hi",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_MIN_TOKENS, _NUM_LOGPROBS, _LOGPROBS_MODE, _PROMPT_LOGPROBS = 9, 10, 11, 12
_NUM_CONSTANTS = 13
_INT32_MAX = 2**31 - 1


class _SeqEntry:
    """What the builder remembers about one sequence: its row in the builder's arrays and the
    block-table list that row mirrors."""

    __slots__ = ("seq", "params", "seed", "row", "table", "num_filled")

    def __init__(self, seq, row: int):
        self.seq = seq
        self.params = seq.sampling_params
        self.seed = seq.sampling_seed
        self.row = row
        self.table: list[int] | None = None
        self.num_filled = 0


def _sampling_constants(params, seed: int, out: np.ndarray) -> None:
    """Fill ``out`` (i32[13]): the nine constant packed fields (floats and seed halves as bit
    patterns, as ``step_buffer.SECTIONS`` gives their dtypes), then min_tokens, the
    logprobs asked for (-1: none), whether they are processed ones, and whether prompt logprobs
    are asked for."""
    floats = np.array(
        [
            params.effective_temperature,
            params.top_p,
            params.min_p,
            params.presence_penalty,
            params.frequency_penalty,
            params.repetition_penalty,
        ],
        np.float32,
    ).view(np.int32)
    seeds = np.array([seed & 0xFFFFFFFF, seed >> 32], np.uint32).view(np.int32)
    # A top_k at or above the vocabulary keeps every token, and no sequence reaches 2**31
    # tokens: clamping both to int32 keeps their meaning (a larger one would raise here).
    top_k, min_tokens = min(params.top_k, _INT32_MAX), min(params.min_tokens, _INT32_MAX)
    out[0], out[1], out[2], out[3] = floats[0], top_k, floats[1], floats[2]
    out[4], out[5] = seeds
    out[6:9] = floats[3:6]
    out[_MIN_TOKENS] = min_tokens
    wants = params.logprobs is not None
    out[_NUM_LOGPROBS] = params.logprobs if wants else -1
    # None (a request the engine has not resolved, e.g. in runner tests): raw logprobs.
    mode = params.logprobs_mode or "raw_logprobs"
    out[_LOGPROBS_MODE] = LOGPROBS_MODE_CODES[mode] if wants else 0
    out[_PROMPT_LOGPROBS] = params.prompt_logprobs is not None


class PackedInputBuilder:
    """Builds one step's packed int32 buffer for a ``ModelRunner`` layout.

    Per sequence it keeps a row of ``_constants`` (i32[rows, 13]) and of ``_blocks``
    (i32[rows, max_blocks], the block table padded with zeros), so a step gathers both with one
    fancy index over the scheduled sequences' rows.

    Args:
        block_size: tokens per KV block.
        max_blocks: block-table columns per sequence (the layout's ``max_blocks``).
        neutral_slot: the LogitsState row that holds no request's data.
        max_cached_seqs: sequences remembered before those absent from a step are forgotten.
    """

    def __init__(
        self, *, block_size: int, max_blocks: int, neutral_slot: int, max_cached_seqs: int
    ):
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.neutral_slot = neutral_slot
        self.max_cached_seqs = max_cached_seqs
        self._entries: dict[str, _SeqEntry] = {}
        capacity = 16
        self._constants = np.zeros((capacity, _NUM_CONSTANTS), np.int32)
        self._blocks = np.zeros((capacity, max_blocks), np.int32)
        self._free_rows = list(range(capacity - 1, -1, -1))
        self._templates: dict[object, tuple[np.ndarray, dict[str, slice]]] = {}

    def build(
        self,
        scheduled,
        layout,
        slots: list,
        *,
        profile: bool = False,
        prev_scheduled: list = (),
        lora_slots: np.ndarray | None = None,
    ) -> np.ndarray:
        """The packed buffer, i32[layout.size], for ``scheduled`` (``ScheduledSequence``s)
        padded to ``layout``; ``slots[i]`` is row i's LogitsState slot or None. ``profile``:
        every token asks for a prompt logprob (the memory-profiling step). ``prev_scheduled``: the
        previous step's ``ScheduledSequence`` s in row order; a ``PLACEHOLDER_TOKEN_ID`` input
        reads its real id on the device from its sequence's row there (``prev_index``).
        ``lora_slots``: i32[len(scheduled)], each sequence's LoRA slot (-1: base model), copied
        to its tokens; None leaves every token on the base model."""
        template, spans = self._template(layout)
        packed = template.copy()
        view = {name: packed[span] for name, span in spans.items()}
        if profile:
            view["prompt_target"][:] = 0
        n = len(scheduled)
        if n == 0:
            return packed
        if len(self._entries) > self.max_cached_seqs:
            self._forget_all_but(scheduled)

        rows = np.array([self._row_of(s) for s in scheduled], np.intp)
        starts = np.array([s.num_computed_tokens for s in scheduled], np.int32)
        num_new = [s.num_new_tokens for s in scheduled]
        tables = view["block_tables"].reshape(layout.num_seqs, self.max_blocks)
        np.take(self._blocks, rows, axis=0, out=tables[:n])
        if num_new.count(1) == n:  # decode-only: one token per sequence
            num_tokens = n
            view["input_ids"][:n] = [s.seq.token_ids[s.num_computed_tokens] for s in scheduled]
            positions = starts
            token_rows = np.arange(n)
            cu = np.arange(1, n + 1, dtype=np.int32)
            view["seq_lens"][:n] = starts + 1
        else:
            counts = np.array(num_new, np.int32)
            cu = np.cumsum(counts, dtype=np.int32)
            num_tokens = int(cu[-1])
            token_ids = []
            for s in scheduled:
                start = s.num_computed_tokens
                token_ids += s.seq.token_ids[start : start + s.num_new_tokens]
            view["input_ids"][:num_tokens] = token_ids
            token_rows = np.repeat(np.arange(n), counts)
            # A token's position: its sequence's start plus its offset in the sequence's run.
            offsets = np.arange(num_tokens, dtype=np.int32) - np.repeat(cu - counts, counts)
            positions = np.repeat(starts, counts) + offsets
            view["seq_lens"][:n] = starts + counts
        placeholders = np.flatnonzero(view["input_ids"][:num_tokens] == PLACEHOLDER_TOKEN_ID)
        if placeholders.size:
            view["input_ids"][placeholders] = 0
            # Only async scheduling has placeholders: map ids to rows for those steps alone.
            prev_rows = {s.seq.seq_id: i for i, s in enumerate(prev_scheduled)}
            view["prev_index"][placeholders] = [
                prev_rows[scheduled[token_rows[t]].seq.seq_id] for t in placeholders
            ]
        if lora_slots is not None:
            view["lora_slots"][:num_tokens] = lora_slots[token_rows]
        bs = self.block_size
        view["positions"][:num_tokens] = positions
        view["slot_mapping"][:num_tokens] = (
            tables[token_rows, positions // bs] * bs + positions % bs
        )
        view["cu_q_lens"][1 : n + 1] = cu
        view["cu_q_lens"][n + 1 :] = num_tokens
        view["logits_indices"][:n] = cu - 1

        constants = self._constants[rows]
        self._fill_sampling_rows(view, scheduled, constants, slots)
        for i in np.flatnonzero(constants[:, _PROMPT_LOGPROBS]):
            s = scheduled[i]
            _set_prompt_targets(
                view["prompt_target"],
                int(cu[i]) - s.num_new_tokens,
                s.seq,
                s.num_computed_tokens,
                s.num_new_tokens,
            )
        return packed

    def _row_of(self, s) -> int:
        """The sequence's row, (re)built when the sequence is new to the builder and brought up
        to date with ``s.block_table``: tables only grow in place while a sequence holds them,
        so a same-list table needs only its new tail; any other list is read whole."""
        seq = s.seq
        entry = self._entries.get(seq.seq_id)
        if (
            entry is None
            or entry.seq is not seq
            or entry.params is not seq.sampling_params
            or entry.seed != seq.sampling_seed
        ):
            entry = self._new_entry(seq, entry)
        table = s.block_table
        n = len(table)
        if table is not entry.table or n < entry.num_filled:
            self._blocks[entry.row] = 0
            entry.table, entry.num_filled = table, 0
        if n > entry.num_filled:
            self._blocks[entry.row, entry.num_filled : n] = table[entry.num_filled :]
            entry.num_filled = n
        return entry.row

    def _new_entry(self, seq, stale: _SeqEntry | None) -> _SeqEntry:
        if stale is not None:
            row = stale.row
        else:
            if not self._free_rows:
                self._grow()
            row = self._free_rows.pop()
        _sampling_constants(seq.sampling_params, seq.sampling_seed, self._constants[row])
        entry = self._entries[seq.seq_id] = _SeqEntry(seq, row)
        return entry

    def _grow(self) -> None:
        old = len(self._constants)
        self._constants = np.concatenate([self._constants, np.zeros_like(self._constants)])
        self._blocks = np.concatenate([self._blocks, np.zeros_like(self._blocks)])
        self._free_rows.extend(range(2 * old - 1, old - 1, -1))

    def _forget_all_but(self, scheduled) -> None:
        keep = {s.seq.seq_id for s in scheduled}
        for seq_id in [k for k in self._entries if k not in keep]:
            self._free_rows.append(self._entries.pop(seq_id).row)

    def _fill_sampling_rows(self, view, scheduled, constants, slots) -> None:
        n = len(scheduled)
        for column, name in enumerate(_CONSTANT_FIELDS):
            view[name][:n] = constants[:, column]
        steps = np.array([len(s.seq.output_token_ids) for s in scheduled], np.int32)
        sampling = np.array([s.do_sample for s in scheduled], np.bool_)
        view["step"][:n] = steps
        view["num_logprobs"][:n] = np.where(sampling, constants[:, _NUM_LOGPROBS], -1)
        view["logprobs_mode"][:n] = np.where(sampling, constants[:, _LOGPROBS_MODE], 0)
        if slots.count(None) == n:
            return  # no LogitsState user: the template's neutral slot and zeros stand
        has_slot = np.array([slot is not None for slot in slots], np.bool_)
        view["state_slot"][:n] = [self.neutral_slot if s is None else s for s in slots]
        view["suppress_stop"][:n] = has_slot & (steps < constants[:, _MIN_TOKENS])
        view["count_sampled"][:n] = has_slot & sampling

    def _template(self, layout) -> tuple[np.ndarray, dict[str, slice]]:
        """The buffer of an empty step (``PackedLayout.template``) and each section's span,
        built once per layout."""
        cached = self._templates.get(layout)
        if cached is None:
            cached = self._templates[layout] = (layout.template(self.neutral_slot), layout.spans())
        return cached


def _set_prompt_targets(prompt_target, t: int, seq, num_computed: int, num_new: int) -> None:
    """Tokens ``t .. t + num_new - 1`` are ``seq``'s positions from ``num_computed``: each whose
    next position is still in the prompt targets that prompt token."""
    first_next = num_computed + 1
    last_next = min(num_computed + num_new, seq.num_prompt_tokens - 1)
    if last_next >= first_next:
        n = last_next - first_next + 1
        prompt_target[t : t + n] = seq.prompt_token_ids[first_next : last_next + 1]
