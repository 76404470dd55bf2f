"""The scheduler's multi-LoRA rule: at most ``max_loras`` distinct adapters run at once."""

from __future__ import annotations

from types import SimpleNamespace

from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.scheduler import Scheduler
from tests.core.test_scheduler import make_seq, step


def _scheduler(max_loras, num_blocks=64):
    config = SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=32)
    return Scheduler(config, KVCacheManager(num_blocks, 4), max_loras=max_loras)


def _seq(seq_id, lora_id, **kwargs):
    seq = make_seq(seq_id, **kwargs)
    seq.lora_request = None if lora_id == 0 else SimpleNamespace(lora_int_id=lora_id)
    return seq


def _running_loras(sched):
    return {g.seqs[0].lora_int_id for g in sched.running} - {0}


def test_waiting_request_over_the_limit_is_skipped_and_later_ones_go_first():
    sched = _scheduler(max_loras=2)
    for seq_id, lora in [("a", 1), ("b", 2), ("c", 3), ("d", 0), ("e", 1)]:
        sched.add_request(_seq(seq_id, lora, max_tokens=2))
    out = step(sched)
    # c's adapter would be a third: it waits; the base model (d) and adapter 1 (e) run.
    assert [s.seq.seq_id for s in out.scheduled] == ["a", "b", "d", "e"]
    assert [g.request_id for g in sched.waiting] == ["c"]
    step(sched)  # a, b, d, e finish (max_tokens=2)
    out = step(sched)
    assert [s.seq.seq_id for s in out.scheduled] == ["c"]


def test_distinct_adapters_never_exceed_max_loras_under_preemption():
    sched = _scheduler(max_loras=2, num_blocks=10)
    for i in range(12):
        sched.add_request(_seq(f"r{i}", i % 4, num_prompt_tokens=6, max_tokens=8))
    for _ in range(200):
        if not sched.has_unfinished:
            break
        out = step(sched)
        assert len({s.seq.lora_int_id for s in out.scheduled} - {0}) <= 2
        assert len(_running_loras(sched)) <= 2
    assert not sched.has_unfinished
    assert sched.num_preemptions > 0


def test_max_loras_zero_means_no_limit():
    sched = _scheduler(max_loras=0)
    for i in range(4):
        sched.add_request(_seq(f"r{i}", i + 1))
    assert len(step(sched).scheduled) == 4
