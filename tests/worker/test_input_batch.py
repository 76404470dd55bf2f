"""Persistent rows: tables copied where they grew, rewritten when replaced, rows recycled."""

from __future__ import annotations

import types

import numpy as np
import pytest

from jaxpaged.worker.input_batch import PersistentRows


def _item(seq_id, table, *, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0):
    params = types.SimpleNamespace(
        effective_temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p
    )
    seq = types.SimpleNamespace(seq_id=seq_id, sampling_params=params, sampling_seed=seed)
    return types.SimpleNamespace(seq=seq, block_table=table)


def _expected_rows(rows_obj, items, rows):
    for item, row in zip(items, rows, strict=True):
        table = item.block_table
        np.testing.assert_array_equal(rows_obj.block_tables[row, : len(table)], table)


def test_tables_follow_growth_replacement_and_last_block_copy_on_write():
    rows = PersistentRows(4, 8)
    a, b = [3, 4], [7]
    items = [_item("a", a, temperature=0.5, seed=2**40 + 5), _item("b", b, top_k=3)]
    got = rows.assign(items)
    _expected_rows(rows, items, got)
    assert rows.temperature[got[0]] == np.float32(0.5) and rows.seed[got[0]] == 2**40 + 5
    assert rows.top_k[got[1]] == 3
    a.append(9)  # growth
    b[-1] = 11  # copy-on-write of the last block
    again = rows.assign(items)
    np.testing.assert_array_equal(again, got)
    _expected_rows(rows, items, again)
    items[0] = _item("a", [5, 6, 1])  # freed and allocated again: a new list
    _expected_rows(rows, items, rows.assign(items))


def test_rows_of_unscheduled_sequences_are_recycled():
    rows = PersistentRows(2, 4)
    first = rows.assign([_item("a", [1]), _item("b", [2])])
    assert sorted(first.tolist()) == [0, 1]
    second = rows.assign([_item("c", [3, 4])])  # a and b not scheduled: their rows free up
    assert rows.num_assigned == 1
    np.testing.assert_array_equal(rows.block_tables[second[0], :2], [3, 4])
    assert rows.temperature[rows.padding_row] == 0 and rows.top_p[rows.padding_row] == 1


def test_too_many_sequences_or_duplicates_are_errors():
    rows = PersistentRows(1, 4)
    with pytest.raises(ValueError, match="2 sequences scheduled but only 1 rows"):
        rows.assign([_item("a", [1]), _item("b", [2])])
    rows = PersistentRows(3, 4)
    with pytest.raises(ValueError, match="scheduled twice"):
        rows.assign([_item("a", [1]), _item("a", [1])])
