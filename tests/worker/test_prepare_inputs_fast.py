"""The vectorised packed-buffer builder (``jaxpaged.worker.input_prep``) against the original
per-sequence builder, byte for byte, over random multi-step schedules: mixed prefill chunks and
decodes, prompt-logprobs and logprobs requests, LogitsState users, padding, block tables that
grow in place or are replaced (copy-on-write, swap-in, recompute) and reused request ids."""

from __future__ import annotations

import numpy as np
import pytest

from jaxpaged.core.scheduler_output import ScheduledSequence
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.sequence import Sequence
from jaxpaged.worker.input_prep import PackedInputBuilder
from jaxpaged.worker.step_buffer import SAMPLING_COLUMNS, PackedLayout

BLOCK_SIZE = 4
MAX_BLOCKS = 12  # max_model_len 48
NEUTRAL_SLOT = 64
NUM_BLOCKS = 200


class _SamplingRows:
    """Sampling columns filled one sequence at a time (the original builder's way)."""

    def __init__(self, num_tokens: int, num_seqs: int):
        neutral = dict(top_p=1.0, repetition_penalty=1.0, num_logprobs=-1, state_slot=NEUTRAL_SLOT)
        self.rows = {
            name: np.full(num_seqs, neutral.get(name, 0), dtype)
            for name, dtype in SAMPLING_COLUMNS.items()
        }
        self.prompt_target = np.full(num_tokens, -1, np.int32)

    def set_row(self, i, seq, *, seed, do_sample, state_slot):
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

    def set_prompt_targets(self, t, seq, num_computed_tokens, num_new_tokens):
        if seq.sampling_params.prompt_logprobs is None:
            return
        first_next = num_computed_tokens + 1
        last_next = min(num_computed_tokens + num_new_tokens, seq.num_prompt_tokens - 1)
        if last_next >= first_next:
            n = last_next - first_next + 1
            self.prompt_target[t : t + n] = seq.prompt_token_ids[first_next : last_next + 1]

    def packed(self) -> dict[str, np.ndarray]:
        out = {name: array.view(np.int32) for name, array in self.rows.items()}
        out["prompt_target"] = self.prompt_target
        return out


def reference_packed(scheduled, layout, slots, *, profile=False) -> np.ndarray:
    """The original ``ModelRunner._prepare_inputs``, kept as the reference: its own padding
    values and conversions; only the section order comes from ``PackedLayout``."""
    t_pad, b_pad, bs = layout.num_tokens, layout.num_seqs, BLOCK_SIZE
    input_ids = np.zeros(t_pad, np.int32)
    positions = np.zeros(t_pad, np.int32)
    slot_mapping = np.full(t_pad, -1, np.int32)
    block_tables = np.zeros((b_pad, layout.max_blocks), np.int32)
    seq_lens = np.zeros(b_pad, np.int32)
    cu_q_lens = np.zeros(b_pad + 1, np.int32)
    logits_indices = np.zeros(b_pad, np.int32)
    sampling = _SamplingRows(t_pad, b_pad)
    if profile:
        sampling.prompt_target[:] = 0

    t = 0
    for i, s in enumerate(scheduled):
        start, n = s.num_computed_tokens, s.num_new_tokens
        input_ids[t : t + n] = s.seq.token_ids[start : start + n]
        pos = np.arange(start, start + n, dtype=np.int32)
        positions[t : t + n] = pos
        table = np.asarray(s.block_table, np.int32)
        slot_mapping[t : t + n] = table[pos // bs] * bs + pos % bs
        block_tables[i, : len(table)] = table
        seq_lens[i] = start + n
        t += n
        cu_q_lens[i + 1] = t
        logits_indices[i] = t - 1
        sampling.set_row(
            i, s.seq, seed=s.seq.sampling_seed, do_sample=s.do_sample, state_slot=slots[i]
        )
        sampling.set_prompt_targets(t - n, s.seq, start, n)
    cu_q_lens[len(scheduled) + 1 :] = t

    parts = {
        "input_ids": input_ids,
        "positions": positions,
        "slot_mapping": slot_mapping,
        "block_tables": block_tables.reshape(-1),
        "seq_lens": seq_lens,
        "cu_q_lens": cu_q_lens,
        "logits_indices": logits_indices,
        "prev_index": np.full(t_pad, -1, np.int32),  # no async placeholders here
        "lora_slots": np.full(t_pad, -1, np.int32),  # no LoRA here
        # no structured outputs here (the model runner writes the bitmask rows itself)
        "token_bitmask": np.full(b_pad * layout.bitmask_words, -1, np.int32),
        **sampling.packed(),
    }
    return np.concatenate([parts[name] for name, _ in layout.sections()])


def _builder(max_cached_seqs=64) -> PackedInputBuilder:
    return PackedInputBuilder(
        block_size=BLOCK_SIZE,
        max_blocks=MAX_BLOCKS,
        neutral_slot=NEUTRAL_SLOT,
        max_cached_seqs=max_cached_seqs,
    )


def _random_params(rng) -> SamplingParams:
    greedy = rng.random() < 0.3
    kwargs = dict(
        temperature=0.0 if greedy else float(rng.choice([0.005, 0.7, 1.0, 1.3])),
        max_tokens=40,
        ignore_eos=True,
    )
    if not greedy:
        kwargs.update(
            top_k=int(rng.choice([0, 1, 5])),
            top_p=float(rng.choice([1.0, 0.9, 0.33])),
            min_p=float(rng.choice([0.0, 0.1])),
        )
    if rng.random() < 0.3:
        kwargs.update(
            presence_penalty=float(rng.uniform(-2, 2)),
            frequency_penalty=float(rng.uniform(-2, 2)),
            repetition_penalty=float(rng.uniform(0.5, 2)),
        )
    if rng.random() < 0.2:
        kwargs["min_tokens"] = int(rng.integers(1, 6))
    if rng.random() < 0.3:
        kwargs["logprobs"] = int(rng.integers(0, 5))
        kwargs["logprobs_mode"] = str(rng.choice(["raw_logprobs", "processed_logprobs"]))
    if rng.random() < 0.2:
        kwargs["prompt_logprobs"] = int(rng.integers(0, 3))
    return SamplingParams(**kwargs)


class _Live:
    """One sequence of the simulation and the block table the 'manager' holds for it."""

    def __init__(self, rng, seq_id: str):
        prompt = rng.integers(0, 500, size=int(rng.integers(1, 20))).tolist()
        self.seq = Sequence(seq_id, prompt, _random_params(rng))
        self.seq.sampling_seed = int(rng.integers(0, 2**63))
        self.table: list[int] = []

    def cover(self, rng, num_tokens: int) -> None:
        """Grow the table in place to ``num_tokens`` slots (the manager's append-only rule)."""
        needed = -(-num_tokens // BLOCK_SIZE)
        self.table.extend(
            rng.integers(0, NUM_BLOCKS, size=max(0, needed - len(self.table))).tolist()
        )


def _schedule(rng, live: list[_Live], max_seqs: int, *, every_seq: bool = False):
    """Pick sequences for one step (decodes first), give them token counts and tables."""
    num_seqs = len(live) if every_seq else int(rng.integers(1, max_seqs + 1))
    chosen = [live[i] for i in rng.permutation(len(live))[:num_seqs]]
    items = []
    for entry in chosen:
        seq = entry.seq
        if rng.random() < 0.05:  # copy-on-write / swap-in / recompute: a new list
            entry.table = [int(b) for b in entry.table]
            if entry.table:
                entry.table[rng.integers(len(entry.table))] = int(rng.integers(NUM_BLOCKS))
        uncomputed = seq.num_tokens - seq.num_computed_tokens
        n = uncomputed if uncomputed == 1 else int(rng.integers(1, uncomputed + 1))
        entry.cover(rng, seq.num_computed_tokens + n)
        items.append(
            ScheduledSequence(
                seq=seq,
                num_computed_tokens=seq.num_computed_tokens,
                num_new_tokens=n,
                block_table=entry.table,
                do_sample=seq.num_computed_tokens + n == seq.num_tokens,
            )
        )
    items.sort(key=lambda item: item.seq.is_prefill)
    return items


def _commit(rng, items, live: list[_Live], counter) -> None:
    for item in items:
        item.seq.num_computed_tokens += item.num_new_tokens
        if item.do_sample:
            item.seq.append_token(int(rng.integers(0, 500)))
    for i, entry in enumerate(live):
        seq = entry.seq
        done = seq.num_tokens >= MAX_BLOCKS * BLOCK_SIZE - 1
        if done or rng.random() < 0.03:
            # Finished, or recompute-preempted (tables freed, prefilled again later); a
            # finished request's id is sometimes reused by a new request.
            if done or rng.random() < 0.5:
                reuse = rng.random() < 0.3
                live[i] = _Live(rng, seq.seq_id if reuse else f"r{next(counter)}")
            else:
                seq.num_computed_tokens = 0
                entry.table = []


def _slots(rng, items) -> list:
    if rng.random() < 0.4:
        return [None] * len(items)
    free = list(rng.permutation(NEUTRAL_SLOT))
    return [
        free.pop() if item.seq.sampling_params.uses_logits_state or rng.random() < 0.2 else None
        for item in items
    ]


@pytest.mark.parametrize("seed", range(6))
def test_packed_buffer_equals_reference_over_random_schedules(seed):
    rng = np.random.default_rng(seed)
    counter = iter(range(10**6))
    max_seqs = 12
    live = [_Live(rng, f"r{next(counter)}") for _ in range(max_seqs + 4)]
    builder = _builder(max_cached_seqs=2 * max_seqs)
    for _ in range(60):
        items = _schedule(rng, live, max_seqs)
        slots = _slots(rng, items)
        num_tokens = sum(item.num_new_tokens for item in items)
        decode_only = all(item.num_new_tokens == 1 for item in items)
        pad_seqs = len(items) + int(rng.integers(0, 4))
        layout = PackedLayout(
            num_tokens=pad_seqs if decode_only else num_tokens + int(rng.integers(0, 9)),
            num_seqs=pad_seqs,
            max_blocks=MAX_BLOCKS,
        )
        expected = reference_packed(items, layout, slots)
        actual = builder.build(items, layout, slots)
        assert actual.dtype == np.int32 and actual.shape == (layout.size,)
        np.testing.assert_array_equal(actual, expected)
        _commit(rng, items, live, counter)


def test_decode_only_batch_equals_reference():
    rng = np.random.default_rng(7)
    live = [_Live(rng, f"r{i}") for i in range(32)]
    builder = _builder()
    for entry in live:  # prefill everything, then sample a first token
        seq = entry.seq
        seq.num_computed_tokens = seq.num_tokens
        seq.append_token(3)
    for _ in range(5):
        items = []
        for entry in live:
            entry.cover(rng, entry.seq.num_tokens)
            items.append(
                ScheduledSequence(entry.seq, entry.seq.num_tokens - 1, 1, entry.table, True)
            )
        layout = PackedLayout(32, 32, MAX_BLOCKS)
        slots = _slots(rng, items)
        np.testing.assert_array_equal(
            builder.build(items, layout, slots), reference_packed(items, layout, slots)
        )
        _commit(rng, items, live, iter(range(100, 200)))


@pytest.mark.parametrize("profile", [False, True])
def test_empty_step_is_the_padding_template(profile):
    layout = PackedLayout(16, 8, MAX_BLOCKS)
    np.testing.assert_array_equal(
        _builder().build([], layout, [], profile=profile),
        reference_packed([], layout, [], profile=profile),
    )


def test_builder_forgets_sequences_beyond_its_cache_size():
    rng = np.random.default_rng(3)
    builder = _builder(max_cached_seqs=4)
    layout = PackedLayout(64, 8, MAX_BLOCKS)
    for step in range(6):
        live = [_Live(rng, f"s{step}-{i}") for i in range(3)]
        items = _schedule(rng, live, 3)
        builder.build(items, layout, [None] * len(items))
        assert len(builder._entries) <= 4 + 3
        assert len(builder._free_rows) + len(builder._entries) == len(builder._constants)


def test_changed_seed_or_params_of_a_known_sequence_are_read_again():
    rng = np.random.default_rng(5)
    builder = _builder()
    layout = PackedLayout(64, 8, MAX_BLOCKS)
    live = [_Live(rng, f"r{i}") for i in range(4)]
    for change in range(3):
        items = _schedule(rng, live, 4, every_seq=True)
        slots = [None] * len(items)
        np.testing.assert_array_equal(
            builder.build(items, layout, slots), reference_packed(items, layout, slots)
        )
        for entry in live:
            if change == 0:
                entry.seq.sampling_seed += 1
            else:
                entry.seq.sampling_params = _random_params(rng)
