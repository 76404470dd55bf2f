"""KVCacheManager: block tables grow with tokens, fail without side effects, free tail first."""

from types import SimpleNamespace

import pytest

from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.sampling_params import SamplingParams
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


# ------------------------------------------------------------------ prefix caching, CoW, swap
def _computed(kv, seq, num_tokens):
    """Allocate and 'compute' the first num_tokens of seq, registering its full blocks."""
    assert kv.allocate_slots(seq, num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = num_tokens
    kv.cache_full_blocks(seq)


def test_cached_prefix_is_found_block_by_block_and_stops_at_the_first_miss():
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_caching=True)
    a = _seq("a", 7)  # tokens 1..7: 3 full blocks
    _computed(kv, a, 7)
    b = Sequence("b", [1, 2, 3, 4, 9, 9, 9], a.sampling_params)  # shares 2 blocks
    blocks, num_tokens = kv.get_computed_blocks(b)
    assert blocks == kv.get_block_table("a")[:2] and num_tokens == 4


def test_a_hit_never_covers_the_last_token():
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_caching=True)
    a = _seq("a", 6)
    _computed(kv, a, 6)
    b = _seq("b", 6)  # all 3 blocks cached, but the last token must be computed
    blocks, num_tokens = kv.get_computed_blocks(b)
    assert len(blocks) == 2 and num_tokens == 4


def test_extra_keys_separate_otherwise_equal_prefixes():
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_caching=True)
    a = _seq("a", 5)
    _computed(kv, a, 5)
    b = Sequence("b", list(range(1, 6)), a.sampling_params, block_hash_extra_keys=("lora", 1))
    assert kv.get_computed_blocks(b) == ([], 0)


def test_prompt_logprobs_requests_skip_cache_reads_but_still_fill_the_cache():
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_caching=True)
    a = _seq("a", 5)
    _computed(kv, a, 5)
    b = Sequence("b", list(range(1, 6)), SamplingParams(prompt_logprobs=0))
    assert b.skip_prefix_cache and kv.get_computed_blocks(b) == ([], 0)

    kv = KVCacheManager(num_blocks=8, block_size=2, enable_caching=True)
    b = Sequence("b", list(range(1, 6)), SamplingParams(prompt_logprobs=0))
    _computed(kv, b, 5)
    blocks, num_tokens = kv.get_computed_blocks(_seq("c", 5))
    assert blocks == kv.get_block_table("b")[:2] and num_tokens == 4


def test_allocating_with_hits_touches_them_and_counts_evictable_ones_as_taken():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_caching=True)
    a = _seq("a", 4)
    _computed(kv, a, 4)
    kv.free(a)  # both blocks evictable, cached
    b = _seq("b", 7)
    blocks, num_tokens = kv.get_computed_blocks(b)
    assert num_tokens == 4
    # 7 tokens need 4 blocks: 2 hits + 2 new; the hits leave the free queue, so 2 remain.
    assert kv.allocate_slots(b, 3, blocks)
    b.num_computed_tokens = 4
    assert kv.get_block_table("b")[:2] == blocks and kv.num_free_blocks == 0
    kv.check_invariants([b])
    c = _seq("c", 3)
    assert kv.get_computed_blocks(c)[1] == 2
    assert not kv.allocate_slots(c, 1, kv.get_computed_blocks(c)[0])  # 1 new block: none left


def test_hits_for_a_sequence_that_holds_blocks_are_a_bug():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_caching=True)
    seq = _seq("a", 4)
    kv.allocate_slots(seq, 2)
    with pytest.raises(ValueError, match="already holds blocks"):
        kv.allocate_slots(seq, 1, [3])


def test_blocks_are_cached_only_once_computed():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_caching=True)
    seq = _seq("a", 5)
    kv.allocate_slots(seq, 5)  # scheduled, not yet run
    assert kv.block_pool.num_cached_blocks == 0
    seq.num_computed_tokens = 3
    kv.cache_full_blocks(seq)
    assert kv.block_pool.num_cached_blocks == 1


def test_fork_shares_every_block_and_writing_a_shared_block_copies_it():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent = _seq("p", 6)  # blocks: [full, 2 of 4]
    _computed(kv, parent, 6)
    child = parent.fork("c")
    kv.fork(parent, child)
    table = kv.get_block_table("p")
    assert kv.get_block_table("c") == table
    assert [kv.block_pool.ref_counts[b] for b in table] == [2, 2]
    kv.check_invariants([parent, child])
    child.append_token(9)
    assert kv.num_new_blocks_needed(child, 1) == 1  # the copy
    old_child_table = kv.get_block_table("c")
    assert kv.allocate_slots(child, 1)
    new_table = kv.get_block_table("c")
    assert new_table[0] == table[0] and new_table[1] != table[1]
    assert old_child_table == table  # replaced, not mutated: a running step may hold it
    assert kv.take_block_ops() == ([], [], [(table[1], new_table[1])])
    parent.append_token(8)
    assert kv.allocate_slots(parent, 1)  # the last holder writes in place
    assert kv.get_block_table("p") == table
    assert kv.take_block_ops() == ([], [], [])
    kv.check_invariants([parent, child])


def test_a_copy_whose_destination_is_freed_before_the_step_is_dropped():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent = _seq("p", 6)
    _computed(kv, parent, 6)
    child = parent.fork("c")
    kv.fork(parent, child)
    child.append_token(9)
    kv.allocate_slots(child, 1)
    kv.free(child)
    assert kv.take_block_ops() == ([], [], [])


def test_swap_out_and_in_keep_shared_blocks_shared_and_record_the_moves():
    kv = KVCacheManager(num_blocks=8, block_size=4, num_cpu_blocks=4)
    parent = _seq("p", 6)
    _computed(kv, parent, 6)
    child = parent.fork("c")
    kv.fork(parent, child)
    device_table = kv.get_block_table("p")
    assert kv.can_swap_out([parent, child])
    kv.swap_out([parent, child])
    assert kv.block_tables == {} and kv.num_free_blocks == 8
    host = kv.cpu_block_tables
    assert host["p"] == host["c"] and len(host["p"]) == 2
    assert kv.cpu_block_pool.ref_counts[host["p"][0]] == 2
    swap_in, swap_out, copies = kv.take_block_ops()
    assert sorted(swap_out) == sorted(zip(device_table, host["p"], strict=True))
    kv.check_invariants([], [parent, child])
    assert kv.can_swap_in([parent, child], num_extra_blocks=6)
    assert not kv.can_swap_in([parent, child], num_extra_blocks=7)
    host_table = list(host["p"])
    kv.swap_in([parent, child])
    assert kv.cpu_block_tables == {} and kv.num_free_cpu_blocks == 4
    new_table = kv.get_block_table("p")
    assert kv.get_block_table("c") == new_table
    swap_in, swap_out, copies = kv.take_block_ops()
    assert sorted(swap_in) == sorted(zip(host_table, new_table, strict=True))
    kv.check_invariants([parent, child], [])


def test_swap_out_saves_only_computed_blocks_and_needs_host_room():
    kv = KVCacheManager(num_blocks=8, block_size=2, num_cpu_blocks=1)
    seq = _seq("a", 4)
    kv.allocate_slots(seq, 4)  # 2 blocks allocated, 1 computed
    seq.num_computed_tokens = 2
    assert kv.can_swap_out([seq])
    kv.swap_out([seq])
    assert len(kv.cpu_block_tables["a"]) == 1
    other = _seq("b", 2)
    _computed(kv, other, 2)
    assert not kv.can_swap_out([other])  # the only host block is taken
    assert not KVCacheManager(num_blocks=2, block_size=2).can_swap_out([other])


def test_free_releases_host_blocks_of_a_swapped_sequence():
    kv = KVCacheManager(num_blocks=4, block_size=2, num_cpu_blocks=4)
    seq = _seq("a", 4)
    _computed(kv, seq, 4)
    kv.swap_out([seq])
    kv.free(seq)
    assert kv.num_free_cpu_blocks == 4 and kv.cpu_block_tables == {}
    assert kv.take_block_ops() == ([], [], [])  # its pending swap-out is dropped too


def test_reset_prefix_cache_forgets_cached_prefixes():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_caching=True)
    a = _seq("a", 5)
    _computed(kv, a, 5)
    kv.reset_prefix_cache()
    assert kv.get_computed_blocks(_seq("b", 5)) == ([], 0)
    a.num_computed_tokens = 5
    kv.cache_full_blocks(a)  # blocks still held are registered again as they are reported
    assert kv.block_pool.num_cached_blocks == 2
