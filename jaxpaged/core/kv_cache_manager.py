"""Per-sequence block tables on top of the `BlockPool` (host only; no JAX)."""

from __future__ import annotations

from collections.abc import Iterable

from jaxpaged.core.block_pool import BlockPool
from jaxpaged.sequence import Sequence


class KVCacheManager:
    """Maps each sequence to its block table: logical block i of the sequence -> physical block id.

    Token t of a sequence lives in slot `block_table[t // block_size] * block_size +
    t % block_size` (the model runner's slot mapping). Tables only grow at the end while a
    sequence holds them, and `free` drops the list rather than clearing it, so a table handed to
    the model runner stays valid for the step it was scheduled in.

    The scheduler asks before it acts (`can_allocate_slots`, then `allocate_slots`); like vLLM's
    `allocate_slots`, running out of blocks is answered by a return value (`False`, with nothing
    changed), and the scheduler turns it into waiting or preemption.

    Invariant (`check_invariants`): each block's ref count equals the number of tables holding it,
    no free block appears in any table, and free + referenced == num_blocks.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        # Slots written by the time the scheduled step has run (num_computed + num_new at the last
        # allocation): the "tokens stored" side of the internal-fragmentation figure.
        self._num_slots_used: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1] (vLLM's `kv_cache_usage_perc`)."""
        return self.block_pool.usage

    def num_blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    def get_block_table(self, seq_id: str) -> list[int]:
        """The sequence's table (the live list; empty if it holds no blocks). Do not mutate it."""
        return self.block_tables.get(seq_id, [])

    def num_new_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add so the table covers `seq.num_computed_tokens + num_new_tokens` tokens."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be non-negative, got {num_new_tokens}")
        num_held = len(self.block_tables.get(seq.seq_id, ()))
        return max(0, self.num_blocks_needed(seq.num_computed_tokens + num_new_tokens) - num_held)

    def can_allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether `allocate_slots(seq, num_new_tokens)` would succeed now."""
        return self.num_new_blocks_needed(seq, num_new_tokens) <= self.block_pool.num_free_blocks

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow the table to cover the tokens computed so far plus `num_new_tokens` new ones.

        Slots of the new tokens are positions `num_computed_tokens .. num_computed_tokens +
        num_new_tokens - 1`. Returns False and changes nothing when the pool lacks blocks.
        """
        num_new_blocks = self.num_new_blocks_needed(seq, num_new_tokens)
        new_blocks = self.block_pool.allocate(num_new_blocks)
        if new_blocks is None:
            return False
        # setdefault: the first allocation creates the table; later ones append (append-only).
        self.block_tables.setdefault(seq.seq_id, []).extend(new_blocks)
        self._num_slots_used[seq.seq_id] = seq.num_computed_tokens + num_new_tokens
        return True

    def free(self, seq: Sequence) -> None:
        """Release every block of the sequence's table, tail first, and forget the table.

        Tail first is vLLM's order: with prefix caching the tail blocks then reach the eviction
        LRU before the head blocks, which other prompts are more likely to share. A sequence with
        no table (never allocated, or already freed) is a no-op.
        """
        table = self.block_tables.pop(seq.seq_id, None)
        self._num_slots_used.pop(seq.seq_id, None)
        if table:
            self.block_pool.free(reversed(table))

    def slots_stored_vs_held(self) -> tuple[int, int]:
        """(token slots in use, slots held = blocks in tables * block_size).

        `1 - stored / held` is the internal fragmentation PagedAttention bounds by one partly
        filled block per sequence (the paper reports < 4% waste).
        """
        stored = sum(self._num_slots_used.values())
        held = sum(len(table) for table in self.block_tables.values()) * self.block_size
        return stored, held

    def check_invariants(self, sequences: Iterable[Sequence] | None = None) -> None:
        """Raise AssertionError naming the values if the bookkeeping is inconsistent.

        With `sequences` (those that should hold blocks: the running set), also check that the
        tables belong to exactly those sequences and that each table covers the sequence's
        computed tokens and no more than all of its tokens.
        """
        pool = self.block_pool
        pool.check_invariants()
        holders = [0] * pool.num_blocks
        for seq_id, table in self.block_tables.items():
            _check(len(table) > 0, f"empty table kept: {seq_id=}")
            for block_id in table:
                holders[block_id] += 1
        for block_id, (ref_count, n) in enumerate(zip(pool.ref_counts, holders, strict=True)):
            _check(ref_count == n, f"ref count != tables holding it: {block_id=} {ref_count=} {n=}")
        if sequences is None:
            return
        by_id = {seq.seq_id: seq for seq in sequences}
        _check(
            set(by_id) >= set(self.block_tables),
            f"tables of sequences that should hold none: {set(self.block_tables) - set(by_id)}",
        )
        for seq_id, seq in by_id.items():
            num_held = len(self.block_tables.get(seq_id, ()))
            low = self.num_blocks_needed(seq.num_computed_tokens)
            high = self.num_blocks_needed(seq.num_tokens)
            _check(
                low <= num_held <= high,
                f"table size out of range: {seq_id=} {num_held=} {low=} {high=} "
                f"{seq.num_computed_tokens=} {seq.num_tokens=}",
            )


def _check(condition: bool, message: str) -> None:
    # An explicit raise rather than `assert`: invariant checks must also run under `python -O`.
    if not condition:
        raise AssertionError(message)
