"""``jaxpaged bench matrix --workers N``: how rows are split over worker processes."""

import pytest

from jaxpaged.benchmarks.matrix_rows import ROWS
from jaxpaged.benchmarks.matrix_shards import shard_rows


def test_shards_cover_every_row_once_and_keep_shared_references_together():
    shards = shard_rows(ROWS, 4)
    assert len(shards) == 4
    names = [row.name for shard in shards for row in shard]
    assert sorted(names) == sorted(row.name for row in ROWS)
    home = {}
    for k, shard in enumerate(shards):
        for row in shard:  # rows that may share a reference run live in one worker
            assert home.setdefault((row.model, row.workload), k) == k
    sizes = sorted(len(s) for s in shards)
    largest_group = max(sum(1 for r in ROWS if (r.model, r.workload) == key) for key in home)
    assert sizes[-1] - sizes[0] <= largest_group  # balanced up to one group


def test_shards_keep_declared_order_and_never_exceed_the_groups():
    order = {row.name: i for i, row in enumerate(ROWS)}
    for shard in shard_rows(ROWS, 3):
        positions = [order[row.name] for row in shard]
        assert positions == sorted(positions)
    two_rows = [r for r in ROWS if r.model == "stories260k"][:2]
    assert len(shard_rows(two_rows, 8)) == 1  # one (model, workload) group: one worker
    with pytest.raises(ValueError, match="workers must be at least 1"):
        shard_rows(ROWS, 0)
