"""A read-only copy of the KV cache's bookkeeping at one moment (host only; no JAX).

``jaxpaged.viz`` draws it; tests and notebooks read it. Nothing here refers back to the live
objects, so a snapshot stays valid while the engine keeps stepping.
"""

from __future__ import annotations

import dataclasses

from jaxpaged.core.kv_cache_manager import KVCacheManager

FREE, CACHED, REFERENCED = "free", "cached", "referenced"


@dataclasses.dataclass(frozen=True)
class KVCacheSnapshot:
    """Every device block's state and every sequence's block table.

    ``block_states[i]`` is ``"free"`` (ref count 0, no hash), ``"cached"`` (ref count 0 with a
    prefix hash: evictable, reusable by a prompt with the same prefix) or ``"referenced"``
    (ref count >= 1), the three states of ``BlockPool``'s invariant.
    """

    block_size: int
    block_states: tuple[str, ...]  # [num_blocks]
    ref_counts: tuple[int, ...]  # [num_blocks]: tables holding each block
    hashed: tuple[bool, ...]  # [num_blocks]: carries a prefix hash (cached or shareable)
    block_tables: dict[str, tuple[int, ...]]  # seq_id -> physical block ids, logical order

    @property
    def num_blocks(self) -> int:
        return len(self.block_states)

    def count(self, state: str) -> int:
        """Blocks in ``state`` (``"free"``, ``"cached"`` or ``"referenced"``)."""
        return sum(s == state for s in self.block_states)

    def shared_blocks(self, seq_a: str, seq_b: str) -> int:
        """Blocks both sequences' tables hold (prefix-cache hits or copy-on-write forks)."""
        return len(set(self.block_tables[seq_a]) & set(self.block_tables[seq_b]))


def take_snapshot(manager: KVCacheManager) -> KVCacheSnapshot:
    """Copy ``manager``'s device pool and block tables into a ``KVCacheSnapshot``."""
    pool = manager.block_pool
    states = []
    for ref_count, block_hash in zip(pool.ref_counts, pool.block_hashes, strict=True):
        if ref_count:
            states.append(REFERENCED)
        else:
            states.append(FREE if block_hash is None else CACHED)
    return KVCacheSnapshot(
        block_size=manager.block_size,
        block_states=tuple(states),
        ref_counts=tuple(pool.ref_counts),
        hashed=tuple(h is not None for h in pool.block_hashes),
        block_tables={seq_id: tuple(t) for seq_id, t in manager.block_tables.items()},
    )
