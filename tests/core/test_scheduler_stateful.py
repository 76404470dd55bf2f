"""Random add / step / abort / preempt sequences against a fake model with a fake paged KV cache.

The fake model writes each scheduled token into its slot (through the block table) and samples
a deterministic function of the tokens it reads back through the block table. The fake worker
executes the step's block moves (swap-out, swap-in, copies) on a fake device cache and a fake
host cache first. So a block given to two sequences, freed too early, shared without
copy-on-write, swapped wrongly, reused from the prefix cache with other contents or mapped wrongly
changes the outputs, and every finished request must produce exactly what it would with ample
memory, however often preemption (recompute or swap) moved or threw away its K/V.

Requests are single samples, parallel samples (`best_of` forks with their own seed streams) and
beam searches (candidates from a fake log-probability table), compared with plain references.
"""

from types import SimpleNamespace

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.scheduler import Scheduler
from jaxpaged.engine.group_outputs import ranked_completions
from jaxpaged.sequence import Sequence, SequenceGroup, SequenceStatus, derive_seed
from tests.core.fake_worker import VOCAB, FakeWorker, candidates, next_token

EOS = 0
MAX_MODEL_LEN = 16


def reference_generation(prompt, params, eos_token_id, seed=0):
    """What a sample produces with ample memory: (outputs, finish_reason, stop_reason)."""
    tokens, outputs = list(prompt), []
    while True:
        token = next_token(tokens, seed)
        tokens.append(token)
        outputs.append(token)
        if len(outputs) >= params.min_tokens:
            if not params.ignore_eos and token == eos_token_id:
                return outputs, "stop", None
            if token in (params.stop_token_ids or ()):
                return outputs, "stop", token
        if params.max_tokens is not None and len(outputs) >= params.max_tokens:
            return outputs, "length", None
        if len(tokens) >= MAX_MODEL_LEN:
            return outputs, "length", None


def reference_beam_search(prompt, width, max_tokens, ignore_eos, length_penalty):
    """vLLM's beam search on the fake model: best `width` (tokens, cum_logprob), best first."""
    beams, completed = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        live = []
        for tokens, cum in beams:
            for token, logprob in candidates(tokens)[: 2 * width]:
                new = (tokens + [token], cum + logprob)
                (completed if token == EOS and not ignore_eos else live).append(new)
        live.sort(key=lambda beam: beam[1], reverse=True)
        beams = live[:width]
        if len(beams[0][0]) >= MAX_MODEL_LEN:
            break

    def score(beam):
        tokens, cum = beam
        length = len(tokens) - (1 if tokens[-1] == EOS and not ignore_eos else 0)
        return cum / length**length_penalty

    return sorted(completed + beams, key=score, reverse=True)[:width]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        extra_blocks=st.integers(0, 6),
        max_num_seqs=st.integers(1, 4),
        extra_batched_tokens=st.integers(0, 8),
        long_prefill_token_threshold=st.sampled_from([0, 0, 3]),
        enable_caching=st.booleans(),
        num_cpu_blocks=st.sampled_from([0, 3, 8, 64]),
        preemption_mode=st.sampled_from([None, None, "recompute", "swap"]),
    )
    def setup(
        self,
        block_size,
        extra_blocks,
        max_num_seqs,
        extra_batched_tokens,
        long_prefill_token_threshold,
        enable_caching,
        num_cpu_blocks,
        preemption_mode,
    ):
        # Just enough blocks for one sequence at max_model_len, plus a few: forces preemption.
        num_blocks = -(-MAX_MODEL_LEN // block_size) + extra_blocks
        self.kv = KVCacheManager(
            num_blocks, block_size, enable_caching=enable_caching, num_cpu_blocks=num_cpu_blocks
        )
        self.config = SimpleNamespace(
            max_num_seqs=max_num_seqs,
            # The engine's rule: every running sequence can decode in one step.
            max_num_batched_tokens=max_num_seqs + extra_batched_tokens,
            max_model_len=MAX_MODEL_LEN,
            long_prefill_token_threshold=long_prefill_token_threshold,
            preemption_mode=preemption_mode,
        )
        self.sched = Scheduler(self.config, self.kv)
        self.worker = FakeWorker(self.kv)
        self.groups: list[SequenceGroup] = []
        self.num_steps = 0

    @rule(
        prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
        max_tokens=st.one_of(st.none(), st.integers(1, 8)),
        min_tokens=st.integers(0, 3),
        ignore_eos=st.booleans(),
        stop_token_ids=st.one_of(st.none(), st.lists(st.integers(0, VOCAB - 1), max_size=2)),
        kind=st.sampled_from(["single", "single", "single", "fork", "fork", "beam"]),
        width=st.integers(2, 3),
        seed=st.integers(0, 2**20),
        length_penalty=st.sampled_from([0.0, 1.0, 2.0]),
        shared_prefix=st.booleans(),
    )
    def add(
        self,
        prompt,
        max_tokens,
        min_tokens,
        ignore_eos,
        stop_token_ids,
        kind,
        width,
        seed,
        length_penalty,
        shared_prefix,
    ):
        if shared_prefix and self.groups:  # reuse an earlier prompt's start: prefix-cache hits
            earlier = self.groups[-1].seqs[0].prompt_token_ids
            prompt = (earlier + prompt)[: max(len(earlier), 12)]
        if max_tokens is not None:
            min_tokens = min(min_tokens, max_tokens)
        width = min(width, self.config.max_num_seqs)
        if kind != "single" and width < 2:
            kind = "single"
        params = SimpleNamespace(
            max_tokens=max_tokens if kind != "beam" else (max_tokens or 4),
            min_tokens=min_tokens,
            ignore_eos=ignore_eos,
            stop_token_ids=stop_token_ids,
            length_penalty=length_penalty,
        )
        request_id = f"r{len(self.groups)}"
        seq = Sequence(request_id, prompt, params, eos_token_id=EOS)
        seq.sampling_seed = seed
        if kind == "beam":
            group = SequenceGroup(request_id, seq, beam_width=width, beam_params=params)
        else:
            group = SequenceGroup(request_id, seq, best_of=width if kind == "fork" else 1)
        self.groups.append(group)
        self.sched.add_request(group)

    @rule()
    def step(self):
        had_unfinished = self.sched.has_unfinished
        out = self.sched.schedule()
        self.check_output(out)
        # Liveness: while anything is unfinished, every step makes progress somewhere (or ends
        # a group that can never fit, which the next update reports).
        ignored = self.sched._finished_while_scheduling
        assert out.is_empty != had_unfinished or ignored, (had_unfinished, out)
        self.run_block_ops(out)
        sampled, beams = self.run_fake_model(out)
        produced = self.sched.update_from_output(out, sampled, beam_candidates=beams)
        non_beam = {s.seq_id for s in produced if not s.group.is_beam_search}
        assert set(sampled) - set(beams) <= non_beam | {s.seq_id for s in ignored}
        self.num_steps += 1

    @precondition(lambda self: self.sched.has_unfinished)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.sched.requests)))
        unfinished = self.sched.requests[request_id].unfinished_seqs
        group = self.sched.abort(request_id)
        assert group is not None and group.is_finished
        assert all(seq.status is SequenceStatus.FINISHED_ABORTED for seq in unfinished)

    @precondition(lambda self: self.sched.running)
    @rule(data=st.data())
    def preempt(self, data):
        request_id = data.draw(st.sampled_from([g.request_id for g in self.sched.running]))
        mode = self.sched.preempt(request_id)
        group = self.sched.requests[request_id]
        expected = SequenceStatus.SWAPPED if mode == "swap" else SequenceStatus.WAITING
        assert all(seq.status is expected for seq in group.unfinished_seqs)

    @invariant()
    def blocks_are_consistent(self):
        sched = self.sched
        self.kv.check_invariants(sched.running_seqs(), sched.swapped_seqs())
        assert all(s.status is SequenceStatus.RUNNING for s in sched.running_seqs())
        assert all(s.status is SequenceStatus.SWAPPED for s in sched.swapped_seqs())
        for group in sched.waiting:
            for seq in group.unfinished_seqs:
                assert seq.status is SequenceStatus.WAITING and seq.num_computed_tokens == 0
        assert sum(g.num_seats for g in sched.running) <= self.config.max_num_seqs
        unfinished = {g.request_id for g in self.groups if not g.is_finished}
        assert set(sched.requests) == unfinished
        assert len(sched.running) + len(sched.waiting) + len(sched.swapped) == len(unfinished)

    def check_output(self, out):
        ids = [s.seq.seq_id for s in out.scheduled]
        assert len(ids) == len(set(ids))
        assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
        assert out.num_batched_tokens <= self.config.max_num_batched_tokens
        assert len(out.scheduled) <= self.config.max_num_seqs
        prefill_flags = [s.seq.is_prefill for s in out.scheduled]
        assert prefill_flags == sorted(prefill_flags), "decodes must come first"
        by_group = {}
        for item in out.scheduled:
            seq = item.seq
            assert seq.status is SequenceStatus.RUNNING
            assert item.num_computed_tokens == seq.num_computed_tokens
            end = item.num_computed_tokens + item.num_new_tokens
            assert item.num_new_tokens >= 1 and end <= seq.num_tokens
            assert item.do_sample == (end == seq.num_tokens)
            assert len(item.block_table) == self.kv.num_blocks_needed(end)
            by_group.setdefault(seq.group.request_id, []).append(item)
        for request_id, items in by_group.items():
            group = self.sched.requests[request_id]
            if len(group.unfinished_seqs) > 1 and any(item.do_sample for item in items):
                # Sequences of a group sample in step: all of them or none.
                assert all(item.do_sample for item in items)
                assert len(items) == len(group.unfinished_seqs)
        # A copy's destination is private to one table and its source still held.
        for src, dst in out.blocks_to_copy:
            assert self.kv.block_pool.ref_counts[dst] == 1 and src != dst

    def run_block_ops(self, out):
        self.worker.run_block_ops(out)

    def run_fake_model(self, out):
        sampled, beams = self.worker.run_model(out)
        assert out.num_beam_candidates == (
            2 * max((s.seq.group.beam_width for s in out.scheduled if s.do_sample), default=0)
        )
        return sampled, beams

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(3000):
            if not self.sched.has_unfinished:
                break
            self.step()
            self.blocks_are_consistent()
        assert not self.sched.has_unfinished, "requests never finished"
        # free + evictable cached == total, on the device; every host block free.
        assert self.kv.num_free_blocks == self.kv.num_blocks
        assert self.kv.num_free_cpu_blocks == self.kv.num_cpu_blocks
        assert self.kv.block_tables == {} and self.kv.cpu_block_tables == {}
        self.kv.check_invariants([], [])
        for group in self.groups:
            self.check_group_result(group)

    def check_group_result(self, group):
        statuses = {seq.status for seq in group.seqs}
        cut_short = statuses & {SequenceStatus.FINISHED_ABORTED, SequenceStatus.FINISHED_IGNORED}
        parent = group.seqs[0]
        params = parent.sampling_params
        if group.is_beam_search:
            if cut_short:
                return
            expected = reference_beam_search(
                parent.prompt_token_ids,
                group.beam_width,
                params.max_tokens,
                params.ignore_eos,
                params.length_penalty,
            )
            got = [(s.token_ids, s.cumulative_logprob) for s in ranked_completions(group)]
            assert got == expected, group
            return
        seeds = [derive_seed(parent.sampling_seed, i) for i in range(len(group.seqs))]
        for seq, seed in zip(group.seqs, seeds, strict=True):
            expected, reason, stop_reason = reference_generation(
                seq.prompt_token_ids, params, EOS, seed
            )
            assert seq.sampling_seed == seed
            if cut_short:
                assert seq.output_token_ids == expected[: seq.num_output_tokens], seq
            else:
                assert (seq.output_token_ids, seq.finish_reason, seq.stop_reason) == (
                    expected,
                    reason,
                    stop_reason,
                ), seq
        if not cut_short:
            assert len(group.seqs) == group.best_of


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def _machine(**overrides):
    machine = SchedulerMachine()
    setup = dict(
        block_size=2,
        extra_blocks=0,
        max_num_seqs=4,
        extra_batched_tokens=8,
        long_prefill_token_threshold=0,
        enable_caching=False,
        num_cpu_blocks=0,
        preemption_mode=None,
    )
    machine.setup(**(setup | overrides))
    return machine


def _add(machine, prompt, kind="single", max_tokens=None, width=2):
    machine.add(prompt, max_tokens, 0, True, None, kind, width, 11, 1.0, False)


def test_random_runs_do_preempt():
    """Guard against a vacuous machine: the configurations above really force preemption."""
    machine = _machine()
    for i in range(4):
        _add(machine, [1 + i, 2, 3, 4, 5, 6])
    machine.teardown()
    assert machine.sched.num_preemptions_by_mode["recompute"] > 0


def test_random_runs_do_swap_fork_share_and_search_beams():
    """The machine's other paths are reachable too: swap, forks with copy-on-write, prefix
    hits and beams, all ending with every device and host block free."""
    machine = _machine(
        extra_blocks=2, num_cpu_blocks=64, enable_caching=True, preemption_mode="swap"
    )
    _add(machine, [1, 2, 3, 4, 5], kind="fork", max_tokens=6, width=2)
    _add(machine, [1, 2, 3, 4, 5, 6, 7], kind="beam", max_tokens=5, width=2)
    _add(machine, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    copies = 0
    for _ in range(200):
        if not machine.sched.has_unfinished:
            break
        out = machine.sched.schedule()
        copies += len(out.blocks_to_copy)
        machine.run_block_ops(out)
        sampled, beams = machine.run_fake_model(out)
        machine.sched.update_from_output(out, sampled, beam_candidates=beams)
        machine.blocks_are_consistent()
    machine.teardown()
    assert machine.sched.num_preemptions_by_mode["swap"] > 0
    assert copies > 0
    assert machine.sched.prefix_cache_hits > 0
    statuses = {seq.status for group in machine.groups for seq in group.seqs}
    assert SequenceStatus.FINISHED_IGNORED not in statuses
