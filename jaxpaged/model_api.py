"""The public surface for writing a model jaxpaged serves (``docs/model_protocol.md``).

An out-of-tree model imports only from here (and ``jax`` / ``flax``):

- :class:`AttentionMetadata`: what one step's tokens are and where their K/V live.
- :func:`paged_attention`: write this step's K/V into the layer's paged cache and attend over
  the whole context (the engine's kernels on GPU, exact plain-JAX references elsewhere).
- :class:`ModelRegistry`: ``ModelRegistry.register_model("MyArchForCausalLM", MyModel)``.
- :func:`make_forward`: a pure-JAX training forward of an engine's model
  (``logits = forward(params, token_ids)``), the same code the engine steps, for trainers whose
  rollouts come from ``LLM.generate`` and whose weights go back with ``LLM.update_weights``.

Shape letters as in ``pallas_kernels``: ``T`` tokens of a step, ``B`` sequences, ``Hq`` / ``Hkv``
query / KV heads, ``D`` head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import pallas_kernels
from jaxpaged.model_registry import ModelRegistry
from models.attention import attention, kv_cache_head_dim
from models.attention_metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "ModelRegistry", "make_forward", "paged_attention"]


def paged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    metadata: AttentionMetadata,
    *,
    scale: float,
    attention_backend: str,
    interpret: bool = False,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Causal self-attention of one step over the paged KV cache of one layer.

    Writes the step's ``k`` / ``v`` into the cache slots ``metadata.slot_mapping`` names
    (padding tokens, slot -1, are dropped), then each query attends to its sequence's context up
    to and including its own position (cached prefix plus this step's tokens).

    Args:
        q: ``[T, Hq, D]`` queries, RoPE already applied.
        k, v: ``[T, Hkv, D]`` this step's keys (RoPE applied) and values; ``Hq % Hkv == 0``.
        k_cache, v_cache: this layer's cache, as the model received it (``[num_blocks,
            block_size, Hkv, D_cache]``; ``D_cache`` is ``D`` padded to a power of two with the
            Pallas backend, which this function handles).
        metadata: the step's ``AttentionMetadata``, as the model received it.
        scale: multiplier of ``q . k`` (usually ``D ** -0.5``).
        attention_backend: the value the engine gave the model's constructor.
        interpret: likewise (Pallas interpret mode on CPU).
        sliding_window: a query at position ``p`` sees keys ``p - w < key <= p``; None: all.
        soft_cap: scores become ``soft_cap * tanh(scores / soft_cap)``; None: off.

    Returns:
        ``(out [T, Hq, D] in q's dtype, k_cache, v_cache)``: return the updated caches from the
        model's ``__call__`` (the engine donates them to every step). Rows of padding tokens
        are unspecified.
    """
    head_dim = q.shape[-1]
    cache_head_dim = kv_cache_head_dim(head_dim, attention_backend)
    if cache_head_dim != head_dim:  # zero columns add nothing to q . k; cut off after
        pad = ((0, 0), (0, 0), (0, cache_head_dim - head_dim))
        q, k, v = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
    k_cache, v_cache = pallas_kernels.kv_cache_update(k_cache, v_cache, k, v, metadata.slot_mapping)
    out = attention(
        q,
        k_cache,
        v_cache,
        metadata,
        backend=attention_backend,
        scale=scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        interpret=interpret,
    )
    return out[..., :head_dim].astype(q.dtype), k_cache, v_cache


def make_forward(llm) -> Callable[[Any, jax.Array], jax.Array]:
    """A pure-JAX forward of ``llm``'s model for training: ``forward(params, token_ids) ->
    f32[B, S, vocab_size]``, the logits after each of the ``S`` tokens of each of ``B`` rows.

    ``params`` has ``llm.get_weights()``'s structure (what ``llm.update_weights`` takes). The
    model is the engine's own class and config, built with the plain-JAX attention references
    (differentiable; the Pallas kernels have no gradients), and run as one prefill of every row
    over a scratch KV cache: jit it, differentiate it, vmap nothing.

    Raises:
        ValueError: ``llm``'s engine uses tensor parallelism (a training forward here is for
            one device).
    """
    from flax import nnx

    from models.memory_weights import flatten_own_layout
    from models.registry import get_model_class
    from models.weights import abstract_model

    engine = llm.llm_engine
    if engine.config.parallel_config.tensor_parallel_size > 1:
        raise ValueError("make_forward needs tensor_parallel_size 1")
    hf_config, dtype = engine.worker.hf_config, engine.worker.dtype
    model = abstract_model(
        get_model_class(hf_config),
        hf_config,
        dtype,
        attention_backend="reference",
        interpret=False,
        seed=0,
    )
    graphdef, state = nnx.split(model)
    treedef = jax.tree.structure(state)
    paths = list(flatten_own_layout(state))
    num_layers = int(hf_config.num_hidden_layers)
    num_kv_heads = int(
        getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    )
    head_dim = int(
        getattr(hf_config, "head_dim", None)
        or hf_config.hidden_size // hf_config.num_attention_heads
    )

    def forward(params, token_ids: jax.Array) -> jax.Array:
        flat = flatten_own_layout(params)
        missing = [p for p in paths if p not in flat]
        if missing:
            raise ValueError(f"params lack {'.'.join(map(str, missing[0]))}")
        module = nnx.merge(graphdef, jax.tree.unflatten(treedef, [flat[p] for p in paths]))
        num_rows, length = token_ids.shape
        # Row b is block b of a scratch cache whose blocks hold a whole row.
        shape = pallas_kernels.kv_cache_shape(num_rows, length, num_kv_heads, head_dim)
        caches = [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(num_layers)]
        metadata = AttentionMetadata(
            slot_mapping=jnp.arange(num_rows * length, dtype=jnp.int32),
            block_tables=jnp.arange(num_rows, dtype=jnp.int32)[:, None],
            seq_lens=jnp.full((num_rows,), length, jnp.int32),
            cu_q_lens=jnp.arange(num_rows + 1, dtype=jnp.int32) * length,
            decode_only=False,
        )
        positions = jnp.tile(jnp.arange(length, dtype=jnp.int32), num_rows)
        hidden, _ = module(token_ids.reshape(-1).astype(jnp.int32), positions, caches, metadata)
        logits = module.compute_logits(hidden).astype(jnp.float32)
        return logits.reshape(num_rows, length, -1)

    return forward
