"""Per-sequence block tables on top of the `BlockPool` (host only; no JAX)."""

from __future__ import annotations

from collections.abc import Iterable

from jaxpaged.core.block_pool import BlockPool
from jaxpaged.core.prefix_cache import update_block_hashes
from jaxpaged.sequence import Sequence


class KVCacheManager:
    """Maps each sequence to its block table: logical block i of the sequence -> physical block id.

    Token t of a sequence lives in slot `block_table[t // block_size] * block_size +
    t % block_size` (the model runner's slot mapping). A table handed to the model runner stays
    valid for the step it was scheduled in: tables only grow at the end, and the two changes that
    are not appends (copy-on-write and `free`/swap) replace or drop the list instead of mutating it.

    The scheduler asks before it acts (`can_allocate_slots`, then `allocate_slots`); like vLLM's
    `allocate_slots`, running out of blocks is answered by a return value (`False`, with nothing
    changed), and the scheduler turns it into waiting or preemption.

    Memory-management features (docs/architecture.md, "Block manager rules"):
      - Prefix caching (`enable_caching`): `get_computed_blocks` finds the longest run of a new
        sequence's full blocks already cached; `cache_full_blocks` registers blocks once the step
        that filled them has run (so a hash always describes K/V that exist).
      - Copy-on-write: `fork` shares a table (ref counts + 1). Before a sequence writes into a
        block another table also holds, `allocate_slots` gives it a private copy and records
        (src, dst) in the step's `blocks_to_copy`.
      - Swap: `swap_out` moves a group's blocks to `num_cpu_blocks` host blocks (shared blocks
        stay shared there), `swap_in` brings them back into fresh device blocks.
    Block operations decided while scheduling a step accumulate here and are handed over by
    `take_block_ops`; the model runner executes swap-out, then swap-in, then copies, then the
    step. The scheduler never swaps in during a step that preempted, which is what makes that
    fixed order safe (a block freed by a swap-out is never a swap-in destination of the same
    step).

    Invariant (`check_invariants`): each device and host block's ref count equals the number of
    tables holding it, no free block appears in any table, and each pool's free + referenced
    blocks add up to its size.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = False,
        num_cpu_blocks: int = 0,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be non-negative, got {num_cpu_blocks}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks)
        self.cpu_block_pool = BlockPool(num_cpu_blocks) if num_cpu_blocks else None
        self.block_tables: dict[str, list[int]] = {}
        self.cpu_block_tables: dict[str, list[int]] = {}
        # Slots written by the time the scheduled step has run (num_computed + num_new at the last
        # allocation): the "tokens stored" side of the internal-fragmentation figure.
        self._num_slots_used: dict[str, int] = {}
        # Leading blocks of each table already registered in the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}
        # Block operations of the step being scheduled (see take_block_ops).
        self._copies: dict[int, int] = {}  # dst -> src
        self._swap_out: list[tuple[int, int]] = []  # (device, host)
        self._swap_in: list[tuple[int, int]] = []  # (host, device)

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self.cpu_block_pool.num_blocks if self.cpu_block_pool else 0

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu_block_pool.num_free_blocks if self.cpu_block_pool else 0

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1] (vLLM's `kv_cache_usage_perc`)."""
        return self.block_pool.usage

    @property
    def cpu_usage(self) -> float:
        """Fraction of host (swap) blocks in use, in [0, 1] (vLLM's `cpu_cache_usage_perc`)."""
        return self.cpu_block_pool.usage if self.cpu_block_pool else 0.0

    def num_blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    def get_block_table(self, seq_id: str) -> list[int]:
        """The sequence's table (the live list; empty if it holds no blocks). Do not mutate it."""
        return self.block_tables.get(seq_id, [])

    # ------------------------------------------------------------------------- prefix caching
    def get_computed_blocks(self, seq: Sequence) -> tuple[list[int], int]:
        """The longest run of `seq`'s leading full blocks found in the prefix cache.

        Returns `(block_ids, num_tokens)`; `([], 0)` when caching is off or the sequence skips
        cache reads (`seq.skip_prefix_cache`: prompt logprobs need every prompt position's
        logits, vLLM's `skip_reading_prefix_cache`); its full blocks are still cached for
        others once computed. Pass the blocks to
        `allocate_slots` as `new_computed_blocks` and set `seq.num_computed_tokens` to
        `num_tokens` once it succeeds.
        """
        if not self.enable_caching or seq.num_computed_tokens or seq.skip_prefix_cache:
            return [], 0
        hashes = update_block_hashes(seq, self.block_size)
        # Stop one token short of the end, which drops a fully cached last block (vLLM's
        # max_cache_hit_length): the step must compute the last token to get logits to sample
        # from, and that token's slot lies in a cached block other sequences may be reading.
        max_blocks = (seq.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in hashes[:max_blocks]:
            block_id = self.block_pool.get_cached_block(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks, len(blocks) * self.block_size

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks `seq` has completely computed (call after a step commits)."""
        if not self.enable_caching:
            return
        seq_id = seq.seq_id
        start = self._num_cached_blocks.get(seq_id, 0)
        if seq.num_computed_tokens // self.block_size <= start:
            return  # no block filled up since the last call (most decode steps)
        table = self.block_tables.get(seq_id)
        if not table:
            return
        end = min(seq.num_computed_tokens // self.block_size, len(table))
        if end <= start:
            return
        hashes = update_block_hashes(seq, self.block_size)
        pool = self.block_pool
        for index in range(start, end):
            block_id = table[index]
            if pool.block_hashes[block_id] is None:  # a fork's shared block may be cached already
                pool.cache_block(block_id, hashes[index])
        self._num_cached_blocks[seq_id] = end

    def reset_prefix_cache(self) -> None:
        """Drop every cached hash; blocks in use keep their K/V (vLLM's `reset_prefix_cache`)."""
        self.block_pool.reset_prefix_cache()
        for seq_id in self._num_cached_blocks:
            self._num_cached_blocks[seq_id] = 0

    # ------------------------------------------------------------------------- allocation
    def num_new_blocks_needed(
        self, seq: Sequence, num_new_tokens: int, num_computed_blocks: int = 0
    ) -> int:
        """Blocks to take from the pool so the table covers the computed tokens (plus
        `num_computed_blocks` cache hits) and `num_new_tokens` more, copy-on-write included."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be non-negative, got {num_new_tokens}")
        table = self.block_tables.get(seq.seq_id, ())
        num_computed = seq.num_computed_tokens + num_computed_blocks * self.block_size
        num_held = len(table) + num_computed_blocks
        needed = max(0, self.num_blocks_needed(num_computed + num_new_tokens) - num_held)
        if num_new_tokens and self._cow_index(table, num_computed) is not None:
            needed += 1
        return needed

    def can_allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether `allocate_slots(seq, num_new_tokens)` would succeed now."""
        return self.num_new_blocks_needed(seq, num_new_tokens) <= self.block_pool.num_free_blocks

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, new_computed_blocks: Iterable[int] = ()
    ) -> bool:
        """Grow the table to cover the tokens computed so far plus `num_new_tokens` new ones.

        Slots of the new tokens are positions `num_computed .. num_computed + num_new_tokens - 1`
        where `num_computed` is `seq.num_computed_tokens` plus the tokens of
        `new_computed_blocks` (prefix-cache hits from `get_computed_blocks`, only for a sequence
        that holds no blocks yet). If the first new token lands in a block another table shares,
        the sequence gets a private copy first (copy-on-write). Returns False and changes nothing
        when the pool lacks blocks.
        """
        seq_id = seq.seq_id
        if num_new_tokens > 0 and not new_computed_blocks:
            # Fast path of almost every decode: the table already covers the new tokens and the
            # block written first is not shared, so nothing is allocated or copied.
            table = self.block_tables.get(seq_id)
            num_computed = seq.num_computed_tokens
            end = num_computed + num_new_tokens
            if (
                table
                and len(table) * self.block_size >= end
                and self.block_pool.ref_counts[table[num_computed // self.block_size]] == 1
            ):
                self._num_slots_used[seq_id] = end
                return True
        new_computed_blocks = list(new_computed_blocks)
        if new_computed_blocks and (self.block_tables.get(seq_id) or seq.num_computed_tokens):
            raise ValueError(f"cache hits given for {seq_id!r}, which already holds blocks")
        pool = self.block_pool
        num_needed = self.num_new_blocks_needed(seq, num_new_tokens, len(new_computed_blocks))
        # Hit blocks that sit evictable in the free queue leave it, so they are not free to give.
        num_evictable_hits = sum(1 for b in new_computed_blocks if pool.ref_counts[b] == 0)
        if num_needed > pool.num_free_blocks - num_evictable_hits:
            return False
        table = self.block_tables.setdefault(seq_id, [])
        if new_computed_blocks:
            pool.touch(new_computed_blocks)
            table.extend(new_computed_blocks)
            self._num_cached_blocks[seq_id] = len(new_computed_blocks)
        num_computed = seq.num_computed_tokens + len(new_computed_blocks) * self.block_size
        cow_index = self._cow_index(table, num_computed) if num_new_tokens else None
        if cow_index is not None:
            table = self._copy_on_write(seq_id, cow_index)
            num_needed -= 1
        table.extend(pool.allocate(num_needed))
        if not table:
            del self.block_tables[seq_id]  # nothing to hold yet (a 0-token allocation)
        self._num_slots_used[seq_id] = num_computed + num_new_tokens
        return True

    def _cow_index(self, table, num_computed: int) -> int | None:
        # Writes start at position num_computed; only that block can already exist in the table.
        index = num_computed // self.block_size
        if index < len(table) and self.block_pool.ref_counts[table[index]] > 1:
            return index
        return None

    def _copy_on_write(self, seq_id: str, index: int) -> list[int]:
        table = list(self.block_tables[seq_id])  # a new list: the old one may be in a step
        src = table[index]
        (dst,) = self.block_pool.allocate(1)
        self.block_pool.free([src])  # still held by the other tables sharing it
        table[index] = dst
        self._copies[dst] = src
        self.block_tables[seq_id] = table
        return table

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give `child` the parent's table, sharing every block (ref count + 1 each)."""
        if child.seq_id in self.block_tables or child.seq_id in self.cpu_block_tables:
            raise ValueError(f"sequence {child.seq_id!r} already holds blocks")
        table = self.block_tables.get(parent.seq_id)
        if table:
            self.block_pool.incref(table)
            self.block_tables[child.seq_id] = list(table)
        for counters in (self._num_slots_used, self._num_cached_blocks):
            if parent.seq_id in counters:
                counters[child.seq_id] = counters[parent.seq_id]

    def free(self, seq: Sequence) -> None:
        """Release every device and host block of the sequence, tail first, and forget its tables.

        Tail first is vLLM's order: with prefix caching the tail blocks then reach the eviction
        LRU before the head blocks, which other prompts are more likely to share. A sequence with
        no table (never allocated, or already freed) is a no-op.
        """
        self._free_device(seq.seq_id)
        cpu_table = self.cpu_block_tables.pop(seq.seq_id, None)
        if cpu_table:
            freed = set(self.cpu_block_pool.free(reversed(cpu_table)))
            # Aborted before its pending swap-out ran: nothing needs saving there any more.
            self._swap_out = [(d, h) for d, h in self._swap_out if h not in freed]

    def _free_device(self, seq_id: str) -> None:
        table = self.block_tables.pop(seq_id, None)
        self._num_slots_used.pop(seq_id, None)
        self._num_cached_blocks.pop(seq_id, None)
        if table:
            for block_id in self.block_pool.free(reversed(table)):
                # A copy into a block freed before the step ran would write a stranger's block.
                self._copies.pop(block_id, None)

    # ------------------------------------------------------------------------- swap
    def can_swap_out(self, seqs: Iterable[Sequence]) -> bool:
        """Whether the host has room for the sequences' blocks (each shared block once)."""
        if self.cpu_block_pool is None:
            return False
        needed = {b for table in self._tables_to_save(seqs).values() for b in table}
        return len(needed) <= self.cpu_block_pool.num_free_blocks

    def swap_out(self, seqs: Iterable[Sequence]) -> None:
        """Move the sequences' computed blocks to host blocks and free their device blocks.

        Only blocks holding computed tokens travel: a block allocated for the step being
        scheduled has nothing in it yet. Blocks the sequences share stay shared on the host.
        A block copied-on-write earlier in this step has not been filled yet either (copies run
        after swap-outs), so its source block is saved in its place, and the copy is dropped.
        """
        seqs = list(seqs)
        tables = self._tables_to_save(seqs)
        mapping: dict[int, int] = {}
        for seq in seqs:
            cpu_table = _remap_blocks(
                tables[seq.seq_id], self.cpu_block_pool, mapping, "swap_out", "can_swap_out"
            )
            if cpu_table:
                self.cpu_block_tables[seq.seq_id] = cpu_table
            self._free_device(seq.seq_id)
        self._swap_out.extend(mapping.items())

    def _tables_to_save(self, seqs: Iterable[Sequence]) -> dict[str, list[int]]:
        tables = {}
        for seq in seqs:
            table = self.block_tables.get(seq.seq_id, [])
            table = table[: self.num_blocks_needed(seq.num_computed_tokens)]
            tables[seq.seq_id] = [self._copies.get(b, b) for b in table]
        return tables

    def can_swap_in(self, seqs: Iterable[Sequence], num_extra_blocks: int = 0) -> bool:
        """Whether the device has room for the sequences' host blocks plus `num_extra_blocks`."""
        needed = {h for seq in seqs for h in self.cpu_block_tables.get(seq.seq_id, ())}
        return len(needed) + num_extra_blocks <= self.block_pool.num_free_blocks

    def swap_in(self, seqs: Iterable[Sequence]) -> None:
        """Bring the sequences' host blocks back into fresh device blocks (sharing preserved)."""
        mapping: dict[int, int] = {}
        for seq in seqs:
            cpu_table = self.cpu_block_tables.pop(seq.seq_id, [])
            table = _remap_blocks(cpu_table, self.block_pool, mapping, "swap_in", "can_swap_in")
            if cpu_table:
                self.block_tables[seq.seq_id] = table
                self.cpu_block_pool.free(reversed(cpu_table))
            self._num_slots_used[seq.seq_id] = seq.num_computed_tokens
            self._num_cached_blocks[seq.seq_id] = 0  # fresh blocks: registered again as they fill
        self._swap_in.extend(mapping.items())

    def take_block_ops(self) -> tuple[list[tuple[int, int]], ...]:
        """This step's `(blocks_to_swap_in, blocks_to_swap_out, blocks_to_copy)`, then reset.

        Pairs are (host, device), (device, host) and (src, dst) block ids.
        """
        ops = (self._swap_in, self._swap_out, [(src, dst) for dst, src in self._copies.items()])
        self._swap_in, self._swap_out, self._copies = [], [], {}
        return ops

    # ------------------------------------------------------------------------- reporting
    def slots_stored_vs_held(self) -> tuple[int, int]:
        """(token slots in use, slots held = blocks in tables * block_size).

        `1 - stored / held` is the internal fragmentation PagedAttention bounds by one partly
        filled block per sequence (the paper reports < 4% waste). A block shared by several
        tables counts once per table, like the tokens it stores.
        """
        stored = sum(self._num_slots_used.get(seq_id, 0) for seq_id in self.block_tables)
        held = sum(len(table) for table in self.block_tables.values()) * self.block_size
        return stored, held

    def check_invariants(
        self,
        sequences: Iterable[Sequence] | None = None,
        swapped: Iterable[Sequence] | None = None,
    ) -> None:
        """Raise AssertionError naming the values if the bookkeeping is inconsistent.

        With `sequences` (those that should hold device blocks: the running ones), also check
        that the device tables belong to exactly those sequences and that each covers the
        sequence's computed tokens and no more than all of its tokens. With `swapped`, check
        that host tables belong to those sequences only.
        """
        _check_tables(self.block_pool, self.block_tables, "device")
        if self.cpu_block_pool is not None:
            _check_tables(self.cpu_block_pool, self.cpu_block_tables, "host")
        else:
            _check(not self.cpu_block_tables, "host tables without a host pool")
        both = set(self.block_tables) & set(self.cpu_block_tables)
        _check(not both, f"sequences holding device and host blocks at once: {both}")
        for dst, src in self._copies.items():
            refs = self.block_pool.ref_counts
            _check(refs[dst] > 0 and refs[src] > 0, f"pending copy of free blocks: {src=} {dst=}")
        if swapped is not None:
            ids = {seq.seq_id for seq in swapped}
            _check(
                ids >= set(self.cpu_block_tables),
                f"host tables of sequences not swapped: {set(self.cpu_block_tables) - ids}",
            )
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


def _check_tables(pool: BlockPool, tables: dict[str, list[int]], kind: str) -> None:
    pool.check_invariants()
    holders: dict[int, int] = {}
    for seq_id, table in tables.items():
        _check(len(table) > 0, f"empty {kind} table kept: {seq_id=}")
        for block_id in table:
            holders[block_id] = holders.get(block_id, 0) + 1
    for block_id, n in holders.items():
        ref_count = pool.ref_counts[block_id]
        _check(
            ref_count == n,
            f"{kind} ref count != tables holding it: {block_id=} {ref_count=} {n=}",
        )
    num_referenced = pool.num_blocks - pool.ref_counts.count(0)
    _check(
        num_referenced == len(holders),
        f"{kind} ref count != tables holding it: {num_referenced=} blocks referenced, "
        f"{len(holders)} held by tables",
    )


def _check(condition: bool, message: str) -> None:
    # An explicit raise rather than `assert`: invariant checks must also run under `python -O`.
    if not condition:
        raise AssertionError(message)


def _remap_blocks(
    table: list[int], target_pool, mapping: dict[int, int], action: str, question: str
) -> list[int]:
    """``table`` moved into blocks of ``target_pool``: a block seen before in this move (in
    ``mapping``, shared by several sequences) is reused with its ref count raised, so sharing
    survives the move; a new one gets a fresh block.

    Raises:
        RuntimeError: the target pool ran out, i.e. the caller skipped ``question`` first.
    """
    moved = []
    for block_id in table:
        if block_id in mapping:
            target_pool.incref([mapping[block_id]])
        else:
            allocated = target_pool.allocate(1)
            if allocated is None:
                raise RuntimeError(f"{action} without room in the target pool: ask {question}")
            mapping[block_id] = allocated[0]
        moved.append(mapping[block_id])
    return moved
