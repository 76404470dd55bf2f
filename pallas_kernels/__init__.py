"""Paged-attention kernels for jaxpaged, each with a plain-JAX reference.

Shape letters used in every docstring, comment and variable name of the project:

- ``B``: sequences in a step (padded to a batch bucket).
- ``T``: tokens in a step (padded to a token bucket).
- ``Hq`` / ``Hkv``: query heads / key-value heads (``Hq % Hkv == 0``; GQA group ``G = Hq // Hkv``).
- ``D``: head dimension.
- ``block_size``: tokens per KV block; ``num_blocks``: blocks in the cache;
  ``max_blocks``: block-table columns per sequence (``ceil(max_model_len / block_size)``).

KV cache layout (owned here; everything else sees only block ids and slots): one K and one V
array per layer, each ``[num_blocks, block_size, Hkv, D]`` as in vLLM. A *slot* is
``block_id * block_size + offset``; slot ``-1`` marks padding and is never written.

Both attention kernels run the same block step (scores, soft cap, ALiBi bias, mask, online
softmax, P.V) from ``pallas_kernels.online_softmax``, which also holds their shared argument
checks; each kernel keeps its own program-to-rows mapping and visibility rules.

Contract shared by all kernels: positions at or past a sequence's ``seq_len`` hold stale data
(possibly NaN) and are never allowed to influence the result; block-table entries past
``ceil(seq_len / block_size)`` are arbitrary valid block ids.
"""

from pallas_kernels.kv_cache_update import kv_cache_shape, kv_cache_update
from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
from pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

__all__ = [
    "kv_cache_shape",
    "kv_cache_update",
    "paged_attention",
    "paged_attention_reference",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
]
