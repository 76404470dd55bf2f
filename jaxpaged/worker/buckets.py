"""Padding buckets for the jitted step: pure functions of explicit arguments.

Every distinct padded shape is one XLA compilation, so token counts ``T`` and sequence counts
``B`` are rounded up to a short list: powers of two from ``minimum`` up to ``gap``, then steps of
``gap`` (the scheme of tpu-inference's ``get_token_paddings``), ending exactly at the maximum.
"""

from __future__ import annotations

import bisect


def make_buckets(maximum: int, *, minimum: int = 1, gap: int = 512) -> list[int]:
    """Bucket sizes up to and including ``maximum``.

    Powers of two starting at ``minimum`` while below ``gap``, then multiples of ``gap``; the last
    bucket is ``maximum`` itself.

    Raises:
        ValueError: if ``maximum`` or ``minimum`` is below 1 or ``gap`` is not positive.
    """
    if maximum < 1 or minimum < 1 or gap < 1:
        raise ValueError(
            f"buckets need maximum, minimum, gap >= 1, got {maximum=}, {minimum=}, {gap=}"
        )
    buckets = []
    size = minimum
    while size < maximum and size < gap:
        buckets.append(size)
        size *= 2
    size = gap * ((size + gap - 1) // gap) if size >= gap else size
    while size < maximum:
        buckets.append(size)
        size += gap
    buckets.append(maximum)
    return buckets


def round_up_to_bucket(value: int, buckets: list[int]) -> int:
    """The smallest bucket that holds ``value``.

    Raises:
        ValueError: if ``value`` exceeds the largest bucket (naming both).
    """
    index = bisect.bisect_left(buckets, value)
    if index == len(buckets):
        raise ValueError(f"{value} is larger than the largest bucket ({buckets[-1]})")
    return buckets[index]
