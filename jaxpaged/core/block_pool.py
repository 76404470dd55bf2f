"""Physical KV cache blocks: the free queue, ref counts and the prefix-cache hash map (host only)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from jaxpaged.core.prefix_cache import BlockHash


class BlockPool:
    """Owns block ids `0 .. num_blocks - 1` and who holds them.

    Invariant (checked by `check_invariants`): every block is in exactly one of
      - free: ref count 0, no hash, in the free queue;
      - evictable cached: ref count 0 with a hash, in the free queue, and still reusable by a
        prompt with the same prefix (a cache hit takes it out of the queue again);
      - referenced: ref count >= 1 (the number of block tables holding it), not in the queue;
        it may carry a hash (a full, computed block that other prompts can share).
    Every hashed block is listed under its hash in `cached_blocks`, and nothing else is.

    Queue order (vLLM's free queue): `allocate` takes blocks from the front. Freed blocks without
    a hash go back to the *front*: they hold nothing worth keeping, so they are reused first.
    Freed cached blocks go to the *back*, which makes the one queue both the free list and the
    LRU of evictable cached blocks: a cached block is evicted (its hash dropped) only when
    `allocate` reaches it, oldest first. The queue is an `OrderedDict` so that a cache hit can
    take a block out of its middle in O(1) (vLLM uses a doubly linked list for the same reason).

    Several blocks may carry the same hash (two requests computed the same prefix at once): like
    vLLM we do not de-duplicate them, so block tables stay append-only.

    No block is reserved: the model runner pads block tables with any valid id, because kernels
    never read past `seq_len`.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts: list[int] = [0] * num_blocks
        # Hash of a full block's prefix (see prefix_cache.py); None = not cached.
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self.free_block_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # hash -> block ids carrying it, oldest first.
        self.cached_blocks: dict[BlockHash, dict[int, None]] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out: free plus evictable cached."""
        return len(self.free_block_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1] (vLLM's `kv_cache_usage_perc`); evictable cached
        blocks count as free."""
        return 1.0 - len(self.free_block_queue) / self.num_blocks

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take `num_blocks` blocks from the front of the free queue, each with ref count 1.

        A cached block taken this way is evicted: its hash is dropped. Returns None, changing
        nothing, when fewer are free: running out is an everyday outcome that the scheduler
        answers with waiting or preemption, not an error.
        """
        if num_blocks < 0:
            raise ValueError(f"cannot allocate a negative number of blocks, got {num_blocks}")
        if num_blocks > len(self.free_block_queue):
            return None
        popitem = self.free_block_queue.popitem
        block_ids = [popitem(last=False)[0] for _ in range(num_blocks)]
        for block_id in block_ids:
            if self.block_hashes[block_id] is not None:
                self._uncache(block_id)
            self.ref_counts[block_id] = 1
        return block_ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each referenced block (a table starts sharing it: a fork)."""
        block_ids = list(block_ids)
        for block_id in block_ids:
            self._check_id(block_id)
            if self.ref_counts[block_id] == 0:
                raise ValueError(f"incref of free block {block_id}: allocate or touch it instead")
        for block_id in block_ids:
            self.ref_counts[block_id] += 1

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each cached block of a prefix-cache hit.

        An evictable block leaves the free queue (it is in use again); a referenced one is
        shared. Touching a block without a hash is a bug.
        """
        block_ids = list(block_ids)
        for block_id in block_ids:
            self._check_id(block_id)
            if self.block_hashes[block_id] is None:
                raise ValueError(f"touch of uncached block {block_id}")
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self.free_block_queue[block_id]
            self.ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> list[int]:
        """Drop one reference to each block; a block whose count reaches 0 rejoins the queue.

        Returns the blocks that became free. Blocks are released in the given order. The KV cache
        manager passes a table tail first (vLLM's behaviour): cached tail blocks then reach the
        eviction LRU before the head blocks, which more prompts share (a hit on block i needs
        hits on all blocks before it), so the tail is evicted first.
        Freeing a block more times than it is referenced is a bug and raises, changing nothing.
        """
        block_ids = list(block_ids)
        drops: dict[int, int] = {}
        for block_id in block_ids:
            self._check_id(block_id)
            drops[block_id] = drops.get(block_id, 0) + 1
        for block_id, n in drops.items():
            if self.ref_counts[block_id] < n:
                raise ValueError(
                    f"block {block_id} freed {n} time(s) with ref count "
                    f"{self.ref_counts[block_id]} (double free)"
                )
        freed = []
        queue = self.free_block_queue
        for block_id in block_ids:
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                freed.append(block_id)
                queue[block_id] = None  # back: evictable cached blocks age in LRU order
                if self.block_hashes[block_id] is None:
                    # No hash: nothing to keep, so reuse it first (see the class docstring).
                    queue.move_to_end(block_id, last=False)
        return freed

    def cache_block(self, block_id: int, block_hash: BlockHash) -> None:
        """Register a referenced, full and computed block under `block_hash`."""
        self._check_id(block_id)
        if self.ref_counts[block_id] == 0:
            raise ValueError(f"cannot cache free block {block_id}")
        if self.block_hashes[block_id] is not None:
            raise ValueError(f"block {block_id} is already cached")
        self.block_hashes[block_id] = block_hash
        self.cached_blocks.setdefault(block_hash, {})[block_id] = None

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        """A block carrying `block_hash` (the oldest), or None if none does."""
        blocks = self.cached_blocks.get(block_hash)
        return next(iter(blocks)) if blocks else None

    @property
    def num_cached_blocks(self) -> int:
        return sum(len(blocks) for blocks in self.cached_blocks.values())

    def reset_prefix_cache(self) -> None:
        """Forget every hash. Blocks in use keep their K/V and are simply no longer shareable;
        evictable ones become plain free blocks (moved to the front of the queue)."""
        for blocks in self.cached_blocks.values():
            for block_id in blocks:
                self.block_hashes[block_id] = None
                if self.ref_counts[block_id] == 0:
                    self.free_block_queue.move_to_end(block_id, last=False)
        self.cached_blocks.clear()

    def _uncache(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        self.block_hashes[block_id] = None
        blocks = self.cached_blocks[block_hash]
        del blocks[block_id]
        if not blocks:
            del self.cached_blocks[block_hash]

    def check_invariants(self) -> None:
        """Raise AssertionError naming the values if the free/cached/referenced partition breaks.

        Written with C-speed list operations where it can: host pools have ~10^5 blocks and the
        tests check after every step.
        """
        queue = self.free_block_queue
        refs = self.ref_counts
        if queue:
            low, high = min(queue), max(queue)
            _check(
                0 <= low and high < self.num_blocks,
                f"{low=} {high=} out of range {self.num_blocks=}",
            )
        _check(min(refs) >= 0, f"negative ref count: block_id={refs.index(min(refs))}")
        if any(map(refs.__getitem__, queue)):
            block_id = next(b for b in queue if refs[b])
            raise AssertionError(
                f"block must be free xor referenced: {block_id=} is in the free queue with "
                f"ref count {refs[block_id]}"
            )
        num_unreferenced = refs.count(0)
        _check(
            len(queue) == num_unreferenced,
            f"block must be free xor referenced: {len(queue)=} but {num_unreferenced=}",
        )
        listed = 0
        for block_hash, blocks in self.cached_blocks.items():
            _check(bool(blocks), "empty hash entry kept")
            for block_id in blocks:
                listed += 1
                _check(
                    self.block_hashes[block_id] == block_hash,
                    f"hash map entry disagrees with the block's hash: {block_id=}",
                )
        num_hashed = self.num_blocks - self.block_hashes.count(None)
        _check(
            listed == num_hashed,
            f"hashed block missing from the hash map: {listed=} entries for {num_hashed=} blocks",
        )

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {self.num_blocks})")


def _check(condition: bool, message: str) -> None:
    # An explicit raise rather than `assert`: invariant checks must also run under `python -O`.
    if not condition:
        raise AssertionError(message)
