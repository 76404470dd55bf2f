"""Block hashes: chained over the whole prefix, keyed by extra keys, computed incrementally."""

from types import SimpleNamespace

from jaxpaged.core.prefix_cache import hash_block_tokens, update_block_hashes
from jaxpaged.sequence import Sequence


def test_hash_depends_on_parent_tokens_and_extra_keys():
    base = hash_block_tokens(None, [1, 2, 3])
    assert base == hash_block_tokens(None, [1, 2, 3])
    assert len(base) == 32
    assert base != hash_block_tokens(None, [1, 2, 4])
    assert base != hash_block_tokens(hash_block_tokens(None, [0]), [1, 2, 3])
    assert base != hash_block_tokens(None, [1, 2, 3], ("lora", 7))
    assert hash_block_tokens(None, [1, 2, 3], ("lora", 7)) != hash_block_tokens(
        None, [1, 2, 3], ("lora", 8)
    )


def test_encoding_is_unambiguous_across_token_boundaries():
    # Same bytes laid out differently must not collide: [1, 2] + [3] vs [1] + [2, 3].
    a = hash_block_tokens(hash_block_tokens(None, [1, 2]), [3])
    b = hash_block_tokens(hash_block_tokens(None, [1]), [2, 3])
    assert a != b


def test_sequence_hashes_cover_full_blocks_and_grow_with_tokens():
    seq = Sequence("a", [5, 6, 7, 8, 9], SimpleNamespace())
    hashes = update_block_hashes(seq, 2)
    assert len(hashes) == 2
    assert hashes[1] == hash_block_tokens(hash_block_tokens(None, [5, 6]), [7, 8])
    seq.append_token(10)
    assert update_block_hashes(seq, 2)[:2] == hashes[:2] and len(seq.block_hashes) == 3
    other = Sequence("b", [5, 6, 7, 8, 0, 0], SimpleNamespace())
    assert update_block_hashes(other, 2)[:2] == seq.block_hashes[:2]
    assert update_block_hashes(other, 2)[2] != seq.block_hashes[2]
