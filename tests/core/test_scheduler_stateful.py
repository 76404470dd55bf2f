"""Random add / step / abort sequences against a fake model with a fake paged KV cache.

The fake model writes each scheduled token into its slot (through the block table) and samples
a deterministic function of the tokens it reads back through the block table. So a block given
to two sequences, freed too early or mapped wrongly changes the outputs, and every finished
sequence must produce exactly what it would with ample memory, however often recompute
preemption threw its K/V away.
"""

from types import SimpleNamespace

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.scheduler import Scheduler
from jaxpaged.sequence import Sequence, SequenceStatus

VOCAB = 12
EOS = 0
MAX_MODEL_LEN = 16


def next_token(tokens):
    """The fake model: a deterministic token from the whole context (position-sensitive)."""
    return (sum((i + 1) * t for i, t in enumerate(tokens)) * 7 + len(tokens)) % VOCAB


def reference_generation(prompt, params, eos_token_id):
    """What the sequence produces with ample memory: (outputs, finish_reason, stop_reason)."""
    tokens, outputs = list(prompt), []
    while True:
        token = next_token(tokens)
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


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        extra_blocks=st.integers(0, 6),
        max_num_seqs=st.integers(1, 4),
        max_num_batched_tokens=st.integers(1, 12),
        long_prefill_token_threshold=st.sampled_from([0, 0, 3]),
    )
    def setup(
        self,
        block_size,
        extra_blocks,
        max_num_seqs,
        max_num_batched_tokens,
        long_prefill_token_threshold,
    ):
        # Just enough blocks for one sequence at max_model_len, plus a few: forces preemption.
        num_blocks = -(-MAX_MODEL_LEN // block_size) + extra_blocks
        self.kv = KVCacheManager(num_blocks, block_size)
        self.config = SimpleNamespace(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=MAX_MODEL_LEN,
            long_prefill_token_threshold=long_prefill_token_threshold,
        )
        self.sched = Scheduler(self.config, self.kv)
        # Fake KV cache: slot -> (position, token) written by the step that computed it.
        self.cache = [None] * (num_blocks * block_size)
        self.seqs: list[Sequence] = []
        self.num_steps = 0

    @rule(
        prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
        max_tokens=st.one_of(st.none(), st.integers(1, 8)),
        min_tokens=st.integers(0, 3),
        ignore_eos=st.booleans(),
        stop_token_ids=st.one_of(st.none(), st.lists(st.integers(0, VOCAB - 1), max_size=2)),
    )
    def add(self, prompt, max_tokens, min_tokens, ignore_eos, stop_token_ids):
        if max_tokens is not None:
            min_tokens = min(min_tokens, max_tokens)
        params = SimpleNamespace(
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            ignore_eos=ignore_eos,
            stop_token_ids=stop_token_ids,
        )
        seq = Sequence(f"s{len(self.seqs)}", prompt, params, eos_token_id=EOS)
        self.seqs.append(seq)
        self.sched.add_request(seq)

    @rule()
    def step(self):
        had_unfinished = self.sched.has_unfinished
        out = self.sched.schedule()
        self.check_output(out)
        # Liveness: while anything is unfinished, every step makes progress somewhere.
        assert out.is_empty != had_unfinished, (had_unfinished, out)
        sampled = self.run_fake_model(out)
        produced = self.sched.update_from_output(out, sampled)
        assert {s.seq_id for s in produced} == set(sampled)
        self.num_steps += 1

    @precondition(lambda self: self.sched.has_unfinished)
    @rule(data=st.data())
    def abort(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.sched.requests)))
        group = self.sched.abort(seq_id)
        assert group is not None and group.seqs[0].status is SequenceStatus.FINISHED_ABORTED

    @invariant()
    def blocks_are_consistent(self):
        self.kv.check_invariants(self.sched.running_seqs())
        assert all(seq.status is SequenceStatus.RUNNING for seq in self.sched.running_seqs())
        assert all(g.seqs[0].status is SequenceStatus.WAITING for g in self.sched.waiting)
        assert self.sched.num_running <= self.config.max_num_seqs
        unfinished = {s.seq_id for s in self.seqs if not s.is_finished}
        assert set(self.sched.requests) == unfinished

    def check_output(self, out):
        ids = [s.seq.seq_id for s in out.scheduled]
        assert len(ids) == len(set(ids))
        assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
        assert out.num_batched_tokens <= self.config.max_num_batched_tokens
        assert len(out.scheduled) <= self.config.max_num_seqs
        prefill_flags = [s.seq.is_prefill for s in out.scheduled]
        assert prefill_flags == sorted(prefill_flags), "decodes must come first"
        for item in out.scheduled:
            seq = item.seq
            assert seq.status is SequenceStatus.RUNNING
            assert item.num_computed_tokens == seq.num_computed_tokens
            end = item.num_computed_tokens + item.num_new_tokens
            assert item.num_new_tokens >= 1 and end <= seq.num_tokens
            assert item.do_sample == (end == seq.num_tokens)
            assert len(item.block_table) == self.kv.num_blocks_needed(end)
        for seq_id in out.preempted_seq_ids:
            seq = next(s for s in self.seqs if s.seq_id == seq_id)
            assert seq.status is SequenceStatus.WAITING and seq.num_computed_tokens == 0
            assert seq_id not in ids

    def run_fake_model(self, out):
        bs = self.kv.block_size
        # Write every new token's "K/V" into its slot first, as the real step does per layer.
        for item in out.scheduled:
            start, end = item.num_computed_tokens, item.num_computed_tokens + item.num_new_tokens
            for pos in range(start, end):
                slot = item.block_table[pos // bs] * bs + pos % bs
                self.cache[slot] = (pos, item.seq.token_ids[pos])
        sampled = {}
        for item in out.scheduled:
            if not item.do_sample:
                continue
            context = []
            for pos in range(item.seq.num_tokens):
                entry = self.cache[item.block_table[pos // bs] * bs + pos % bs]
                assert entry is not None and entry[0] == pos, (item.seq.seq_id, pos, entry)
                context.append(entry[1])
            sampled[item.seq.seq_id] = next_token(context)
        return sampled

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(2000):
            if not self.sched.has_unfinished:
                break
            self.step()
            self.blocks_are_consistent()
        assert not self.sched.has_unfinished, "requests never finished"
        assert self.kv.num_free_blocks == self.kv.num_blocks
        assert self.kv.block_tables == {}
        self.kv.check_invariants([])
        for seq in self.seqs:
            expected, reason, stop_reason = reference_generation(
                seq.prompt_token_ids, seq.sampling_params, EOS
            )
            if seq.finish_reason == "abort":
                assert seq.output_token_ids == expected[: seq.num_output_tokens]
            else:
                assert (seq.output_token_ids, seq.finish_reason, seq.stop_reason) == (
                    expected,
                    reason,
                    stop_reason,
                ), seq


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


def test_random_runs_do_preempt():
    """Guard against a vacuous machine: the configurations above really force preemption."""
    machine = SchedulerMachine()
    machine.setup(
        block_size=2,
        extra_blocks=0,
        max_num_seqs=4,
        max_num_batched_tokens=12,
        long_prefill_token_threshold=0,
    )
    for i in range(4):
        machine.add([1 + i, 2, 3, 4, 5, 6], None, 0, True, None)
    machine.teardown()
    assert machine.sched.num_preemptions > 0
