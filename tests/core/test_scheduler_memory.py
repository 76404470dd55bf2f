"""Scheduler memory management: prefix caching, swap preemption, forks (n / best_of) and beams,
abort from every state, stats. Runs on the fake worker (tests/core/fake_worker.py)."""

from types import SimpleNamespace

import pytest

from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.scheduler import Scheduler
from jaxpaged.sequence import Sequence, SequenceGroup, SequenceStatus, derive_seed
from tests.core.fake_worker import FakeWorker, next_token

EOS = 0


def make(
    *,
    num_blocks=64,
    block_size=4,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    max_model_len=64,
    long_prefill_token_threshold=0,
    preemption_mode=None,
    enable_caching=False,
    num_cpu_blocks=0,
):
    config = SimpleNamespace(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        long_prefill_token_threshold=long_prefill_token_threshold,
        preemption_mode=preemption_mode,
    )
    kv = KVCacheManager(
        num_blocks, block_size, enable_caching=enable_caching, num_cpu_blocks=num_cpu_blocks
    )
    sched = Scheduler(config, kv)
    return sched, FakeWorker(kv)


def request(request_id, prompt, *, best_of=1, beam_width=0, seed=0, **params):
    params = SimpleNamespace(
        **(
            dict(
                max_tokens=100,
                ignore_eos=True,
                stop_token_ids=None,
                min_tokens=0,
                length_penalty=1.0,
            )
            | params
        )
    )
    seq = Sequence(request_id, list(prompt), params, eos_token_id=EOS)
    seq.sampling_seed = seed
    return SequenceGroup(
        request_id, seq, best_of=best_of, beam_width=beam_width, beam_params=params
    )


def run(sched, worker, max_steps=500):
    """Step until nothing is unfinished; returns the scheduler outputs."""
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished:
            return outs
        out, _ = worker.step(sched)
        sched.kv_cache_manager.check_invariants(sched.running_seqs(), sched.swapped_seqs())
        outs.append(out)
    raise AssertionError("requests never finished")


def expected_outputs(prompt, max_tokens, seed=0):
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens, seed))
    return tokens[len(prompt) :]


def computed_tokens(outs, request_id):
    return sum(
        item.num_new_tokens
        for out in outs
        for item in out.scheduled
        if item.seq.seq_id == request_id
    )


# ------------------------------------------------------------------------------ prefix caching
def test_second_identical_prompt_computes_only_its_uncached_tail():
    sched, worker = make(enable_caching=True)
    prompt = list(range(1, 15))  # 14 tokens: 3 full blocks of 4, then 2
    first = request("a", prompt, max_tokens=3)
    sched.add_request(first)
    outs = run(sched, worker)
    assert computed_tokens(outs, "a") == 14 + 2  # prompt + 2 decodes
    second = request("b", prompt, max_tokens=3)
    sched.add_request(second)
    outs = run(sched, worker)
    assert second.num_cached_tokens == 12
    assert computed_tokens(outs, "b") == 2 + 2
    assert second.seqs[0].output_token_ids == first.seqs[0].output_token_ids
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (28, 12)


def test_full_prefix_hit_still_computes_the_last_block():
    # 12 tokens = exactly 3 cached blocks; the last token needs logits and its slot sits in a
    # cached block, so the whole last block is computed again (vLLM's rule).
    sched, worker = make(enable_caching=True)
    prompt = list(range(1, 13))
    sched.add_request(request("a", prompt, max_tokens=1))
    run(sched, worker)
    group = request("b", prompt, max_tokens=1)
    sched.add_request(group)
    out = sched.schedule()
    (item,) = out.scheduled
    assert (item.num_computed_tokens, item.num_new_tokens) == (8, 4)
    assert group.num_cached_tokens == 8


def test_prefix_cache_off_shares_nothing():
    sched, worker = make(enable_caching=False)
    sched.add_request(request("a", range(1, 13), max_tokens=1))
    run(sched, worker)
    group = request("b", range(1, 13), max_tokens=1)
    sched.add_request(group)
    (item,) = sched.schedule().scheduled
    assert item.num_computed_tokens == 0 and group.num_cached_tokens == 0


def test_blocks_freed_by_a_finished_request_stay_cached_until_evicted():
    sched, worker = make(enable_caching=True, num_blocks=4, max_model_len=16)
    sched.add_request(request("a", range(1, 10), max_tokens=1))  # 2 full blocks cached
    run(sched, worker)
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == 4 and kv.block_pool.num_cached_blocks == 2
    sched.add_request(request("b", [9] * 13, max_tokens=1))  # needs all 4 blocks: evicts
    run(sched, worker)
    group = request("c", range(1, 10), max_tokens=1)
    sched.add_request(group)
    run(sched, worker)
    assert group.num_cached_tokens == 0


def test_recompute_after_preemption_reuses_its_own_cached_blocks():
    sched, worker = make(enable_caching=True, num_blocks=5, max_model_len=16, block_size=4)
    a = request("a", range(1, 9), max_tokens=6)
    b = request("b", range(20, 28), max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    outs = run(sched, worker)
    assert sched.num_preemptions_by_mode["recompute"] > 0
    recomputed = [
        item
        for out in outs
        for item in out.scheduled
        if item.seq.seq_id == "b" and item.seq.num_preemptions and item.num_computed_tokens
    ]
    assert recomputed, "the re-admitted request started from its cached blocks"
    for group, prompt in ((a, range(1, 9)), (b, range(20, 28))):
        assert group.seqs[0].output_token_ids == expected_outputs(prompt, 6)


# ------------------------------------------------------------------------------ swap
def test_swap_preemption_resumes_with_outputs_of_ample_memory_and_frees_host_blocks():
    sched, worker = make(
        num_blocks=6, block_size=2, max_model_len=12, preemption_mode="swap", num_cpu_blocks=8
    )
    groups = [request(r, [i + 1, 2, 3], max_tokens=7) for i, r in enumerate("abc")]
    for group in groups:
        sched.add_request(group)
    outs = run(sched, worker)
    assert sched.num_preemptions_by_mode == {"recompute": 0, "swap": sched.num_preemptions}
    assert sched.num_preemptions > 0
    assert any(out.blocks_to_swap_out for out in outs) and any(
        out.blocks_to_swap_in for out in outs
    )
    for i, group in enumerate(groups):
        assert group.seqs[0].output_token_ids == expected_outputs([i + 1, 2, 3], 7)
    kv = sched.kv_cache_manager
    assert kv.num_free_cpu_blocks == 8 and kv.num_free_blocks == 6


def test_swap_keeps_computed_tokens_and_swapped_requests_resume_before_new_ones():
    sched, worker = make(
        num_blocks=4, block_size=2, max_model_len=8, preemption_mode="swap", num_cpu_blocks=4
    )
    a, b = request("a", [1, 2, 3, 4], max_tokens=3), request("b", [5, 6, 7, 8], max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    worker.step(sched)
    out, _ = worker.step(sched)  # "a" needs a 3rd block: "b" is swapped out
    assert out.preempted_seq_ids == ["b"] and out.blocks_to_swap_out
    (b_seq,) = b.seqs
    assert b_seq.status is SequenceStatus.SWAPPED and b_seq.num_computed_tokens == 4
    late = request("late", [9])
    sched.add_request(late)
    while a.seqs[0].status is SequenceStatus.RUNNING:
        out, _ = worker.step(sched)
        assert "late" not in {item.seq.seq_id for item in out.scheduled}
    out, _ = worker.step(sched)
    assert out.blocks_to_swap_in
    resumed = out.scheduled[0]
    assert resumed.seq.seq_id == "b" and resumed.num_computed_tokens == 4  # nothing recomputed


def test_swap_falls_back_to_recompute_when_the_host_lacks_room():
    sched, worker = make(
        num_blocks=4, block_size=2, max_model_len=8, preemption_mode="swap", num_cpu_blocks=1
    )
    sched.add_request(request("a", [1, 2, 3, 4], max_tokens=3))
    sched.add_request(request("b", [5, 6, 7, 8], max_tokens=3))
    run(sched, worker)
    assert sched.num_preemptions_by_mode["swap"] == 0
    assert sched.num_preemptions_by_mode["recompute"] > 0


@pytest.mark.parametrize(
    ("mode", "best_of", "expected"),
    [
        (None, 1, "recompute"),
        (None, 2, "swap"),
        ("recompute", 2, "recompute"),
        ("swap", 1, "swap"),
    ],
)
def test_preemption_mode_follows_vllm_rule_or_the_setting(mode, best_of, expected):
    sched, worker = make(preemption_mode=mode, num_cpu_blocks=16)
    sched.add_request(request("a", [1, 2, 3], best_of=best_of, seed=1))
    worker.step(sched)
    worker.step(sched)
    assert sched.preempt("a") == expected


def test_swapped_out_group_that_copied_on_write_this_step_saves_the_source_block():
    # The beams of "new" share their last block after forking. In the next step they decode
    # first (decodes before prefill chunks): one copies the shared block on write. Then the
    # older "old" needs a block for its next prefill chunk and swaps "new" out in the same
    # step, before the copy has run: the copy's source must be saved in the copy's place.
    sched, worker = make(
        num_blocks=3,
        block_size=4,
        max_model_len=12,
        max_num_batched_tokens=8,
        long_prefill_token_threshold=4,
        num_cpu_blocks=4,
    )
    old = request("old", range(1, 12), max_tokens=1)
    new = request("new", [5, 6], beam_width=2, max_tokens=3)
    sched.add_request(old)
    sched.add_request(new)
    worker.step(sched)  # old: 4 tokens; new: its prompt, then the beams fork
    out, _ = worker.step(sched)
    assert out.blocks_to_copy == [] and out.preempted_seq_ids  # the copy was dropped
    assert {seq.status for seq in new.unfinished_seqs} == {SequenceStatus.SWAPPED}
    (host_table,) = {tuple(t) for t in sched.kv_cache_manager.cpu_block_tables.values()}
    assert len(host_table) == 1  # both beams share one saved block
    run(sched, worker)
    width = new.beam_width
    assert len(new.seqs) == width
    assert all(seq.num_output_tokens == 3 for seq in new.seqs)


# ------------------------------------------------------------------------------ forks
def test_parallel_samples_fork_after_the_prompt_and_hold_the_prompt_blocks_once():
    sched, worker = make(block_size=4)
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks, then 2 in a 3rd
    group = request("a", prompt, best_of=4, seed=7, max_tokens=5)
    sched.add_request(group)
    out, _ = worker.step(sched)
    (item,) = out.scheduled
    assert (item.num_new_tokens, item.do_sample) == (9, False)  # all but the last token
    out, _ = worker.step(sched)  # fork: each sample computes the last token itself
    assert [item.num_new_tokens for item in out.scheduled] == [1] * 4
    assert all(item.do_sample for item in out.scheduled)
    assert len(out.blocks_to_copy) == 3  # the shared partly filled block, copied on write
    kv = sched.kv_cache_manager
    assert kv.num_blocks - kv.num_free_blocks == 2 + 4  # full prompt blocks once, 4 tails
    tables = [kv.get_block_table(seq.seq_id) for seq in group.seqs]
    assert len({tuple(t[:2]) for t in tables}) == 1 and len({t[2] for t in tables}) == 4
    run(sched, worker)
    seeds = [derive_seed(7, i) for i in range(4)]
    assert [seq.sampling_seed for seq in group.seqs] == seeds
    assert [seq.output_token_ids for seq in group.seqs] == [
        expected_outputs(prompt, 5, seed) for seed in seeds
    ]


def test_fork_of_a_one_token_prompt_starts_every_sample_from_scratch():
    sched, worker = make()
    group = request("a", [3], best_of=3, seed=1, max_tokens=2)
    sched.add_request(group)
    out, _ = worker.step(sched)
    assert [item.num_new_tokens for item in out.scheduled] == [1, 1, 1]
    assert out.blocks_to_copy == []
    run(sched, worker)
    assert [s.output_token_ids for s in group.seqs] == [
        expected_outputs([3], 2, derive_seed(1, i)) for i in range(3)
    ]


def test_group_seats_count_against_max_num_seqs():
    sched, worker = make(max_num_seqs=4)
    sched.add_request(request("a", [1, 2], best_of=3))
    sched.add_request(request("b", [1, 2], best_of=2))
    out = sched.schedule()
    assert {item.seq.seq_id for item in out.scheduled} == {"a"}
    with pytest.raises(ValueError, match="max_num_seqs is 4"):
        sched.add_request(request("c", [1], best_of=5))


def test_group_that_outgrows_the_whole_cache_is_ignored_not_preempted_forever(caplog):
    sched, worker = make(num_blocks=4, block_size=2, max_model_len=8, num_cpu_blocks=16)
    group = request("a", [1, 2], best_of=4, max_tokens=6)
    sched.add_request(group)
    with caplog.at_level("WARNING", logger="jaxpaged.core.scheduler"):
        run(sched, worker)
    assert {seq.status for seq in group.seqs} == {SequenceStatus.FINISHED_IGNORED}
    # The user is told why, as vLLM warns for requests it can never schedule.
    assert "Request a has 4 sequences" in caplog.text and "4 the cache holds" in caplog.text
    assert {seq.finish_reason for seq in group.seqs} == {"length"}
    assert sched.kv_cache_manager.num_free_blocks == 4


# ------------------------------------------------------------------------------ abort
def _blocks_all_free(sched):
    kv = sched.kv_cache_manager
    kv.check_invariants([], [])
    return kv.num_free_blocks == kv.num_blocks and kv.num_free_cpu_blocks == kv.num_cpu_blocks


@pytest.mark.parametrize("state", ["waiting", "running", "swapped", "chunked_prefill", "forked"])
def test_abort_from_any_state_frees_everything_at_once(state):
    sched, worker = make(
        num_blocks=4,
        block_size=2,
        max_model_len=8,
        max_num_batched_tokens=4,
        preemption_mode="swap",
        num_cpu_blocks=8,
    )
    best_of = 3 if state == "forked" else 1
    group = request(
        "a", [1, 2, 3, 4, 5, 6] if state == "chunked_prefill" else [1, 2], best_of=best_of
    )
    other = request("b", [7, 8, 9])
    sched.add_request(other)
    sched.add_request(group)
    if state != "waiting":
        worker.step(sched)
    if state == "swapped":
        assert sched.preempt("a") == "swap"
    if state == "forked":
        worker.step(sched)
        assert len(group.seqs) == 3
    if state == "chunked_prefill":
        assert 0 < group.seqs[0].num_computed_tokens < 6
    assert sched.abort("a") is group
    assert {seq.status for seq in group.seqs} == {SequenceStatus.FINISHED_ABORTED}
    assert "a" not in sched.requests
    sched.abort("b")
    sched.schedule()  # a pending swap-out of the aborted request is dropped, not run
    assert _blocks_all_free(sched)


def test_update_skips_every_sequence_of_a_group_aborted_after_schedule():
    sched, worker = make()
    group = request("a", [1, 2, 3], best_of=2, seed=3)
    sched.add_request(group)
    worker.step(sched)
    out = sched.schedule()
    worker.run_block_ops(out)
    sampled, _ = worker.run_model(out)
    sched.abort("a")
    assert sched.update_from_output(out, sampled) == []
    assert all(seq.num_output_tokens == 0 for seq in group.seqs)


# ------------------------------------------------------------------------------ stats
def test_stats_report_queues_usage_preemptions_and_cache_counters():
    sched, worker = make(
        num_blocks=4,
        block_size=2,
        max_model_len=8,
        num_cpu_blocks=8,
        enable_caching=True,
        preemption_mode="swap",
    )
    sched.add_request(request("a", [1, 2, 3, 4], max_tokens=3))
    sched.add_request(request("b", [5, 6, 7, 8], max_tokens=3))
    sched.add_request(request("c", [9]))
    worker.step(sched)
    stats = sched.get_stats()
    assert (stats.num_requests_running, stats.num_requests_waiting) == (2, 1)
    assert stats.kv_cache_usage_perc == stats.gpu_cache_usage_perc == 1.0
    assert (stats.kv_cache_tokens_stored, stats.kv_cache_slots_held) == (8, 8)
    assert stats.kv_cache_fragmentation == 0.0
    worker.step(sched)
    stats = sched.get_stats()
    assert stats.num_requests_swapped == 1 and stats.cpu_cache_usage_perc == 2 / 8
    assert (stats.num_preemptions, stats.num_preemptions_swap) == (1, 1)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (8, 0)
    assert (stats.num_gpu_blocks, stats.num_cpu_blocks) == (4, 8)
