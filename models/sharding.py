"""Tensor parallelism: the ``tp`` mesh, how each tensor splits over it, and attention per shard.

One model runs on ``tensor_parallel_size`` devices through XLA's SPMD partitioner (``jax.jit``
with ``NamedSharding``d inputs; Megatron-LM's layout, Shoeybi et al. 2019, arXiv:1909.08053):

- column-parallel (output dim split): the fused ``qkv_proj`` and ``gate_up_proj`` and their
  biases (Qwen2's q/k/v biases split with their columns). Their columns are laid out shard by
  shard (``models.merged_linear``: ``[q_0 | k_0 | v_0 | q_1 | ...]``, ``[gate_0 | up_0 | ...]``),
  so the plain column split gives each device its own query heads, KV heads and MLP slice;
- row-parallel (input dim split): ``o_proj``, ``down_proj``; XLA inserts the all-reduce after
  them, and their biases (if any) are replicated, added once after the reduction;
- vocab-parallel: ``embed_tokens`` (rows) and ``lm_head`` (columns); replicated when the vocab
  does not divide by ``tensor_parallel_size`` (a valid, only costlier layout);
- MoE experts (``models.moe``): every device holds every expert's ``I / tp`` slice:
  ``experts.gate_up_proj [E, hidden, 2I]`` split on its last axis (columns shard by shard),
  ``experts.down_proj [E, I, hidden]`` on its middle one; the router ``gate`` is replicated;
- norms (weights, LayerNorm biases) and GPT-2's learned position embedding replicated; the
  ungated MLP's ``up_proj`` (GPT-2, BLOOM) column-parallel like ``gate_up_proj``; KV caches
  split over their ``Hkv`` axis (located through
  ``pallas_kernels.kv_cache_shape``, which owns the layout);
- attention (reference or Pallas) runs per shard inside ``jax.shard_map`` over the heads: each
  device holds whole query heads and the KV heads they read, so it needs no communication.

Fewer KV heads than devices (``Hkv < tp``, e.g. Llama-3-70B's 8 on 16 devices): each KV head is
repeated ``tp // Hkv`` times (``repeat_interleave`` order: ``kv0, kv0, kv1, kv1, ...``), as
tpu-inference and vLLM do, so that every device holds exactly one KV head, the one its query
heads read. Query head ``h`` reads repeated head ``h // (Hq / (Hkv * r))``, which is original
head ``h // (Hq / Hkv)``: the model is unchanged, only the k and v columns of ``qkv_proj`` hold
``r`` copies of each head and the KV cache holds ``Hkv * r`` heads (``r`` times the memory a
single device would need, split ``tp`` ways). An intermediate size that does not divide is
padded with zero gate and up columns and zero down rows, which add exactly nothing.

The physical model is built from :func:`tp_model_config` (the HF config with the repeated KV
head count and padded intermediate size); ``models.sharded_weights`` maps checkpoint tensors
onto it. Shape letters as in ``pallas_kernels``.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_kernels
from models.tp_layout import TPLayout

TP_AXIS = "tp"

# up_proj: the ungated MLP's first projection (GPT-2, BLOOM; models.gpt2).
_COLUMN_PARALLEL = frozenset({"qkv_proj", "gate_up_proj", "up_proj"})
_ROW_PARALLEL = frozenset({"o_proj", "down_proj"})


def make_mesh(tensor_parallel_size: int) -> Mesh:
    """A one-axis mesh ``("tp",)`` over the first ``tensor_parallel_size`` devices.

    ``jax.devices()`` lists every process's devices (multi-controller JAX, after
    ``jax.distributed.initialize``), so the mesh may span hosts. The axis is ``Auto``: XLA
    places the collectives (the all-reduce after row-parallel matmuls).

    Raises:
        ValueError: ``tensor_parallel_size`` is below 1 or larger than the number of devices.
    """
    devices = jax.devices()
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {tensor_parallel_size}")
    if tensor_parallel_size > len(devices):
        raise ValueError(
            f"tensor_parallel_size ({tensor_parallel_size}) is larger than the number of "
            f"{devices[0].platform} devices ({len(devices)})"
        )
    return jax.make_mesh(
        (tensor_parallel_size,),
        (TP_AXIS,),
        axis_types=(AxisType.Auto,),
        devices=devices[:tensor_parallel_size],
    )


def tp_size(mesh: Mesh | None) -> int:
    """The size of ``mesh``'s ``tp`` axis; 1 without a mesh (one device)."""
    return 1 if mesh is None else mesh.shape[TP_AXIS]


def tp_model_config(hf_config: Any, layout: TPLayout) -> Any:
    """A copy of ``hf_config`` describing the physical sharded model: ``num_key_value_heads``
    is ``Hkv * r`` and ``intermediate_size`` is padded (see the module docstring)."""
    config = copy.deepcopy(hf_config)
    config.num_key_value_heads = layout.num_kv_heads_physical
    config.intermediate_size = layout.intermediate_size_padded
    return config


def param_partition_spec(path: tuple, layout: TPLayout) -> P:
    """Partition spec of an NNX parameter (kernels ``[in, out]``, embeddings ``[vocab, hidden]``).

    Args:
        path: the NNX state path, e.g. ``('model', 'layers', 0, 'self_attn', 'qkv_proj', 'kernel')``.
        layout: the model's layout.

    Raises:
        ValueError: a parameter without a rule (a new module must be given one deliberately).
    """
    module, leaf = str(path[-2]), str(path[-1])
    if module in _COLUMN_PARALLEL:
        return P(None, TP_AXIS) if leaf == "kernel" else P(TP_AXIS)
    if module in _ROW_PARALLEL:
        return P(TP_AXIS, None) if leaf == "kernel" else P()
    if module == "experts":  # stacked [E, in, out]: gate_up column-, down row-parallel
        return P(None, None, TP_AXIS) if leaf == "gate_up_proj" else P(None, TP_AXIS, None)
    if module == "gate":  # the MoE router [hidden, E]: small, every device routes every token
        return P()
    if module == "embed_tokens":
        return P(TP_AXIS, None) if layout.shard_vocab else P()
    if module == "lm_head":
        return P(None, TP_AXIS) if layout.shard_vocab else P()
    if leaf == "weight":  # RMSNorm (also Qwen3's q_norm / k_norm), LayerNorm
        return P()
    if module == "embed_positions" or (leaf == "bias" and module.endswith("norm")):
        return P()  # GPT-2's learned positions, LayerNorm biases (models.gpt2)
    raise ValueError(f"no tensor-parallel rule for parameter {'.'.join(str(p) for p in path)}")


def lora_partition_specs(projection: str) -> tuple[P, P]:
    """Specs of a LoRA adapter's ``(A [in, S * C], B [S * C, out])`` on projection
    ``projection`` (``models.lora``), consistent with the base layer's split:

    - column-parallel (``qkv_proj``, ``gate_up_proj``): A replicated, B split along ``out``
      like the kernel's columns, so each device computes the whole shrink ``x A`` (``S * C``
      columns, small) and its own output columns of the update;
    - row-parallel (``o_proj``, ``down_proj``): A split along ``in`` like the kernel's rows, B
      replicated; the shrink's partial sums are reduced over ``tp`` as the base output is.
      The two reductions are independent, so XLA's all-reduce combiner issues them as one
      collective (one tuple all-reduce in the compiled HLO on CPU).

    Raises:
        ValueError: a projection that is neither (no LoRA rule).
    """
    if projection in _COLUMN_PARALLEL:
        return P(), P(None, TP_AXIS)
    if projection in _ROW_PARALLEL:
        return P(TP_AXIS, None), P()
    raise ValueError(f"no tensor-parallel LoRA rule for projection {projection!r}")


def parallel_style(module: str) -> str | None:
    """``"column"`` / ``"row"`` for a (fused) projection module name, None for anything else."""
    if module in _COLUMN_PARALLEL:
        return "column"
    if module in _ROW_PARALLEL:
        return "row"
    return None


def quantized_partition_spec(module: str, method: Any, name: str, shape: tuple[int, ...]) -> P:
    """Partition spec of tensor ``name`` (``qweight``, ``scales``, ``weight``, ...) of the
    quantized projection ``module``: ``"tp"`` on the axis ``method.split_axis(name, style,
    shape)`` gives (``models.quantization.tp_split``), None = replicated.

    Raises:
        ValueError: a module that is neither column- nor row-parallel; what ``split_axis``
            raises (an unknown tensor, a sorted act-order ``perm`` in a row-parallel layer).
    """
    style = parallel_style(module)
    if style is None:
        raise ValueError(f"no tensor-parallel rule for quantized module {module!r}")
    axis = method.split_axis(name, style, tuple(shape))
    return P(*[TP_AXIS if a == axis else None for a in range(len(shape))])


@functools.cache
def kv_cache_partition_spec() -> P:
    """Spec of one layer's K (or V) cache: split over the ``Hkv`` axis of ``kv_cache_shape``.

    The axis is found by asking ``pallas_kernels.kv_cache_shape`` for a shape with distinct
    sizes, so a change of cache layout in the kernels needs no change here.

    Raises:
        ValueError: the layout has no separate ``Hkv`` axis (e.g. K and V fused on one axis).
    """
    probe = pallas_kernels.kv_cache_shape(num_blocks=2, block_size=3, num_kv_heads=5, head_dim=7)
    if list(probe).count(5) != 1:
        raise ValueError(
            f"cannot find the Hkv axis in the KV cache layout {probe} (probe Hkv=5); "
            "tensor parallelism needs a cache with one axis of KV heads"
        )
    return P(*[TP_AXIS if size == 5 else None for size in probe])


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of one layer's K (or V) cache on ``mesh``."""
    return NamedSharding(mesh, kv_cache_partition_spec())


def shard_over_heads(fn: Callable, mesh: Mesh) -> Callable:
    """``fn(q, k_cache, v_cache, metadata) -> out`` run per device on its heads.

    ``q``/``out`` are ``[T, Hq, D]`` split over ``Hq``; the caches split over ``Hkv`` as
    :func:`kv_cache_partition_spec`; ``metadata`` (any pytree) is replicated. Each device sees
    ``Hq / tp`` query heads and the ``Hkv * r / tp`` KV heads they read, so ``fn`` is the
    single-device attention unchanged. ``check_vma=False``: the kernels are opaque to JAX's
    replication checker.
    """
    q_spec = P(None, TP_AXIS, None)
    kv_spec = kv_cache_partition_spec()
    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec, P()),
        out_specs=q_spec,
        check_vma=False,
    )
