"""LogitsState rows built from the host, and the slot table that caches them."""

from __future__ import annotations

import numpy as np
import pytest

from jaxpaged.sample import logits_state as ls
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.sequence import Sequence, SequenceStatus

V = 64


def _seq(seq_id, prompt=(1, 5, 5, 9), outputs=(), **params):
    seq = Sequence(seq_id, list(prompt), SamplingParams(**params), eos_token_id=2)
    for token in outputs:
        seq.append_token(token)
    return seq


def test_host_rows_hold_counts_prompt_stop_ids_and_bias():
    seqs = [
        _seq("a", outputs=(7, 7, 3), stop_token_ids=[11], logit_bias={4: 150.0, 6: -2.0}),
        _seq("b", ignore_eos=True, allowed_token_ids=[3, 4], logit_bias={4: 1.5}),
    ]
    rows = ls.host_rows(seqs, V)
    assert rows.output_counts.shape == (ls.WRITE_ROWS, V)
    np.testing.assert_array_equal(rows.output_counts[0], np.bincount([7, 7, 3], minlength=V))
    assert not rows.output_counts[1].any()
    assert set(np.flatnonzero(rows.prompt_mask[0])) == {1, 5, 9}
    assert set(np.flatnonzero(rows.stop_mask[0])) == {2, 11}
    assert not rows.stop_mask[1].any()  # ignore_eos: EOS is no stop token
    assert rows.logit_bias[0, 4] == 100.0 and rows.logit_bias[0, 6] == -2.0  # clamped
    assert set(np.flatnonzero(np.isfinite(rows.logit_bias[1]))) == {3, 4}
    assert rows.logit_bias[1, 4] == 1.5
    # Padding rows are empty.
    assert not rows.prompt_mask[2:].any() and not rows.logit_bias[2:].any()


def test_write_rows_overwrites_given_slots_and_drops_padding():
    state = ls.allocate_logits_state(3, V)
    rows = ls.host_rows([_seq("a", outputs=(7,)), _seq("b", outputs=(8, 8))], V)
    index = np.full(ls.WRITE_ROWS, state.neutral_slot + 1, np.int32)
    index[:2] = [2, 0]
    state = ls.write_rows(state, index, rows)
    counts = np.asarray(state.output_counts)
    assert counts[2, 7] == 1 and counts[0, 8] == 2
    assert not counts[1].any() and not counts[state.neutral_slot].any()


def test_slot_table_keeps_slots_evicts_finished_then_idle_and_rebuilds_returners():
    table = ls.SlotTable(2)
    a, b, c = _seq("a"), _seq("b"), _seq("c")
    slots, rebuild = table.assign([a, b])
    assert sorted(slots) == [0, 1] and [s for _, s in rebuild] == [a, b]
    assert table.assign([b, a]) == ([slots[1], slots[0]], [])  # cached: nothing to rebuild
    a.status = SequenceStatus.FINISHED_STOPPED
    slots_c, rebuild = table.assign([c])
    assert slots_c == [slots[0]] and rebuild == [(slots[0], c)]  # took finished a's slot
    # Full, nothing finished: the least recently used sequence outside the step (b) goes.
    d = _seq("d")
    slots_d, _ = table.assign([c, d])
    assert slots_d[1] == slots[1]
    # b comes back: it gets a slot again and is rebuilt from the host.
    (slot_b,), rebuild = table.assign([b])
    assert rebuild == [(slot_b, b)]
    # A new request reusing a finished request's id is a different sequence: rebuilt.
    b2 = _seq("b")
    assert table.assign([b2])[1] == [(slot_b, b2)]


def test_slot_table_refuses_more_sequences_than_slots():
    with pytest.raises(RuntimeError, match="num_slots=1"):
        ls.SlotTable(1).assign([_seq("a"), _seq("b")])
