"""Physical KV cache blocks: the free queue, ref counts and per-block hash slots (host only)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class BlockPool:
    """Owns block ids `0 .. num_blocks - 1` and who holds them.

    Invariant (checked by `check_invariants`): every block is in exactly one of
      - free: ref count 0, in the free queue exactly once;
      - referenced: ref count >= 1 (the number of block tables holding it), not in the queue.
    Prefix caching will add a third state, *evictable cached*: ref count 0 with a `block_hash`,
    still in the free queue so it can be reclaimed, but reusable by a prompt with the same prefix.

    Queue order (vLLM v1's `FreeKVCacheBlockQueue`): `allocate` takes blocks from the front.
    Freed blocks without a hash (all of them, until prefix caching) go back to the *front*: they
    hold nothing worth keeping, so they are reused first. Cached blocks will go to the *back*, which
    makes the one queue both the free list and the LRU of evictable cached blocks (evicted from the
    front, oldest first). That change also needs O(1) removal from the middle (a cache hit on an
    evictable block), i.e. vLLM's doubly linked list instead of this deque.

    No block is reserved: the model runner pads block tables with any valid id, because kernels
    never read past `seq_len`.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts: list[int] = [0] * num_blocks
        # Hash of a full block's tokens (parent hash, token ids, extra keys); None = not cached.
        # Always None until prefix caching lands; the slot is here so the layout does not change.
        self.block_hashes: list[int | None] = [None] * num_blocks
        self.free_block_queue: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1] (vLLM's `kv_cache_usage_perc`)."""
        return 1.0 - len(self.free_block_queue) / self.num_blocks

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take `num_blocks` blocks from the front of the free queue, each with ref count 1.

        Returns None, changing nothing, when fewer are free: running out is an everyday outcome
        that the scheduler answers with waiting or preemption, not an error.
        """
        if num_blocks < 0:
            raise ValueError(f"cannot allocate a negative number of blocks, got {num_blocks}")
        if num_blocks > len(self.free_block_queue):
            return None
        popleft = self.free_block_queue.popleft
        block_ids = [popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self.ref_counts[block_id] = 1
        return block_ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block (a table starts sharing it: fork, prefix hit)."""
        block_ids = list(block_ids)
        for block_id in block_ids:
            self._check_id(block_id)
            if self.ref_counts[block_id] == 0:
                # Reviving a free block means taking it out of the free queue: that is the
                # prefix-cache "touch" path, not implemented yet.
                raise ValueError(f"incref of free block {block_id}: allocate it instead")
        for block_id in block_ids:
            self.ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; a block whose count reaches 0 rejoins the queue.

        Blocks are released in the given order. The KV cache manager passes a table tail first
        (vLLM's behaviour): once cached blocks join the back of the queue as the eviction LRU,
        a sequence's tail blocks (shared by fewer prompts, since a hit on block i needs hits on
        all blocks before it) are then evicted before its head blocks.
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
        for block_id in block_ids:
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                # No hash: nothing to keep, so reuse it first (see the class docstring).
                self.free_block_queue.appendleft(block_id)

    def check_invariants(self) -> None:
        """Raise AssertionError naming the values if the free/referenced partition is broken."""
        queue = self.free_block_queue
        queued = set(queue)
        _check(
            len(queued) == len(queue), f"free queue has duplicates: {len(queue)=} {len(queued)=}"
        )
        for block_id in queued:
            _check(0 <= block_id < self.num_blocks, f"{block_id=} out of range {self.num_blocks=}")
        for block_id, ref_count in enumerate(self.ref_counts):
            _check(ref_count >= 0, f"negative ref count: {block_id=} {ref_count=}")
            in_queue = block_id in queued
            _check(
                in_queue == (ref_count == 0),
                f"block must be free xor referenced: {block_id=} {ref_count=} {in_queue=}",
            )
        num_referenced = sum(1 for ref_count in self.ref_counts if ref_count > 0)
        _check(
            len(queue) + num_referenced == self.num_blocks,
            f"{len(queue)=} + {num_referenced=} != {self.num_blocks=}",
        )

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {self.num_blocks})")


def _check(condition: bool, message: str) -> None:
    # An explicit raise rather than `assert`: invariant checks must also run under `python -O`.
    if not condition:
        raise AssertionError(message)
