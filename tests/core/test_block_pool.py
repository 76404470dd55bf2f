"""BlockPool: allocation, ref counts, free order and the free/referenced invariant."""

import pytest

from jaxpaged.core.block_pool import BlockPool


def test_new_pool_has_every_block_free():
    pool = BlockPool(4)
    assert pool.num_free_blocks == 4
    assert pool.usage == 0.0
    pool.check_invariants()


def test_allocate_takes_blocks_with_ref_count_one():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert blocks == [0, 1, 2]
    assert [pool.ref_counts[b] for b in blocks] == [1, 1, 1]
    assert pool.num_free_blocks == 1
    assert pool.usage == 0.75
    pool.check_invariants()


def test_allocate_returns_none_when_blocks_run_out_and_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    before = (list(pool.free_block_queue), list(pool.ref_counts))
    assert pool.allocate(2) is None
    assert (list(pool.free_block_queue), list(pool.ref_counts)) == before
    pool.check_invariants()


def test_allocate_zero_blocks_is_an_empty_list():
    assert BlockPool(1).allocate(0) == []


def test_allocate_negative_is_a_bug():
    with pytest.raises(ValueError, match="negative"):
        BlockPool(2).allocate(-1)


def test_free_returns_block_when_last_reference_drops():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.incref([block])
    pool.free([block])
    assert pool.num_free_blocks == 1  # still held by one table
    pool.free([block])
    assert pool.num_free_blocks == 2
    pool.check_invariants()


def test_freed_uncached_blocks_are_reused_first_in_given_order():
    pool = BlockPool(6)
    table = pool.allocate(3)
    pool.free(reversed(table))  # tail first, as the KV cache manager frees
    assert list(pool.free_block_queue)[:3] == table
    assert pool.allocate(3) == table


def test_double_free_raises_and_changes_nothing():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    with pytest.raises(ValueError, match="double free"):
        pool.free([b, a, a])
    assert pool.ref_counts[a] == 1 and pool.ref_counts[b] == 1
    pool.check_invariants()


def test_incref_of_free_block_is_a_bug():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="free block"):
        pool.incref([0])


def test_out_of_range_block_id_is_a_bug():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="out of range"):
        pool.free([5])


def test_new_blocks_have_no_hash_until_prefix_caching():
    pool = BlockPool(3)
    assert pool.block_hashes == [None, None, None]


def test_check_invariants_catches_a_block_both_free_and_referenced():
    pool = BlockPool(3)
    pool.allocate(1)
    pool.free_block_queue.append(0)  # corrupt: block 0 is referenced
    with pytest.raises(AssertionError, match="block_id=0"):
        pool.check_invariants()


def test_check_invariants_catches_duplicates_in_free_queue():
    pool = BlockPool(3)
    pool.free_block_queue.append(1)
    with pytest.raises(AssertionError, match="duplicates"):
        pool.check_invariants()


def test_pool_needs_at_least_one_block():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
