"""KVCacheSnapshot: the three block states, ref counts and tables, copied, not shared."""

from types import SimpleNamespace

from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.kv_cache_snapshot import CACHED, FREE, REFERENCED, take_snapshot
from jaxpaged.sequence import Sequence

PARAMS = SimpleNamespace(max_tokens=16, ignore_eos=False, stop_token_ids=None)


def _computed(kv, seq, num_tokens, hit=()):
    assert kv.allocate_slots(seq, num_tokens - seq.num_computed_tokens - 2 * len(hit), hit)
    seq.num_computed_tokens = num_tokens
    kv.cache_full_blocks(seq)


def test_states_ref_counts_and_sharing_follow_the_pool():
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_caching=True)
    a = Sequence("a", [1, 2, 3, 4, 5], PARAMS)
    _computed(kv, a, 5)  # blocks: [1,2] [3,4] [5]
    b = Sequence("b", [1, 2, 3, 4, 9], PARAMS)
    hit, _ = kv.get_computed_blocks(b)
    assert len(hit) == 2
    _computed(kv, b, 5, hit)
    c = Sequence("c", [7, 7, 7], PARAMS)
    _computed(kv, c, 3)
    kv.free(c)  # its full block stays cached (evictable), its partial block is free

    snap = take_snapshot(kv)
    assert snap.num_blocks == 8 and snap.block_size == 2
    table_a, table_b = snap.block_tables["a"], snap.block_tables["b"]
    assert table_a[:2] == table_b[:2] and table_a[2] != table_b[2]
    assert [snap.ref_counts[i] for i in table_a] == [2, 2, 1]
    assert snap.shared_blocks("a", "b") == 2 and snap.shared_blocks("a", "a") == 3
    assert (snap.count(REFERENCED), snap.count(CACHED), snap.count(FREE)) == (4, 1, 3)
    assert snap.count(REFERENCED) + snap.count(CACHED) + snap.count(FREE) == snap.num_blocks
    for block, state in enumerate(snap.block_states):
        assert (state == REFERENCED) == (snap.ref_counts[block] > 0)
        assert (state == CACHED) == (snap.ref_counts[block] == 0 and snap.hashed[block])


def test_a_snapshot_does_not_change_when_the_engine_moves_on():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = Sequence("a", [1, 2, 3], PARAMS)
    _computed(kv, a, 3)
    snap = take_snapshot(kv)
    kv.free(a)
    assert snap.block_tables == {"a": (0, 1)} and snap.count(REFERENCED) == 2
    assert take_snapshot(kv).count(REFERENCED) == 0
