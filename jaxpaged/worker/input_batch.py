"""Persistent host rows of the scheduled sequences: block tables and sampling parameters.

Rebuilding ``block_tables[B, max_blocks]`` and the per-row sampling arrays from Python lists
every step costs ``O(B * max_blocks)`` interpreter work, which at ``B = 1024`` is milliseconds
the device would wait for. Instead each sequence keeps one row for as long as it is scheduled
step after step (vLLM v1's persistent ``InputBatch``, in spirit): its block table is copied only
where it grew and its sampling parameters are written once, so a step's arrays come from one
numpy gather over the rows.

The rows rely on what ``KVCacheManager`` guarantees about a table while a sequence holds it: the
list object stays the same and only grows at its end, except that copy-on-write may replace its
last entry. A new list (the sequence was freed and allocated again) rewrites the whole row, and
the last entry of every row is refreshed each step.
"""

from __future__ import annotations

import numpy as np


class PersistentRows:
    """Rows ``0 .. num_rows - 1`` for scheduled sequences plus one all-padding row.

    Args:
        num_rows: most sequences in one step (``max_num_seqs``).
        max_blocks: block-table columns per sequence (``ceil(max_model_len / block_size)``).

    Arrays (row ``padding_row`` is padding: block 0 everywhere, greedy sampling):
        ``block_tables``: ``i32[num_rows + 1, max_blocks]``; ``temperature``, ``top_p``,
        ``min_p``: ``f32[num_rows + 1]``; ``top_k``: ``i32[num_rows + 1]``; ``seed``:
        ``u64[num_rows + 1]``.
    """

    def __init__(self, num_rows: int, max_blocks: int):
        if num_rows < 1 or max_blocks < 1:
            raise ValueError(f"rows need num_rows, max_blocks >= 1, got {num_rows=}, {max_blocks=}")
        self.num_rows = num_rows
        self.max_blocks = max_blocks
        size = num_rows + 1
        self.block_tables = np.zeros((size, max_blocks), np.int32)
        self.temperature = np.zeros(size, np.float32)
        self.top_k = np.zeros(size, np.int32)
        self.top_p = np.ones(size, np.float32)
        self.min_p = np.zeros(size, np.float32)
        self.seed = np.zeros(size, np.uint64)
        self._row_of: dict[str, int] = {}
        self._table_of: list[list[int] | None] = [None] * num_rows
        self._num_copied = [0] * num_rows
        self._free_rows = list(range(num_rows - 1, -1, -1))

    @property
    def padding_row(self) -> int:
        return self.num_rows

    @property
    def num_assigned(self) -> int:
        return len(self._row_of)

    def assign(self, scheduled) -> np.ndarray:
        """Row of each scheduled sequence (``i64[len(scheduled)]``), every row up to date.

        Rows of sequences that are not in this step are released first, so a sequence that
        skips a step simply gets a fresh row when it returns.

        Raises:
            ValueError: more sequences than rows.
        """
        if len(scheduled) > self.num_rows:
            raise ValueError(f"{len(scheduled)} sequences scheduled but only {self.num_rows} rows")
        row_of = self._row_of
        current = {item.seq.seq_id for item in scheduled}
        if len(current) != len(scheduled):
            raise ValueError("a sequence is scheduled twice in one step")
        for seq_id in [seq_id for seq_id in row_of if seq_id not in current]:
            self._free_rows.append(row_of.pop(seq_id))

        rows = np.empty(len(scheduled), np.int64)
        lasts = np.empty(len(scheduled), np.int32)
        last_cols = np.empty(len(scheduled), np.int64)
        table_of, num_copied = self._table_of, self._num_copied
        for i, item in enumerate(scheduled):
            row = row_of.get(item.seq.seq_id)
            if row is None:
                row = self._free_rows.pop()
                row_of[item.seq.seq_id] = row
                self._write_sampling(row, item.seq)
                table_of[row] = None
            table = item.block_table
            n = len(table)
            if table_of[row] is not table:
                table_of[row] = table
                self.block_tables[row, :n] = table
                num_copied[row] = n
            elif n > num_copied[row]:
                start = num_copied[row]
                self.block_tables[row, start:n] = table[start:]
                num_copied[row] = n
            rows[i] = row
            lasts[i] = table[-1]
            last_cols[i] = n - 1
        # Copy-on-write replaces a table's last block in place: refresh that entry of every row.
        self.block_tables[rows, last_cols] = lasts
        return rows

    def _write_sampling(self, row: int, seq) -> None:
        params = seq.sampling_params
        self.temperature[row] = params.effective_temperature
        self.top_k[row] = params.top_k
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.seed[row] = seq.sampling_seed
