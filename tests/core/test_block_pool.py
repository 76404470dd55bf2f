"""BlockPool: allocation, ref counts, free order, the prefix-cache LRU and the block invariant."""

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


def test_new_blocks_have_no_hash():
    pool = BlockPool(3)
    assert pool.block_hashes == [None, None, None]
    assert pool.num_cached_blocks == 0


def test_check_invariants_catches_a_block_both_free_and_referenced():
    pool = BlockPool(3)
    pool.allocate(1)
    pool.free_block_queue[0] = None  # corrupt: block 0 is referenced
    with pytest.raises(AssertionError, match="block_id=0"):
        pool.check_invariants()


def test_check_invariants_catches_a_hash_missing_from_the_map():
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    pool.block_hashes[block] = b"h"  # corrupt: not registered with cache_block
    with pytest.raises(AssertionError, match="missing from the hash map"):
        pool.check_invariants()


def _cached_pool(num_blocks, num_cached):
    """A pool whose first `num_cached` blocks were cached (hashes b"h0", b"h1", ...) and freed
    in order, so they sit evictable at the back of the queue, oldest first."""
    pool = BlockPool(num_blocks)
    blocks = pool.allocate(num_cached)
    for i, block in enumerate(blocks):
        pool.cache_block(block, f"h{i}".encode())
    for block in blocks:
        pool.free([block])
    pool.check_invariants()
    return pool, blocks


def test_freed_cached_blocks_join_the_back_and_keep_their_hash():
    pool, blocks = _cached_pool(5, 2)
    assert list(pool.free_block_queue) == [2, 3, 4, *blocks]
    assert [pool.block_hashes[b] for b in blocks] == [b"h0", b"h1"]
    assert pool.get_cached_block(b"h1") == blocks[1]
    assert pool.num_free_blocks == 5  # evictable blocks count as free


def test_allocation_evicts_cached_blocks_only_after_uncached_ones_oldest_first():
    pool, blocks = _cached_pool(4, 2)
    assert pool.allocate(2) == [2, 3]
    assert pool.num_cached_blocks == 2
    assert pool.allocate(1) == [blocks[0]]  # the least recently freed cached block
    assert pool.get_cached_block(b"h0") is None and pool.block_hashes[blocks[0]] is None
    assert pool.get_cached_block(b"h1") == blocks[1]
    pool.check_invariants()


def test_touch_revives_an_evictable_block_and_shares_a_referenced_one():
    pool, blocks = _cached_pool(4, 1)
    pool.touch([blocks[0]])
    assert pool.ref_counts[blocks[0]] == 1 and blocks[0] not in pool.free_block_queue
    pool.touch([blocks[0]])
    assert pool.ref_counts[blocks[0]] == 2
    pool.check_invariants()
    pool.free([blocks[0], blocks[0]])
    assert list(pool.free_block_queue)[-1] == blocks[0]  # back to the LRU with its hash


def test_touch_of_an_uncached_block_is_a_bug():
    with pytest.raises(ValueError, match="uncached"):
        BlockPool(2).touch([0])


def test_recently_touched_blocks_are_evicted_last():
    pool, blocks = _cached_pool(3, 3)
    pool.touch([blocks[0]])
    pool.free([blocks[0]])  # now the most recently used
    assert pool.allocate(2) == blocks[1:]


def test_equal_hashes_on_several_blocks_are_kept_apart():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"same")
    pool.cache_block(b, b"same")
    pool.free([a, b])
    assert pool.get_cached_block(b"same") == a
    pool.allocate(2)  # the uncached block 2, then a
    assert pool.get_cached_block(b"same") == b
    pool.check_invariants()


def test_cache_block_requires_a_referenced_uncached_block():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="free block"):
        pool.cache_block(0, b"h")
    (block,) = pool.allocate(1)
    pool.cache_block(block, b"h")
    with pytest.raises(ValueError, match="already cached"):
        pool.cache_block(block, b"g")


def test_reset_prefix_cache_forgets_hashes_and_frees_evictable_blocks_first():
    pool, blocks = _cached_pool(4, 2)
    (held,) = pool.allocate(1)  # block 2
    pool.cache_block(held, b"held")
    pool.reset_prefix_cache()
    assert pool.block_hashes == [None] * 4 and pool.cached_blocks == {}
    assert pool.ref_counts[held] == 1
    assert set(list(pool.free_block_queue)[:2]) == set(blocks)
    pool.check_invariants()


def test_pool_needs_at_least_one_block():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
