"""Several projections of the same input as one matmul (vLLM's ``QKVParallelLinear`` and
``MergedColumnParallelLinear``).

A Llama layer projects its input five times: ``q_proj``, ``k_proj``, ``v_proj`` (attention) and
``gate_proj``, ``up_proj`` (MLP). Fused into two kernels, ``qkv_proj`` and ``gate_up_proj``, a
step launches two GEMMs (GEMVs at batch 1) per layer instead of five, and at large batches the
narrow k/v GEMMs no longer underfill the GPU. At batch 1 the separate ``[1, 4096] x [4096, 1024]``
k/v projections of Llama-3-8B were worse than narrow: XLA rewrote them into multiply + reduce
fusions (k's inside the KV-cache scatter, on 16 thread blocks), 3.1 ms of a 7.6 ms step on the
H200; fused, the step runs at the weight-read floor (docs/benchmarks.md, "Where the device time
goes").

Column order. Under tensor parallelism the fused output dim is split over the ``tp`` mesh axis
(``models.sharding``), so the columns are laid out shard by shard: with ``P`` parts of output
sizes ``n_0 .. n_{P-1}`` and ``num_shards = tp``, shard ``s`` holds columns
``[part_0[s] | part_1[s] | ...]`` where ``part_p[s]`` is the ``s``-th of ``tp`` equal slices of
part ``p`` (for ``qkv_proj``: shard ``s``'s query heads, then its KV heads, then its V heads).
A plain column split then hands each device exactly its own q/k/v (gate/up), and
``num_shards = 1`` is the plain concatenation ``[q | k | v]``. ``models.weights`` and
``models.sharded_weights`` fill the columns from the separate checkpoint tensors in this order.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx


class MergedColumnParallelLinear(nnx.Linear):
    """One ``nnx.Linear`` whose output is the concatenation of several projections.

    ``kernel: [in_features, sum(output_sizes)]`` and ``bias: [sum(output_sizes)]`` (when
    ``use_bias``), columns in the per-shard order of the module docstring. Calling it returns
    the parts separately, each in its natural order: ``x [..., in_features] -> tuple of
    [..., output_sizes[p]]`` in the compute dtype.

    Args:
        in_features: the input size.
        output_sizes: the whole (all shards) output size of each part, e.g. ``(Hq * D,
            Hkv * D, Hkv * D)``; each must divide by ``num_shards``.
        num_shards: the ``tp`` size the columns are laid out for (1 without a mesh); a static
            property of the model.
        **kwargs: ``nnx.Linear``'s (``use_bias``, ``dtype``, ``param_dtype``, ``precision``,
            ``rngs``).

    Raises:
        ValueError: an output size that does not divide by ``num_shards``.
    """

    def __init__(self, in_features: int, output_sizes: Sequence[int], *, num_shards: int, **kwargs):
        check_output_sizes(output_sizes, num_shards)
        super().__init__(in_features, sum(output_sizes), **kwargs)
        self.output_sizes = tuple(int(size) for size in output_sizes)
        self.num_shards = int(num_shards)

    def __call__(  # type: ignore[override]
        self, x: jax.Array, delta: jax.Array | None = None
    ) -> tuple[jax.Array, ...]:
        """``delta`` (``[..., sum(output_sizes)]``, same column order, e.g. a LoRA update) is
        added to the fused output before it is split."""
        y = super().__call__(x)  # [..., sum(output_sizes)], shard-major columns
        if delta is not None:
            y = y + delta
        return split_merged_columns(y, self.output_sizes, self.num_shards)


def check_output_sizes(output_sizes: Sequence[int], num_shards: int) -> None:
    """Raises ValueError for an output size that does not divide by ``num_shards``."""
    for size in output_sizes:
        if size % num_shards:
            raise ValueError(
                f"output size {size} of {tuple(output_sizes)} must be divisible by "
                f"num_shards ({num_shards})"
            )


def split_merged_columns(
    y: jax.Array, output_sizes: Sequence[int], num_shards: int
) -> tuple[jax.Array, ...]:
    """The parts of a fused output ``y [..., sum(output_sizes)]`` (columns in the per-shard
    order of the module docstring), each ``[..., output_sizes[p]]`` in its natural order."""
    # [..., tp, per_shard]: the shard axis is exactly the one the tp mesh axis splits, and
    # the slices below cut only the per-shard axis, so under the SPMD partitioner every
    # device slices its own block and nothing moves between devices.
    y = y.reshape(*y.shape[:-1], num_shards, -1)
    bounds = np.cumsum([0, *(size // num_shards for size in output_sizes)])
    return tuple(
        y[..., lo:hi].reshape(*y.shape[:-2], size)
        for lo, hi, size in zip(bounds[:-1], bounds[1:], output_sizes, strict=True)
    )


def merged_column_order(output_sizes: Sequence[int], num_shards: int) -> np.ndarray:
    """``i64[sum(output_sizes)]``: for each physical column, its index in ``[part_0 | part_1 |
    ...]`` (the parts concatenated whole, as with one shard).

    The single definition of the column order of :class:`MergedColumnParallelLinear`; the
    loaders place checkpoint columns through it.
    """
    per_shard = [size // num_shards for size in output_sizes]
    offsets = np.cumsum([0, *output_sizes])
    order = [
        offsets[p] + shard * per_shard[p] + np.arange(per_shard[p])
        for shard in range(num_shards)
        for p in range(len(output_sizes))
    ]
    return np.concatenate(order).astype(np.int64)
