"""How many K splits a GEMV-shaped kernel launches (``expert_gemv``, ``w8_gemv``).

At decode sizes a kernel tiled over its output alone launches too few programs to keep the GPU's
SMs busy (Llama-3-8B's 4096 outputs in 64-wide tiles: 64 programs for 132 SMs). Splitting the
reduction axis K into float32 partials, summed afterwards, multiplies the programs.
"""

from __future__ import annotations

from jax.experimental import pallas as pl

# Programs worth launching: two per SM of an H100/H200 (132 SMs); split_k=None aims for this.
TARGET_PROGRAMS = 264


def split_k_count(requested: int | None, block_k: int, k: int, n_programs: int) -> int:
    """K splits for a grid of ``n_programs`` output tiles over a reduction of ``k`` in steps of
    ``block_k``: ``requested`` (clipped to ``1 .. cdiv(k, block_k)``), or for None the smallest
    power of two that gives about :data:`TARGET_PROGRAMS` programs, at most ``k / (4 *
    block_k)`` (each split keeps at least four steps)."""
    if requested is not None:
        return max(1, min(requested, pl.cdiv(k, block_k)))
    split, most = 1, max(1, k // (4 * block_k))
    while split * 2 <= most and n_programs * split < TARGET_PROGRAMS:
        split *= 2
    return split
