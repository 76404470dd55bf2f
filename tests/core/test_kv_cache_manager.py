"""KVCacheManager: block tables grow with tokens, fail without side effects, free tail first."""

from types import SimpleNamespace

import pytest

from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.sequence import Sequence


def _seq(seq_id="a", num_prompt_tokens=5):
    params = SimpleNamespace(max_tokens=16, ignore_eos=False, stop_token_ids=None)
    return Sequence(seq_id, list(range(1, num_prompt_tokens + 1)), params)


@pytest.mark.parametrize(("tokens", "blocks"), [(0, 0), (1, 1), (3, 1), (4, 1), (5, 2), (8, 2)])
def test_num_blocks_needed_rounds_up_to_whole_blocks(tokens, blocks):
    assert KVCacheManager(num_blocks=8, block_size=4).num_blocks_needed(tokens) == blocks


def test_allocate_slots_covers_computed_plus_new_tokens():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    seq = _seq(num_prompt_tokens=10)
    assert kv.allocate_slots(seq, 6)  # chunk 0..5
    assert len(kv.get_block_table("a")) == 2
    seq.num_computed_tokens = 6
    assert kv.allocate_slots(seq, 4)  # chunk 6..9
    assert len(kv.get_block_table("a")) == 3
    kv.check_invariants([seq])


def test_allocate_slots_within_last_block_takes_no_new_block():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    seq = _seq(num_prompt_tokens=2)
    assert kv.allocate_slots(seq, 2)
    table = list(kv.get_block_table("a"))
    seq.num_computed_tokens = 2
    seq.append_token(9)
    assert kv.allocate_slots(seq, 1)
    assert kv.get_block_table("a") == table
    assert kv.num_free_blocks == 7


def test_table_is_append_only():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    seq = _seq(num_prompt_tokens=6)
    kv.allocate_slots(seq, 2)
    first = list(kv.get_block_table("a"))
    seq.num_computed_tokens = 2
    kv.allocate_slots(seq, 4)
    assert kv.get_block_table("a")[: len(first)] == first


def test_allocate_slots_returns_false_when_blocks_lack_and_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a, b = _seq("a", 8), _seq("b", 8)
    assert kv.allocate_slots(a, 8)
    assert not kv.can_allocate_slots(b, 8)
    assert not kv.allocate_slots(b, 8)
    assert "b" not in kv.block_tables
    assert kv.num_free_blocks == 1
    kv.check_invariants([a, b])


def test_free_releases_table_tail_first_and_forgets_it():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    seq = _seq(num_prompt_tokens=6)
    kv.allocate_slots(seq, 6)
    table = list(kv.get_block_table("a"))
    kv.free(seq)
    assert "a" not in kv.block_tables
    assert kv.get_block_table("a") == []
    # Tail freed first; each freed uncached block goes to the queue front, so the queue now
    # starts with the head block.
    assert list(kv.block_pool.free_block_queue)[:3] == table
    assert kv.num_free_blocks == 4
    kv.check_invariants([])


def test_free_without_table_is_a_no_op():
    kv = KVCacheManager(num_blocks=2, block_size=2)
    kv.free(_seq())
    assert kv.num_free_blocks == 2


def test_freed_table_list_is_left_intact_for_a_runner_still_reading_it():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    seq = _seq(num_prompt_tokens=4)
    kv.allocate_slots(seq, 4)
    table = kv.get_block_table("a")
    snapshot = list(table)
    kv.free(seq)
    assert table == snapshot


def test_usage_is_fraction_of_blocks_in_use():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.allocate_slots(_seq(num_prompt_tokens=3), 3)
    assert kv.usage == 0.5


def test_slots_stored_vs_held_reports_internal_fragmentation():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate_slots(_seq("a", 5), 5)  # 2 blocks, 5 of 8 slots used
    kv.allocate_slots(_seq("b", 4), 4)  # 1 block, full
    assert kv.slots_stored_vs_held() == (9, 12)


def test_check_invariants_catches_ref_count_mismatch():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    seq = _seq(num_prompt_tokens=2)
    kv.allocate_slots(seq, 2)
    kv.block_tables["ghost"] = list(kv.get_block_table("a"))  # a second holder, no incref
    with pytest.raises(AssertionError, match="ref count"):
        kv.check_invariants()


def test_check_invariants_catches_table_of_a_sequence_that_should_hold_none():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    seq = _seq(num_prompt_tokens=2)
    kv.allocate_slots(seq, 2)
    with pytest.raises(AssertionError, match="should hold none"):
        kv.check_invariants([])


def test_check_invariants_catches_table_that_lost_computed_tokens():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    seq = _seq(num_prompt_tokens=4)
    kv.allocate_slots(seq, 2)
    seq.num_computed_tokens = 4  # claims K/V for 4 tokens in a 1-block table
    with pytest.raises(AssertionError, match="num_held=1"):
        kv.check_invariants([seq])


def test_negative_new_tokens_is_a_bug():
    with pytest.raises(ValueError, match="non-negative"):
        KVCacheManager(num_blocks=2, block_size=2).allocate_slots(_seq(), -1)
