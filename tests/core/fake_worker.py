"""A fake model on a fake paged KV cache, for scheduler tests without JAX.

Each slot of the fake device cache holds `(position, token)` written by the step that computed
it; the fake host cache holds swapped-out blocks. The fake model reads a sequence's context
back through its block table, so a wrong table, a missing copy or a lost swap changes its
outputs (or trips the assertion that every slot it reads holds the expected position).
"""

from __future__ import annotations

VOCAB = 12


def next_token(tokens, seed=0):
    """The fake model: a deterministic token from the whole context and the sampling seed."""
    return (sum((i + 1) * t for i, t in enumerate(tokens)) * 7 + len(tokens) + seed * 5) % VOCAB


def candidates(tokens):
    """The fake model's log-probabilities for beam search: every token, best first (no ties)."""
    h = sum((i + 1) * t for i, t in enumerate(tokens)) + 3 * len(tokens)
    scored = [(t, -((h * 31 + t * 17) % 97) / 10.0) for t in range(VOCAB)]
    return sorted(scored, key=lambda pair: -pair[1])


class FakeWorker:
    """Executes `SchedulerOutput`s the way the model runner does, on lists instead of arrays."""

    def __init__(self, kv_cache_manager):
        self.block_size = kv_cache_manager.block_size
        self.cache = [None] * (kv_cache_manager.num_blocks * self.block_size)
        self.host = [None] * (kv_cache_manager.num_cpu_blocks * self.block_size)

    def _block(self, cache, block_id):
        bs = self.block_size
        return cache[block_id * bs : (block_id + 1) * bs]

    def _write(self, cache, block_id, values):
        bs = self.block_size
        cache[block_id * bs : (block_id + 1) * bs] = values

    def run_block_ops(self, out):
        """Swap-out, swap-in, then copies (all sources read before any destination is written)."""
        saved = {d: self._block(self.cache, d) for d, _ in out.blocks_to_swap_out}
        for d, h in out.blocks_to_swap_out:
            self._write(self.host, h, saved[d])
        for h, d in out.blocks_to_swap_in:
            self._write(self.cache, d, self._block(self.host, h))
        sources = {s: self._block(self.cache, s) for s, _ in out.blocks_to_copy}
        for s, d in out.blocks_to_copy:
            self._write(self.cache, d, sources[s])

    def run_model(self, out):
        """Write the scheduled tokens, then sample: `(sampled, beam_candidates)`."""
        bs = self.block_size
        # Write every new token's "K/V" into its slot first, as the real step does per layer.
        for item in out.scheduled:
            start, end = item.num_computed_tokens, item.num_computed_tokens + item.num_new_tokens
            for pos in range(start, end):
                slot = item.block_table[pos // bs] * bs + pos % bs
                self.cache[slot] = (pos, item.seq.token_ids[pos])
        sampled, beams = {}, {}
        for item in out.scheduled:
            if not item.do_sample:
                continue
            context = []
            for pos in range(item.seq.num_tokens):
                entry = self.cache[item.block_table[pos // bs] * bs + pos % bs]
                assert entry is not None and entry[0] == pos, (item.seq.seq_id, pos, entry)
                context.append(entry[1])
            sampled[item.seq.seq_id] = next_token(context, item.seq.sampling_seed)
            group = item.seq.group
            if group is not None and group.is_beam_search:
                pairs = candidates(context)
                beams[item.seq.seq_id] = ([t for t, _ in pairs], [lp for _, lp in pairs])
        return sampled, beams

    def step(self, scheduler):
        """One full engine step on `scheduler`; returns (scheduler output, updated sequences)."""
        out = scheduler.schedule()
        self.run_block_ops(out)
        sampled, beams = self.run_model(out)
        return out, scheduler.update_from_output(out, sampled, beam_candidates=beams)
