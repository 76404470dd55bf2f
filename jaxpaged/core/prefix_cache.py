"""Block hashes for automatic prefix caching (host only; no JAX).

A *full* block is identified by everything that determines its K/V: the tokens before it and its
own tokens, plus extra keys such as a LoRA id. As in vLLM, the hash of block i chains the hash of
block i-1: `hash(parent_hash, token ids of block i, extra keys)`, so equal hashes mean equal
prefixes, and a prompt's cached prefix is the longest run of its block hashes found in the cache.
Only full blocks are hashed: a partly filled block is still being written.

The hash is SHA-256 over an unambiguous byte encoding (vLLM's `sha256` option). Python's builtin
`hash` would be faster but is 64 bits and easy to collide on purpose, which would let one prompt
read another's K/V.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence as SequenceABC

BlockHash = bytes


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: SequenceABC[int], extra_keys: tuple = ()
) -> BlockHash:
    """Hash of one full block given its parent's hash (None for the first block).

    Returns a 32-byte digest. `extra_keys` must have a stable `repr` (ints, strings, tuples).
    """
    digest = hashlib.sha256()
    parent = parent_hash or b""
    # Length prefixes keep the encoding unambiguous: no two inputs share a byte string.
    digest.update(len(parent).to_bytes(1, "little"))
    digest.update(parent)
    tokens = array("q", token_ids).tobytes()
    digest.update(len(tokens).to_bytes(8, "little"))
    digest.update(tokens)
    if extra_keys:
        digest.update(repr(tuple(extra_keys)).encode())
    return digest.digest()


def update_block_hashes(seq, block_size: int) -> list[BlockHash]:
    """Extend `seq.block_hashes` to cover every full block of `seq.token_ids`; return the list.

    Token lists only grow at the end, so hashes already computed stay valid and each block is
    hashed once in the sequence's life.
    """
    hashes = seq.block_hashes
    tokens = seq.token_ids
    for index in range(len(hashes), len(tokens) // block_size):
        parent = hashes[-1] if hashes else None
        start = index * block_size
        hashes.append(
            hash_block_tokens(parent, tokens[start : start + block_size], seq.block_hash_extra_keys)
        )
    return hashes
