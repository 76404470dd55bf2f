"""LoRA inside the step: each token adds its own adapter's low-rank update to a projection.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685)
replaces a frozen projection ``y = x W`` by ``y = x W + (x A) B * scale`` with ``A [in, r]``,
``B [r, out]``. Serving many adapters at once (S-LoRA, Punica's BGMV/SGMV) gives every token of a
step its own adapter. Here ``S = max_loras`` adapters sit in fixed device *slots*; per projection
the slots are stacked along the rank axis, each padded to ``C = P * max_lora_rank`` columns
(``P`` parts of a fused projection: 3 for ``qkv_proj``, 2 for ``gate_up_proj``, else 1)::

    a: [in, S * C]     slot s owns columns s*C .. (s+1)*C-1   (part p: its p-th max_lora_rank block)
    b: [S * C, out]    slot s owns rows    s*C .. (s+1)*C-1   (block-diagonal over the parts;
                       ``scale`` already multiplied in; out columns in the fused kernel's order)

and a step computes, for all tokens at once,

    h = x @ a                      [T, S * C]   (every slot's shrink; cheap: S * C is small)
    h = h * (slot(t) == slot(column))           (keep each token's own slot; -1 keeps nothing)
    y += h @ b                     [T, out]

This is the *dense* path. The other, *gather* (BGMV-style), gathers each token's own ``A``
and ``B`` first (``a.reshape(in, S, C)[:, slot(t), :]``), so it reads ``T`` slots' weights
instead of all ``S``, but as strided gathers over the large ``in`` axis, separate small kernels
for every projection of every layer. Which path a step takes is one static policy,
:func:`lora_path` (``T`` is a compiled shape): gather only for steps of at most
:data:`LORA_GATHER_MAX_TOKENS` tokens, and only with fewer tokens than slots. The dense path
reads all ``S`` slots (at Llama-3-8B sizes, 8 x rank 16: ~7% more weight bytes per layer) in
two plain matmuls, the first of which shares its input ``x`` with the base projection's (XLA may
schedule or merge the two sibling dots); on the H200 the batch-1 decode overhead with the gather
path below ``S`` tokens was +86%, so the gather is off by default until
``benchmarks/lora_layer.py`` shows where it wins. Either way the shapes (``in``,
``S * C``) never depend on which adapters are loaded, so loading, swapping or unloading an
adapter only writes slot values and never changes a compiled shape. Zero-padded rank columns
and unused slots contribute exact zeros. The cost grows with ``max_loras * max_lora_rank``,
not with the batch's adapters (``benchmarks/lora.sh`` measures the step cost).

A third path, *bgmv*, is one fused Pallas kernel per projection
(``pallas_kernels.lora_bgmv``: shrink, per-token slot select and expand in one launch, reading
only the slots the step's tokens use), meant for batch-1 decode, where the dense path's cost is
its ~8 small dependent kernels per layer rather than bytes. The policy takes it only on a GPU
and only for steps of at most :data:`LORA_KERNEL_MAX_TOKENS` tokens; 0 by default, because its
GPU speed is unmeasured (``benchmarks/lora_layer.py`` has its column). Elsewhere it
runs only when asked for (``path="bgmv"``), in Pallas interpret mode (tests). It is written for
one device: under tensor parallelism XLA cannot split the kernel and would gather its operands.

A fourth layout, *fold*, stores the shrink inside the base projection's GEMM: the slot
columns of ``a`` are appended to the base kernel ``W [in, out]``, one array
``[W | a] [in, out + S * C]`` (:attr:`LoRAWeights.base_columns` = ``out``), and a step computes

    y = x @ [W | a]                [T, out + S * C]   (base output and every slot's shrink)
    h = y[:, out:] * (slot(t) == slot(column))
    y = y[:, :out] (+ bias) + h @ b

so batch-1 decode runs two GEMMs per projection (the wide base GEMM, the expand with the base
output added to it) and one small elementwise fusion (slice and mask) instead of the dense
path's separate shrink. The folded kernel is the only copy of ``W``: at start-up
(``jaxpaged.lora.manager.create_lora_manager``) the slots take the kernels over from the model
(:func:`take_fold_kernels`), whose own kernel becomes an empty ``[in, 0]`` placeholder, and slot
writes fill and zero the columns ``out + s*C ..`` only, never changing a shape. It is a start-up
choice (:func:`lora_fold`), not a per-step one: on one device (``tp == 1``; a row-parallel
``[W | a]`` would need its sum split from its columns) with every adapted projection
unquantized (a quantized kernel cannot take float columns), when :data:`LORA_FOLD` is on (off
by default: see there); else the slots keep their own ``a`` and the steps take
:func:`lora_path`'s choice.
``benchmarks/lora_layer.py``'s ``+fold`` column measures it against the others.

Shape letters as in ``pallas_kernels``; ``S`` = ``max_loras``, ``C`` = columns per slot.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.merged_linear import split_merged_columns
from models.platform import target_platform
from pallas_kernels.lora_bgmv import lora_bgmv

# Fused projection -> the HF module names of its parts, in the fused kernel's part order
# (``models.merged_linear``). These are the seven target modules LoRA may adapt.
LORA_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


# The step's LoRA path policy (see the module docstring and :func:`lora_path`): steps of at most
# this many tokens, and fewer tokens than slots, gather each token's A and B (BGMV); all others
# take the dense path. 0: always dense. Read while tracing (T is a compiled shape), so it only
# affects steps compiled after a change.
LORA_GATHER_MAX_TOKENS = 0

# Steps of at most this many tokens take the fused Pallas kernel (``"bgmv"``) when the default
# backend is a GPU; it is checked before the gather rule. 0: never (the default until
# ``benchmarks/lora_layer.py``'s ``+bgmv`` column is measured on the H200). Read
# while tracing, like ``LORA_GATHER_MAX_TOKENS``.
LORA_KERNEL_MAX_TOKENS = 0

LORA_PATHS = ("dense", "gather", "bgmv")

# Start-up policy (:func:`lora_fold`): fold the LoRA shrink into the base GEMMs where the layout
# allows (one device, unquantized projections). Read when the LoRA slots are created. Off: in its
# first H200 run (Llama-3-8B, max_num_seqs 1024, gpu_memory_utilization 0.9) the fold engine ran
# out of device memory in its first steps (a 1.49 GiB allocation in ``jit__step``) where the
# dense layout's engine has run; the cause is not found yet (on the CPU the compiled step's KV
# aliasing, temporaries and live arrays match the dense layout's). docs/benchmarks.md, "Multi-LoRA".
LORA_FOLD = False


def lora_fold(*, tp_size: int, quantized: bool) -> bool:
    """Whether the slots take the fold layout (module docstring): :data:`LORA_FOLD`, one device
    (``tp_size == 1``) and no quantized adapted projection (``quantized`` False); otherwise the
    slots keep a separate ``a`` and the steps take :func:`lora_path`."""
    return LORA_FOLD and tp_size == 1 and not quantized


def lora_path(num_tokens: int, max_loras: int) -> str:
    """The path (one of :data:`LORA_PATHS`) of a step of ``num_tokens`` tokens over
    ``max_loras`` slots: ``"bgmv"`` on a GPU up to :data:`LORA_KERNEL_MAX_TOKENS` tokens, else
    ``"gather"`` by the :data:`LORA_GATHER_MAX_TOKENS` rule, else ``"dense"``. Slots in the
    fold layout (:func:`lora_fold`) take none of these: every step folds."""
    if num_tokens <= LORA_KERNEL_MAX_TOKENS and target_platform() == "gpu":
        return "bgmv"
    if num_tokens <= LORA_GATHER_MAX_TOKENS and num_tokens < max_loras:
        return "gather"
    return "dense"


@dataclasses.dataclass(frozen=True)
class ProjectionSpec:
    """Sizes of one (possibly fused) projection: input size and each part's output size."""

    in_features: int
    part_sizes: tuple[int, ...]

    @property
    def out_features(self) -> int:
        return sum(self.part_sizes)


def llama_projection_specs(config: Any) -> dict[str, ProjectionSpec]:
    """The LoRA-able projections of one Llama-family layer, from its HF config.

    ``qkv_proj``: ``hidden -> (Hq * D, Hkv * D, Hkv * D)``; ``o_proj``: ``Hq * D -> hidden``;
    ``gate_up_proj``: ``hidden -> (intermediate, intermediate)``; ``down_proj``:
    ``intermediate -> hidden``. A sparse-MoE config (Mixtral's ``num_local_experts``) has no
    dense MLP and LoRA does not reach its experts: only ``qkv_proj`` and ``o_proj``.
    """
    hidden, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    specs = {
        "qkv_proj": ProjectionSpec(
            hidden, (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
        ),
        "o_proj": ProjectionSpec(heads * head_dim, (hidden,)),
    }
    if not getattr(config, "num_local_experts", 0):
        specs["gate_up_proj"] = ProjectionSpec(hidden, (inter, inter))
        specs["down_proj"] = ProjectionSpec(inter, (hidden,))
    return specs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRAWeights:
    """Every slot's adapter for one projection of one layer (module docstring layout)."""

    # [in, base_columns + S * C]: the A matrices, slot-major, rank-padded with zeros; in the
    # fold layout (base_columns = out > 0) after the base projection's kernel W [in, out].
    a: jax.Array
    # [S * C, out]: the B matrices times their scale, block-diagonal over a fused projection's
    # parts, out columns in the fused kernel's order.
    b: jax.Array
    # Static: columns of ``a`` before the slots: 0, or ``out`` in the fold layout.
    base_columns: int = dataclasses.field(default=0, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRABatch:
    """What a step needs to apply LoRA: per token its slot, per layer the slot weights."""

    # i32[T]: the slot of each token's adapter in [0, max_loras); -1 = base model (and padding).
    token_slots: jax.Array
    # Per layer: projection name (``LORA_PROJECTIONS``) -> weights. Every projection is present
    # (an adapter that skips one leaves its columns zero), so the pytree never changes shape.
    layers: tuple[dict[str, LoRAWeights], ...]
    # Static: S, the number of slots stacked in each ``LoRAWeights``.
    max_loras: int = dataclasses.field(metadata=dict(static=True))

    def layer(self, index: int) -> LoRALayer:
        return LoRALayer(self.token_slots, self.layers[index], self.max_loras)


@dataclasses.dataclass(frozen=True)
class LoRALayer:
    """One layer's view of a ``LoRABatch`` (built inside the traced step; not a pytree)."""

    token_slots: jax.Array
    weights: dict[str, LoRAWeights]
    max_loras: int

    def delta(self, name: str, x: jax.Array) -> jax.Array:
        """``[T, out]``: the LoRA update of projection ``name`` for input ``x [T, in]``.

        Raises:
            ValueError: projection ``name`` is in the fold layout (use :func:`lora_project`).
        """
        w = self.weights[name]
        if w.base_columns:
            raise ValueError(f"{name}: the fold layout has no separate LoRA delta")
        return lora_delta(x, self.token_slots, w.a, w.b, max_loras=self.max_loras)


def lora_delta(
    x: jax.Array,
    token_slots: jax.Array,
    a: jax.Array,
    b: jax.Array,
    *,
    max_loras: int,
    path: str | None = None,
) -> jax.Array:
    """Batched LoRA update ``[T, out]`` in ``x``'s dtype: row t is ``x[t] @ A_s @ B_s`` for
    ``s = token_slots[t]`` (zero when ``s == -1``).

    Args:
        x: ``[T, in]`` activations.
        token_slots: ``i32[T]``, each in ``[-1, max_loras)``.
        a: ``[in, S * C]``; b: ``[S * C, out]`` (module docstring layout; scale folded into b).
        max_loras: ``S``.
        path: ``"dense"``, ``"gather"`` or ``"bgmv"`` (module docstring; the same sums);
            None: :func:`lora_path`'s choice for ``T``. ``"bgmv"`` runs the Pallas kernel,
            interpreted off a GPU.

    Matmuls accumulate in float32; float32 inputs use full float32 precision (no TF32).

    Raises:
        ValueError: ``path`` not one of ``LORA_PATHS``; on the ``"bgmv"`` path, the kernel's
            shape checks (``pallas_kernels.lora_bgmv.lora_bgmv``).
    """
    if path is None:
        path = lora_path(x.shape[0], max_loras)
    if path not in LORA_PATHS:
        raise ValueError(f"path must be one of {list(LORA_PATHS)}, got {path!r}")
    if path == "bgmv":
        interpret = target_platform() != "gpu"
        return lora_bgmv(x, token_slots, a, b, max_loras=max_loras, interpret=interpret)
    cols = a.shape[1]
    per_slot = cols // max_loras
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    dot = functools.partial(jnp.einsum, precision=precision, preferred_element_type=jnp.float32)
    if path == "gather":
        # Each token's own A and B (BGMV): T slots' weights instead of all S.
        index = jnp.maximum(token_slots, 0)
        a_t = a.reshape(a.shape[0], max_loras, per_slot)[:, index, :]  # [in, T, C]
        b_t = b.reshape(max_loras, per_slot, b.shape[1])[index]  # [T, C, out]
        h = dot("ti,itc->tc", x, a_t.astype(x.dtype))
        h = jnp.where(token_slots[:, None] >= 0, h, 0.0).astype(x.dtype)
        return dot("tc,tco->to", h, b_t.astype(x.dtype)).astype(x.dtype)
    column_slot = np.arange(cols, dtype=np.int32) // per_slot  # static
    h = dot("ti,ic->tc", x, a.astype(x.dtype))
    h = jnp.where(token_slots[:, None] == column_slot[None, :], h, 0.0).astype(x.dtype)
    return dot("tc,co->to", h, b.astype(x.dtype)).astype(x.dtype)


def lora_delta_reference(
    x: np.ndarray, token_slots: np.ndarray, a_list: list, b_list: list
) -> np.ndarray:
    """Plain per-token reference, float32: ``x[t] @ a_list[s] @ b_list[s]`` (unpadded, one
    ``[in, r_s]`` / ``[r_s, out]`` pair per slot ``s``), zero for ``s == -1``."""
    x = np.asarray(x, np.float32)
    out = np.zeros((x.shape[0], np.asarray(b_list[0]).shape[1]), np.float32)
    for t, s in enumerate(np.asarray(token_slots)):
        if s >= 0:
            out[t] = (x[t] @ np.asarray(a_list[s], np.float32)) @ np.asarray(b_list[s], np.float32)
    return out


def fold_lora_output(
    y: jax.Array, token_slots: jax.Array, b: jax.Array, *, max_loras: int, bias=None
) -> jax.Array:
    """The fold layout's projection output ``[T, out]`` from ``y = x @ [W | a]`` (module
    docstring): ``y[:, :out] (+ bias) + (y[:, out:] * mask) @ b``, in ``y``'s dtype.

    Args:
        y: ``[T, out + S * C]``.
        token_slots: ``i32[T]``, each in ``[-1, max_loras)``.
        b: ``[S * C, out]`` (scale folded in).
        max_loras: ``S``.
        bias: ``[out]`` or None, added to the base part.

    The expand's output is added last, in ``y``'s dtype, so that XLA can take the base output
    as the GEMM's accumulator operand; float32 uses full float32 precision.
    """
    cols, out = b.shape
    column_slot = np.arange(cols, dtype=np.int32) // (cols // max_loras)  # static
    base = y[..., :out]
    if bias is not None:
        base = base + bias.astype(y.dtype)
    h = jnp.where(token_slots[:, None] == column_slot[None, :], y[..., out:], 0.0).astype(y.dtype)
    precision = jax.lax.Precision.HIGHEST if y.dtype == jnp.float32 else None
    return base + jnp.dot(h, b.astype(y.dtype), precision=precision)


def lora_project(lora: LoRALayer | None, name: str, linear: Any, x: jax.Array):
    """``linear(x)`` with projection ``name``'s LoRA update: ``[T, out]``, or a fused
    projection's parts (a ``models.merged_linear`` layer, recognised by its ``output_sizes``).

    Without LoRA, ``linear(x)``; with slots in the fold layout (module docstring), one GEMM over
    the slots' ``[W | a]`` in ``linear``'s compute dtype and precision (its own kernel is the
    empty placeholder) plus its bias; else ``linear``'s output plus :meth:`LoRALayer.delta`
    (added before a fused projection's split).
    """
    if lora is None:
        return linear(x)
    sizes = getattr(linear, "output_sizes", None)
    w = lora.weights[name]
    if not w.base_columns:
        delta = lora.delta(name, x)
        return linear(x) + delta if sizes is None else linear(x, delta)
    dtype = linear.dtype or x.dtype
    x = x.astype(dtype)
    y = jax.lax.dot_general(
        x, w.a.astype(dtype), (((x.ndim - 1,), (0,)), ((), ())), precision=linear.precision
    )
    bias = None if linear.bias is None else linear.bias[...]
    y = fold_lora_output(y, lora.token_slots, w.b, max_loras=lora.max_loras, bias=bias)
    return y if sizes is None else split_merged_columns(y, sizes, linear.num_shards)


def fold_kernel(kernel: jax.Array, slot_columns: int) -> jax.Array:
    """``[kernel | zeros]``: a base kernel ``[in, out]`` with ``slot_columns`` (``S * C``) zero
    slot columns appended, the fold layout's ``a`` with every slot empty."""
    return jnp.concatenate([kernel, jnp.zeros((kernel.shape[0], slot_columns), kernel.dtype)], 1)


def take_fold_kernels(linears: dict[str, Any]) -> dict[str, jax.Array]:
    """Take the kernels of one layer's adapted projections (name -> ``nnx.Linear`` or
    ``MergedColumnParallelLinear``) over for the fold layout: returns name -> kernel
    ``[in, out]`` and leaves each layer's kernel an empty ``[in, 0]`` placeholder of its dtype,
    so that the folded copy is the only one (the layer then runs only through
    :func:`lora_project`)."""
    kernels = {}
    for name, linear in linears.items():
        kernel = linear.kernel[...]
        kernels[name] = kernel
        linear.kernel = type(linear.kernel)(jnp.zeros((kernel.shape[0], 0), kernel.dtype))
    return kernels
