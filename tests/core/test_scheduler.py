"""Scheduler: token budget, chunked prefill, admission, recompute preemption, stop conditions.

Swap preemption, prefix caching, forks and beams: tests/core/test_scheduler_memory.py.
"""

import subprocess
import sys
from types import SimpleNamespace

import pytest

from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.scheduler import Scheduler
from jaxpaged.sequence import Sequence, SequenceStatus

EOS = 0


def make_scheduler(
    *,
    num_blocks=64,
    block_size=4,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    max_model_len=64,
    long_prefill_token_threshold=0,
):
    config = SimpleNamespace(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        long_prefill_token_threshold=long_prefill_token_threshold,
    )
    return Scheduler(config, KVCacheManager(num_blocks, block_size))


def make_seq(seq_id, num_prompt_tokens=4, **params):
    params = dict(max_tokens=100, ignore_eos=False, stop_token_ids=None, min_tokens=0) | params
    prompt = list(range(1, num_prompt_tokens + 1))
    return Sequence(seq_id, prompt, SimpleNamespace(**params), eos_token_id=EOS)


def step(sched, token=7):
    """One schedule + update with every sampling sequence getting `token`."""
    out = sched.schedule()
    sampled = {s.seq.seq_id: token for s in out.scheduled if s.do_sample}
    sched.update_from_output(out, sampled)
    sched.kv_cache_manager.check_invariants(sched.running_seqs(), sched.swapped_seqs())
    return out


def counts(out):
    return {s.seq.seq_id: s.num_new_tokens for s in out.scheduled}


def test_schedule_with_no_requests_is_empty():
    out = make_scheduler().schedule()
    assert out.is_empty and out.num_batched_tokens == 0
    assert out.blocks_to_swap_in == out.blocks_to_swap_out == out.blocks_to_copy == []


def test_new_request_prefills_whole_prompt_and_samples():
    sched = make_scheduler()
    seq = make_seq("a", 10)
    sched.add_request(seq)
    out = sched.schedule()
    (item,) = out.scheduled
    assert (item.num_computed_tokens, item.num_new_tokens, item.do_sample) == (0, 10, True)
    assert item.block_table == sched.kv_cache_manager.get_block_table("a")
    assert len(item.block_table) == 3
    produced = sched.update_from_output(out, {"a": 7})
    assert produced == [seq]
    assert seq.output_token_ids == [7] and seq.num_computed_tokens == 10
    assert not seq.is_prefill


def test_chunked_prefill_splits_long_prompt_across_steps():
    sched = make_scheduler(max_num_batched_tokens=4)
    seq = make_seq("a", 10)
    sched.add_request(seq)
    chunks = []
    for _ in range(3):
        out = step(sched)
        (item,) = out.scheduled
        chunks.append((item.num_computed_tokens, item.num_new_tokens, item.do_sample))
    assert chunks == [(0, 4, False), (4, 4, False), (8, 2, True)]
    assert seq.output_token_ids == [7]


def test_long_prefill_token_threshold_caps_one_prompt_per_step():
    sched = make_scheduler(max_num_batched_tokens=32, long_prefill_token_threshold=6)
    sched.add_request(make_seq("a", 20))
    sched.add_request(make_seq("b", 3))
    assert counts(sched.schedule()) == {"a": 6, "b": 3}


def test_token_budget_never_exceeded():
    sched = make_scheduler(max_num_batched_tokens=10, max_num_seqs=8)
    for i in range(6):
        sched.add_request(make_seq(f"s{i}", 7, max_tokens=5))
    while sched.has_unfinished:
        out = step(sched)
        assert 0 < out.num_batched_tokens <= 10
        assert out.num_batched_tokens == sum(counts(out).values())


def test_max_num_seqs_caps_running_set():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(4):
        sched.add_request(make_seq(f"s{i}", 2, max_tokens=3))
    out = step(sched)
    assert set(counts(out)) == {"s0", "s1"}
    assert (sched.num_running, sched.num_waiting) == (2, 2)
    while sched.has_unfinished:
        step(sched)
        assert sched.num_running <= 2


def test_decodes_scheduled_before_prefill_chunks():
    # "old" is still prefilling (threshold 3) while the newer "new" already decodes.
    sched = make_scheduler(max_num_batched_tokens=4, long_prefill_token_threshold=3)
    sched.add_request(make_seq("old", 12))
    sched.add_request(make_seq("new", 1))
    assert counts(step(sched)) == {"old": 3, "new": 1}
    out = step(sched)
    assert [s.seq.seq_id for s in out.scheduled] == ["new", "old"]
    assert [s.num_new_tokens for s in out.scheduled] == [1, 3]


def test_waiting_requests_are_admitted_first_come_first_served():
    sched = make_scheduler(max_num_batched_tokens=5)
    for seq_id in ("a", "b", "c"):
        sched.add_request(make_seq(seq_id, 3))
    assert counts(sched.schedule()) == {"a": 3, "b": 2}


def test_waiting_head_that_lacks_blocks_is_not_overtaken():
    # 4 blocks of 4: "a" holds 3, "b" needs 2 and waits; "c" would fit in 1 but must not skip.
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
    sched.add_request(make_seq("a", 12, max_tokens=1))
    sched.add_request(make_seq("b", 8))
    sched.add_request(make_seq("c", 2))
    assert counts(sched.schedule()) == {"a": 12}
    assert [g.request_id for g in sched.waiting] == ["b", "c"]


def test_preempts_newest_request_when_blocks_run_out():
    # 6 blocks of 2 tokens. Three 2-token prompts take a block each; as they decode each needs
    # a 2nd block (3 free: fine), then a 3rd: "a" and "b" get the last free ones, and "c", the
    # newest, is preempted when it asks.
    sched = make_scheduler(num_blocks=6, block_size=2, max_model_len=12)
    seqs = [make_seq(seq_id, 2) for seq_id in ("a", "b", "c")]
    for seq in seqs:
        sched.add_request(seq)
    for _ in range(3):  # prefill, decode (2nd block), decode
        out = step(sched)
        assert out.preempted_seq_ids == []
    assert sched.kv_cache_manager.num_free_blocks == 0
    out = step(sched)
    assert out.preempted_seq_ids == ["c"]
    assert set(counts(out)) == {"a", "b"}
    c = seqs[2]
    assert c.status is SequenceStatus.WAITING and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and sched.num_preemptions == 1
    assert [g.seqs for g in sched.waiting] == [[c]]
    assert "c" not in sched.kv_cache_manager.block_tables


def test_older_sequence_preempts_newer_one_not_itself():
    sched = make_scheduler(num_blocks=4, block_size=2, max_model_len=8)
    sched.add_request(make_seq("a", 4))  # 2 blocks
    sched.add_request(make_seq("b", 4))  # 2 blocks: cache full
    step(sched)
    out = step(sched)  # both decode at position 4: "a" needs a 3rd block and evicts "b"
    assert out.preempted_seq_ids == ["b"]
    assert counts(out) == {"a": 1}


def test_newer_decode_scheduled_this_step_is_taken_back_for_an_older_prefill_chunk():
    # "old" prefills in chunks of 2 (threshold); "new" decodes, is scheduled first (decodes
    # first), and is then preempted when "old" needs a block: it must leave the step again.
    sched = make_scheduler(
        num_blocks=4,
        block_size=2,
        max_model_len=8,
        max_num_batched_tokens=3,
        long_prefill_token_threshold=2,
    )
    sched.add_request(make_seq("old", 8, max_tokens=1))
    sched.add_request(make_seq("new", 1))
    assert counts(step(sched)) == {"old": 2, "new": 1}
    assert counts(step(sched)) == {"new": 1, "old": 2}  # 3 of the 4 blocks held
    out = step(sched)  # "new" takes the last block first, then "old" needs one more
    assert out.preempted_seq_ids == ["new"]
    assert counts(out) == {"old": 2}
    assert out.num_batched_tokens == 2


def test_newest_decode_preempting_itself_leaves_older_prefill_chunks_scheduled():
    # Decodes go first, so the newest sequence can run out of blocks before the older prefill
    # chunks are visited: it preempts itself, and the older sequence still runs this step.
    sched = make_scheduler(
        num_blocks=4,
        block_size=2,
        max_model_len=8,
        max_num_batched_tokens=4,
        long_prefill_token_threshold=3,
    )
    sched.add_request(make_seq("old", 8, max_tokens=1))
    sched.add_request(make_seq("new", 1))
    assert counts(step(sched)) == {"old": 3, "new": 1}
    assert counts(step(sched)) == {"new": 1, "old": 3}
    assert sched.kv_cache_manager.num_free_blocks == 0
    out = step(sched)
    assert out.preempted_seq_ids == ["new"]
    assert counts(out) == {"old": 2}


def test_no_admission_in_a_step_that_preempted():
    sched = make_scheduler(num_blocks=4, block_size=2, max_model_len=8)
    sched.add_request(make_seq("a", 4))
    sched.add_request(make_seq("b", 4))
    step(sched)
    sched.add_request(make_seq("late", 1))
    out = step(sched)
    assert out.preempted_seq_ids == ["b"]
    assert "late" not in counts(out)
    assert [g.request_id for g in sched.waiting] == ["b", "late"]


def test_preempted_sequence_recomputes_prompt_and_outputs_before_sampling_again():
    sched = make_scheduler(num_blocks=4, block_size=2, max_model_len=8)
    a = make_seq("a", 4, max_tokens=3)
    b = make_seq("b", 4, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, token=5)
    step(sched, token=5)  # b preempted holding outputs [5]
    assert b.status is SequenceStatus.WAITING and b.output_token_ids == [5]
    while a.status is SequenceStatus.RUNNING:
        step(sched, token=5)
    out = sched.schedule()
    (item,) = out.scheduled
    assert (item.seq, item.num_computed_tokens, item.num_new_tokens) == (b, 0, 5)
    assert item.do_sample  # all 5 tokens computed: sample the 2nd output
    sched.update_from_output(out, {"b": 6})
    assert b.output_token_ids == [5, 6]


def test_chunked_recompute_samples_only_after_last_chunk():
    sched = make_scheduler(num_blocks=4, block_size=2, max_model_len=8, max_num_batched_tokens=3)
    seq = make_seq("a", 3)
    sched.add_request(seq)
    step(sched)
    step(sched)  # 5 tokens, 4 computed
    assert sched.preempt("a") == "recompute"
    items = [step(sched).scheduled[0] for _ in range(2)]
    assert [(i.num_new_tokens, i.do_sample) for i in items] == [(3, False), (2, True)]


def test_eos_finishes_with_stop_and_frees_blocks():
    sched = make_scheduler()
    seq = make_seq("a", 4)
    sched.add_request(seq)
    produced = sched.update_from_output(sched.schedule(), {"a": EOS})
    assert produced == [seq]
    assert seq.status is SequenceStatus.FINISHED_STOPPED and seq.finish_reason == "stop"
    assert seq.stop_reason is None
    assert sched.kv_cache_manager.num_free_blocks == 64
    assert not sched.has_unfinished and sched.num_running == 0
    assert sched.schedule().is_empty


def test_ignore_eos_keeps_generating():
    sched = make_scheduler()
    seq = make_seq("a", 2, ignore_eos=True, max_tokens=2)
    sched.add_request(seq)
    step(sched, token=EOS)
    assert seq.status is SequenceStatus.RUNNING
    step(sched, token=EOS)
    assert seq.status is SequenceStatus.FINISHED_LENGTH


def test_eos_and_stop_tokens_ignored_before_min_tokens():
    sched = make_scheduler()
    seq = make_seq("a", 2, min_tokens=2, stop_token_ids=[9])
    sched.add_request(seq)
    step(sched, token=EOS)
    assert seq.status is SequenceStatus.RUNNING
    step(sched, token=9)
    assert seq.status is SequenceStatus.FINISHED_STOPPED and seq.stop_reason == 9


def test_stop_token_id_sets_stop_reason():
    sched = make_scheduler()
    seq = make_seq("a", 2, stop_token_ids=[3, 9])
    sched.add_request(seq)
    step(sched, token=9)
    assert (seq.finish_reason, seq.stop_reason, seq.output_token_ids) == ("stop", 9, [9])


def test_max_tokens_finishes_with_length():
    sched = make_scheduler()
    seq = make_seq("a", 2, max_tokens=3)
    sched.add_request(seq)
    for _ in range(3):
        step(sched)
    assert seq.finish_reason == "length" and seq.num_output_tokens == 3


def test_max_model_len_finishes_with_length():
    sched = make_scheduler(max_model_len=8, block_size=4, num_blocks=2)
    seq = make_seq("a", 6, max_tokens=None)
    sched.add_request(seq)
    step(sched)
    step(sched)
    assert seq.finish_reason == "length" and seq.num_tokens == 8


def test_stop_token_wins_over_length_on_the_same_token():
    sched = make_scheduler()
    seq = make_seq("a", 2, max_tokens=1)
    sched.add_request(seq)
    step(sched, token=EOS)
    assert seq.finish_reason == "stop"


def test_abort_running_and_waiting_frees_everything():
    sched = make_scheduler(max_num_seqs=1)
    a, b = make_seq("a", 4), make_seq("b", 4)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    assert sched.abort("a").seqs == [a] and sched.abort("b").seqs == [b]
    assert a.finish_reason == b.finish_reason == "abort"
    assert not sched.has_unfinished
    assert sched.kv_cache_manager.num_free_blocks == 64
    assert sched.abort("a") is None and sched.abort("nope") is None


def test_update_skips_sequence_aborted_after_schedule():
    sched = make_scheduler()
    sched.add_request(make_seq("a", 4))
    out = sched.schedule()
    (aborted,) = sched.abort("a").seqs
    assert sched.update_from_output(out, {"a": 7}) == []
    assert aborted.output_token_ids == [] and aborted.num_computed_tokens == 0


def test_finish_sequence_for_stop_string_sets_reason_and_frees_blocks():
    sched = make_scheduler()
    seq = make_seq("a", 4)
    sched.add_request(seq)
    step(sched)
    assert sched.finish_sequence("a", SequenceStatus.FINISHED_STOPPED, stop_reason="\n") is seq
    assert (seq.finish_reason, seq.stop_reason) == ("stop", "\n")
    assert sched.kv_cache_manager.num_free_blocks == 64 and sched.num_running == 0


def test_finish_sequence_requires_a_finished_status():
    with pytest.raises(ValueError, match="FINISHED"):
        make_scheduler().finish_sequence("a", SequenceStatus.RUNNING)


def test_add_request_rejects_prompt_longer_than_max_model_len():
    with pytest.raises(ValueError, match="prompt has 9 tokens; max_model_len is 8"):
        make_scheduler(max_model_len=8).add_request(make_seq("a", 9))


def test_add_request_rejects_duplicate_id():
    sched = make_scheduler()
    sched.add_request(make_seq("a"))
    with pytest.raises(ValueError, match="already"):
        sched.add_request(make_seq("a"))


def test_max_model_len_that_cannot_fit_the_cache_is_rejected():
    with pytest.raises(ValueError, match=r"max_model_len \(17\) needs 5 KV blocks"):
        make_scheduler(num_blocks=4, block_size=4, max_model_len=17)


def test_core_imports_no_jax():
    code = (
        "import sys, jaxpaged.core.scheduler, jaxpaged.core.kv_cache_manager, "
        "jaxpaged.core.block_pool, jaxpaged.sequence; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')); "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
