"""Sparse mixture-of-experts MLP (Mixtral; Jiang et al. 2024, arXiv:2401.04088).

Each token's router logits pick its top ``k`` of ``E`` experts; the token's output is the sum of
those experts' SwiGLU MLPs weighted by the softmax of its ``k`` chosen logits (HF
``MixtralTopKRouter``: softmax over all ``E``, top ``k``, renormalised to sum 1 — the same
numbers). The expert matmuls are *grouped*: the ``T * k`` (token, expert) pairs are sorted by
expert and ``pallas_kernels.grouped_matmul`` multiplies each expert's contiguous run of rows by
that expert's weights: ``"mosaic_gpu"`` (a Hopper grouped GEMM doing the chosen experts' work
only) when the model runs the Pallas kernels compiled for a GPU in bf16/f16, else ``"xla"``
(``jax.lax.ragged_dot``: exact everywhere, but XLA expands it densely, ``E`` times the FLOPs).
At decode sizes (``T * k <= DECODE_MAX_ROWS``) the GPU path is ``"gemv"`` instead
(``pallas_kernels.expert_gemv``: rows unsorted, each times its own expert, only the chosen
experts' weights read; the grouped GEMM reads all ``E``). ``experts_backend`` is the one place
that picks per static row count.

Parameters (HF names in ``models.weights``; Mixtral's checkpoint keeps one tensor per expert):

- ``gate``: the router, an ``nnx.Linear`` ``[hidden, E]`` without bias.
- ``experts.gate_up_proj``: ``[E, hidden, 2 * I]``, each expert's ``w1`` (gate) and ``w3`` (up)
  columns laid out shard by shard like ``models.merged_linear`` (``[gate_0 | up_0 | gate_1 |
  ...]`` over ``num_shards``).
- ``experts.down_proj``: ``[E, I, hidden]`` (``w2``).

Tensor parallelism (vLLM's default for ``FusedMoE``): every device holds all ``E`` experts,
each cut to its ``I / tp`` slice (``gate_up_proj`` split on its last axis, ``down_proj`` on its
middle one), routes every token itself (the router is replicated) and runs the grouped matmuls
on its slice inside ``jax.shard_map``; one ``psum`` adds the partial outputs, as the all-reduce
after a row-parallel ``down_proj``. Balanced by construction, whatever the routing.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from models.sharding import TP_AXIS, tp_size
from pallas_kernels.expert_gemv import expert_gemv
from pallas_kernels.grouped_matmul import grouped_matmul

EXPERT_BACKENDS = ("xla", "mosaic_gpu", "gemv")
# Routed rows (T * k) at or below which the GPU path reads only the chosen experts (Mixtral,
# k = 2: decode batches up to 16 tokens). H200, whole MoE layer, gemv vs grouped GEMM: T=1
# 0.203 vs 1.463 ms, T=4 0.517 vs 1.453, T=16 0.685 vs 1.251 (benchmarks/results/
# h200-round7-2026-12-01/call2/moe_sweep.log); larger T was not timed for gemv, so it stops here.
DECODE_MAX_ROWS = 32


def experts_backend(backend: str, num_rows: int) -> str:
    """The expert matmuls' backend for ``num_rows = T * k`` routed rows (static at trace time):
    ``"mosaic_gpu"`` becomes ``"gemv"`` at ``num_rows <= DECODE_MAX_ROWS``; others unchanged."""
    if backend == "mosaic_gpu" and num_rows <= DECODE_MAX_ROWS:
        return "gemv"
    return backend


def route(router_logits: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """Top-``k`` routing of ``router_logits [T, E]``.

    Returns:
        ``(weights f32[T, k], expert_ids i32[T, k])``: the softmax probabilities of the chosen
        experts renormalised to sum 1 per token (HF ``MixtralTopKRouter``), largest first.
    """
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, expert_ids = jax.lax.top_k(probs, top_k)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, expert_ids.astype(jnp.int32)


def grouped_swiglu(
    x: jax.Array,
    weights: jax.Array,
    expert_ids: jax.Array,
    gate_up: jax.Array,
    down: jax.Array,
    *,
    precision: jax.lax.Precision | None,
    backend: str = "xla",
    interpret: bool = False,
) -> jax.Array:
    """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` with grouped matmuls.

    Args:
        x: ``[T, hidden]``.
        weights: ``f32[T, k]``; expert_ids: ``i32[T, k]`` in ``[0, E)``.
        gate_up: ``[E, hidden, 2 * I]``, gate columns then up columns (one shard's slice).
        down: ``[E, I, hidden]``.
        precision: of the matmuls (``"xla"``; the Pallas kernels accumulate in float32).
        backend: ``"xla"`` / ``"mosaic_gpu"`` (``pallas_kernels.grouped_matmul``, rows sorted
            by expert) or ``"gemv"`` (``pallas_kernels.expert_gemv``, rows unsorted); what runs,
            as given (``experts_backend`` chooses).
        interpret: of ``"gemv"`` (CPU tests).

    Returns:
        ``[T, hidden]`` in ``x``'s dtype (a partial sum under tensor parallelism).
    """
    num_tokens, top_k = expert_ids.shape
    num_experts = gate_up.shape[0]
    if backend == "gemv":
        flat_experts = expert_ids.reshape(-1)  # [T * k], (token, slot) order
        rows = jnp.repeat(x, top_k, axis=0)
        gemv = functools.partial(expert_gemv, interpret=interpret)
        gate, up = jnp.split(gemv(rows, flat_experts, gate_up), 2, axis=-1)
        y = gemv(jax.nn.silu(gate) * up, flat_experts, down).reshape(num_tokens, top_k, -1)
        out = jnp.einsum("tkh,tk->th", y.astype(jnp.float32), weights, precision=precision)
        return out.astype(x.dtype)
    if backend not in EXPERT_BACKENDS:
        raise ValueError(f"grouped_swiglu backend must be one of {list(EXPERT_BACKENDS)}, "
                         f"got {backend!r}")  # fmt: skip
    flat_experts = expert_ids.reshape(-1)  # [T * k], (token, slot) order
    # Stable sort by expert: each expert's rows become one contiguous group, as ragged_dot needs.
    order = jnp.argsort(flat_experts, stable=True)
    group_sizes = jnp.bincount(flat_experts, length=num_experts).astype(jnp.int32)
    rows = x[order // top_k]  # [T * k, hidden], expert-major
    matmul = functools.partial(grouped_matmul, backend=backend, precision=precision)
    h = matmul(rows, gate_up, group_sizes)  # [T * k, 2 * I]
    gate, up = jnp.split(h, 2, axis=-1)
    y = matmul(jax.nn.silu(gate) * up, down, group_sizes)
    # Back to (token, slot) order through the inverse permutation (a gather, no scatter-add).
    y = y[jnp.argsort(order)].reshape(num_tokens, top_k, -1)
    out = jnp.einsum("tkh,tk->th", y.astype(jnp.float32), weights, precision=precision)
    return out.astype(x.dtype)


class MoEExperts(nnx.Module):
    """The stacked expert weights: ``gate_up_proj [E, hidden, 2 * I]``, ``down_proj [E, I,
    hidden]`` (``gate_up_proj`` columns shard by shard over ``num_shards``, see the module
    docstring). Initialised ``normal * 0.02``; ``models.weights`` replaces the values."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        *,
        num_shards: int,
        param_dtype: Any,
        rngs: nnx.Rngs,
    ):
        if intermediate % num_shards:
            raise ValueError(
                f"intermediate_size ({intermediate}) must be divisible by num_shards ({num_shards})"
            )
        init = nnx.initializers.normal(0.02)
        self.gate_up_proj = nnx.Param(
            init(rngs.params(), (num_experts, hidden, 2 * intermediate), param_dtype)
        )
        self.down_proj = nnx.Param(
            init(rngs.params(), (num_experts, intermediate, hidden), param_dtype)
        )
        self.num_shards = int(num_shards)


class SparseMoeBlock(nnx.Module):
    """Top-``k`` sparse MoE with SwiGLU experts: ``[T, hidden] -> [T, hidden]``.

    Named ``block_sparse_moe`` in the decoder layer, as in Mixtral's checkpoints.

    Args:
        config: HF config with ``num_local_experts`` (``E``), ``num_experts_per_tok`` (``k``),
            ``hidden_size``, ``intermediate_size`` (``I``, per expert).
        mesh: tensor parallelism (module docstring); None on one device.
        backend: "xla" or "mosaic_gpu" (``pallas_kernels.grouped_matmul``); "mosaic_gpu"
            runs as "gemv" at decode sizes (``experts_backend``).

    Raises:
        ValueError: ``k`` outside ``[1, E]``.
    """

    def __init__(
        self,
        config: Any,
        *,
        dtype: Any,
        param_dtype: Any,
        precision: jax.lax.Precision,
        mesh: Mesh | None,
        backend: str = "xla",
        rngs: nnx.Rngs,
    ):
        self.num_experts = int(config.num_local_experts)
        self.top_k = int(config.num_experts_per_tok)
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, num_local_experts={self.num_experts}], "
                f"got {self.top_k}"
            )
        self.dtype = dtype
        self.precision = precision
        self.backend = backend
        self.mesh = mesh
        self.gate = nnx.Linear(
            config.hidden_size,
            self.num_experts,
            use_bias=False,
            dtype=dtype,
            param_dtype=param_dtype,
            precision=precision,
            rngs=rngs,
        )
        self.experts = MoEExperts(
            self.num_experts,
            config.hidden_size,
            config.intermediate_size,
            num_shards=tp_size(mesh),
            param_dtype=param_dtype,
            rngs=rngs,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        weights, expert_ids = route(self.gate(x), self.top_k)
        backend = experts_backend(self.backend, x.shape[0] * self.top_k)
        gate_up = self.experts.gate_up_proj[...].astype(self.dtype)
        down = self.experts.down_proj[...].astype(self.dtype)
        x = x.astype(self.dtype)

        def experts(x, weights, expert_ids, gate_up, down):
            return grouped_swiglu(
                x,
                weights,
                expert_ids,
                gate_up,
                down,
                precision=self.precision,
                backend=backend,
            )

        if self.mesh is None:
            return experts(x, weights, expert_ids, gate_up, down)

        def per_device(x, weights, expert_ids, gate_up, down):
            return jax.lax.psum(experts(x, weights, expert_ids, gate_up, down), TP_AXIS)

        return jax.shard_map(
            per_device,
            mesh=self.mesh,
            in_specs=(P(), P(), P(), P(None, None, TP_AXIS), P(None, TP_AXIS, None)),
            out_specs=P(),
            check_vma=False,
        )(x, weights, expert_ids, gate_up, down)
