"""The packed token bitmask: which tokens each row may sample.

Layout (xgrammar's and llguidance's): ``i32[B, W]`` with ``W = ceil(vocab_size / 32)``; token
``t`` is allowed in row ``b`` iff bit ``t % 32`` (least significant first) of word
``[b, t // 32]`` is 1. A row of all ones (-1) constrains nothing: unconstrained rows and
padding rows hold it. The host fills it (``fill_rows``); the jitted step masks the logits to
-inf where the bit is 0 (``apply_token_bitmask``) before the sampler and logprobs see them.
"""

from __future__ import annotations

import numpy as np

ALL_ALLOWED = -1  # every bit set


def num_words(vocab_size: int) -> int:
    """``W``: 32-bit words per row for ``vocab_size`` tokens."""
    return -(-vocab_size // 32)


def forbid(bitmask_row: np.ndarray, token_ids) -> None:
    """Clear the bits of ``token_ids`` in one host row (i32[W]), in place."""
    words = bitmask_row.view(np.uint32)
    for token in token_ids:
        words[token >> 5] &= np.uint32(~(1 << (token & 31)) & 0xFFFFFFFF)


def allowed_tokens(bitmask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool[vocab_size] of one host row (tests and debugging)."""
    bits = np.unpackbits(bitmask_row.astype("<i4").view(np.uint8), bitorder="little")
    return bits[:vocab_size].astype(bool)


def apply_token_bitmask(logits, bitmask):
    """Mask disallowed tokens to -inf, on the device.

    Args:
        logits: f32[B, vocab_size].
        bitmask: i32[B, W], ``W = ceil(vocab_size / 32)``.

    Returns:
        f32[B, vocab_size]: ``logits`` where the token's bit is 1, -inf elsewhere.
    """
    import jax.numpy as jnp

    vocab_size = logits.shape[-1]
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1  # arithmetic shift; the & keeps one bit
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :vocab_size] != 0
    return jnp.where(allowed, logits, -jnp.inf)
