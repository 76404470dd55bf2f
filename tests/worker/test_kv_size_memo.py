"""The remembered KV block count: reused while it fits, replaced when memory shrinks."""

from jaxpaged.worker.kv_size_memo import memo_key, remembered_num_blocks


def test_a_warm_start_that_measures_more_memory_reuses_the_cold_count(tmp_path):
    key = memo_key(model="m", max_num_seqs=8)
    assert remembered_num_blocks(str(tmp_path), key, 55242) == 55242  # cold: remembered
    assert remembered_num_blocks(str(tmp_path), key, 55468) == 55242  # warm: same shapes


def test_a_start_with_less_memory_takes_its_own_count_and_remembers_it(tmp_path):
    key = memo_key(model="m")
    remembered_num_blocks(str(tmp_path), key, 1000)
    assert remembered_num_blocks(str(tmp_path), key, 900) == 900  # never more than fits
    assert remembered_num_blocks(str(tmp_path), key, 950) == 900


def test_configurations_do_not_share_a_count_and_a_corrupt_memo_is_rewritten(tmp_path):
    a, b = memo_key(model="m", max_num_seqs=8), memo_key(model="m", max_num_seqs=16)
    assert a != b
    remembered_num_blocks(str(tmp_path), a, 100)
    assert remembered_num_blocks(str(tmp_path), b, 200) == 200
    (tmp_path / "kv_blocks" / f"{a}.json").write_text("not json")
    assert remembered_num_blocks(str(tmp_path), a, 300) == 300
    assert remembered_num_blocks(str(tmp_path), a, 400) == 300
