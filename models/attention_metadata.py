"""The attention metadata pytree that every jitted step receives.

Built on the host in numpy by ``jaxpaged.worker.model_runner`` and transferred once per step.
Shape letters are defined in ``pallas_kernels``.
"""

from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Per-step description of where each token's K/V go and which KV each query reads.

    Tokens are packed sequence after sequence on one axis (``T``); sequence ``b`` owns tokens
    ``cu_q_lens[b]:cu_q_lens[b+1]``, which are the *last* ``q_len`` positions of its context,
    so token ``t`` of sequence ``b`` sits at position ``seq_lens[b] - q_len_b + (t - cu_q_lens[b])``
    and attends causally to positions ``<=`` its own.
    """

    # i32[T]: cache slot (block_id * block_size + offset) of each token's new K/V; -1 on padding.
    slot_mapping: jax.Array
    # i32[B, max_blocks]: physical block ids per sequence; padding rows/columns hold 0.
    block_tables: jax.Array
    # i32[B]: context length of each sequence *including* this step's tokens; 0 on padding rows.
    seq_lens: jax.Array
    # i32[B + 1]: prefix sums of per-sequence query lengths; padding rows repeat the last value.
    cu_q_lens: jax.Array
    # Static: True when every sequence has exactly one new token and T == B, so the decode
    # kernel (q [B, Hq, D]) serves the step. No default: a default would silently pick a kernel.
    decode_only: bool = dataclasses.field(metadata=dict(static=True))
