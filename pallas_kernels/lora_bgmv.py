"""Fused multi-LoRA update of one projection: shrink, per-token slot select and expand in one
``pallas_call`` (punica's BGMV idea: Chen et al., "Punica: Multi-Tenant LoRA Serving",
arXiv:2310.18547; written from the math in ``models.lora``, not from its code).

Layout (``models.lora``): ``a [in, S * C]`` and ``b [S * C, out]``, slot ``s`` owning columns /
rows ``s*C .. (s+1)*C - 1``, scale folded into ``b``; ``token_slots i32[T]``, -1 = base. Row
``t`` of the result is ``(x[t] @ a[:, slot]) @ b[slot, :]`` with the shrink accumulated in
float32 and rounded to ``x.dtype`` before the expand (as ``models.lora.lora_delta``'s paths).

Design (small ``T``, decode). The grid is (token tiles, output tiles). Each program walks the
``S`` slots; for a slot that at least one token of its tile uses, it recomputes that slot's
shrink ``h = x_tile @ a[:, slot] [block_t, C]`` over ``in`` in ``block_k`` steps, zeroes the
rows of the tile's other tokens, and adds ``h @ b[slot, out tile]`` to a float32 accumulator.
A slot no token of the tile uses costs a zero-trip loop and a masked (never issued) ``b`` load;
slot -1 matches no slot, so its rows stay zero. No intermediate leaves the kernel: one launch
per projection, against the dense path's shrink, mask and expand kernels.

Cost model, per projection with ``u`` distinct slots in a token tile: HBM bytes are
``u * C * (in + out)`` weight elements (the ``a`` columns once, then from L2) plus ``x`` and the
output; the shrink is recomputed by every output tile, so L2 traffic is
``(out / block_n) * u * in * C`` elements. At Llama-3-8B's ``gate_up_proj`` (in 4096, out
28672, C = 2 * 16) and ``block_n = 256``: 112 programs, about 29 MB of L2 reads at ``u = 1`` in
bf16, a few µs; a larger ``block_n`` trades that for fewer programs streaming ``b``. The
alternative, a two-phase shrink-then-expand, would need a second launch (or a grid-wide
barrier), which is the cost this kernel removes. Tiles are unmeasured defaults (``_TILING``).

Backend: Pallas Triton on GPU (``interpret=True`` on CPU). Triton's tensor-core dot needs every
dimension >= 16 and power-of-two tiles: the token tile is ``T`` rounded up to a power of two,
at least 16 (padding rows load as zero and are never stored), ``C`` is read as a power-of-two
``>= 16`` tile with the columns past ``C`` masked (``qkv_proj``'s ``C = 3 * rank`` is no power
of two), and ``in`` / ``out`` tails are masked.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.online_softmax import MIN_DOT_DIM


@dataclasses.dataclass(frozen=True)
class BGMVTiling:
    """Static launch parameters of :func:`lora_bgmv` (not yet measured on a GPU).

    Attributes:
        max_block_t: largest token tile (``T`` above it takes several token tiles, each
            recomputing its own shrink).
        block_n: output columns per program.
        block_k: input features per shrink step.
        num_warps, num_stages: Triton's warps per program and software-pipelining depth.
    """

    max_block_t: int = 64
    block_n: int = 256
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 2


_TILING = BGMVTiling()


def _lora_bgmv_kernel(
    slots_ref,  # i32[T]: each token's slot, -1 = base
    x_ref,  # [T, in]
    a_ref,  # [in, S * C]
    b_ref,  # [S * C, out]
    o_ref,  # [T, out], x.dtype
    *,
    max_loras: int,
    per_slot: int,
    block_t: int,
    block_c: int,
    block_n: int,
    block_k: int,
):
    num_tokens, in_features = x_ref.shape
    out_features = o_ref.shape[1]
    t0 = pl.program_id(0) * block_t
    n0 = pl.program_id(1) * block_n
    rows = pl.ds(t0, block_t)
    out_cols = pl.ds(n0, block_n)
    row_ok = t0 + lax.broadcasted_iota(jnp.int32, (block_t,), 0) < num_tokens
    col_ok = n0 + lax.broadcasted_iota(jnp.int32, (1, block_n), 1) < out_features
    c_ok = lax.broadcasted_iota(jnp.int32, (block_c,), 0) < per_slot
    k_iota = lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    slots = pltriton.load(slots_ref.at[rows], mask=row_ok, other=-1)  # [block_t]
    dtype = x_ref.dtype
    precision = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)  # IEEE for f32, none for bf16

    def dot(lhs, rhs):
        return lax.dot(lhs, rhs, precision=precision, preferred_element_type=jnp.float32)

    def slot_body(slot, acc):
        mine = slots == slot  # [block_t]
        used = jnp.max(mine.astype(jnp.int32)) > 0
        cols = pl.ds(slot * per_slot, block_c)

        def shrink_step(step, h):
            k0 = step * block_k
            k_ok = k0 + k_iota < in_features
            x = pltriton.load(
                x_ref.at[rows, pl.ds(k0, block_k)], mask=row_ok[:, None] & k_ok[None, :], other=0
            )
            a = pltriton.load(
                a_ref.at[pl.ds(k0, block_k), cols], mask=k_ok[:, None] & c_ok[None, :], other=0
            )
            return h + dot(x, a.astype(dtype))

        # A slot nobody in the tile uses: zero shrink steps, and its b rows are never read.
        # int32 on both sides: Triton's scf.for wants bounds of one type (a where of Python
        # ints lowered to i1 on the H200).
        num_steps = used.astype(jnp.int32) * jnp.int32(pl.cdiv(in_features, block_k))
        h = lax.fori_loop(0, num_steps, shrink_step, jnp.zeros((block_t, block_c), jnp.float32))
        h = jnp.where(mine[:, None], h, 0.0).astype(dtype)
        b = pltriton.load(b_ref.at[cols, out_cols], mask=(c_ok[:, None] & col_ok) & used, other=0)
        return acc + dot(h, b.astype(dtype))

    acc = lax.fori_loop(0, max_loras, slot_body, jnp.zeros((block_t, block_n), jnp.float32))
    pltriton.store(o_ref.at[rows, out_cols], acc.astype(o_ref.dtype), mask=row_ok[:, None] & col_ok)


@functools.partial(jax.jit, static_argnames=("max_loras", "interpret", "tiling"))
def _lora_bgmv(x, token_slots, a, b, *, max_loras, interpret, tiling):
    """The launch; arguments already checked."""
    num_tokens, in_features = x.shape
    per_slot = a.shape[1] // max_loras
    out_features = b.shape[1]
    block_t = min(max(MIN_DOT_DIM, pl.next_power_of_2(num_tokens)), tiling.max_block_t)
    block_c = max(MIN_DOT_DIM, pl.next_power_of_2(per_slot))
    block_n = min(tiling.block_n, max(MIN_DOT_DIM, pl.next_power_of_2(out_features)))
    block_k = min(tiling.block_k, max(MIN_DOT_DIM, pl.next_power_of_2(in_features)))
    kernel = functools.partial(
        _lora_bgmv_kernel,
        max_loras=max_loras,
        per_slot=per_slot,
        block_t=block_t,
        block_c=block_c,
        block_n=block_n,
        block_k=block_k,
    )

    def whole(shape):  # every program sees the whole array and masks its own tile
        return pl.BlockSpec(shape, lambda t, n: (0,) * len(shape))

    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(num_tokens, block_t), pl.cdiv(out_features, block_n)),
        in_specs=[whole(token_slots.shape), whole(x.shape), whole(a.shape), whole(b.shape)],
        out_specs=whole((num_tokens, out_features)),
        out_shape=jax.ShapeDtypeStruct((num_tokens, out_features), x.dtype),
        compiler_params=pltriton.CompilerParams(
            num_warps=tiling.num_warps, num_stages=tiling.num_stages
        ),
        interpret=interpret,
        name="lora_bgmv",
    )(token_slots, x, a, b)


def lora_bgmv(
    x: jax.Array,
    token_slots: jax.Array,
    a: jax.Array,
    b: jax.Array,
    *,
    max_loras: int,
    interpret: bool = False,
) -> jax.Array:
    """Each token's own LoRA update, ``[T, out]``, in one kernel launch.

    Args:
        x: ``[T, in]`` activations (float32, bfloat16 or float16).
        token_slots: ``i32[T]``, each token's slot in ``[0, max_loras)``; -1 (or any value
            outside that range) gives a zero row.
        a: ``[in, S * C]``, b: ``[S * C, out]`` (``models.lora`` layout, scale folded into
            ``b``); cast to ``x.dtype`` inside the kernel.
        max_loras: ``S``.
        interpret: run the Pallas kernel in interpret mode (CPU tests).

    Returns:
        ``[T, out]`` in ``x.dtype``: row ``t`` is ``round(x[t] @ A_s) @ B_s`` for
        ``s = token_slots[t]``, both dots accumulating in float32 (float32 inputs at full
        float32 precision, no TF32), the shrink rounded to ``x.dtype`` before the expand.

    Raises:
        ValueError: ``x`` not 2-D, ``token_slots`` not ``i32[T]``, ``max_loras`` < 1 or not
            dividing ``a``'s columns, or ``a`` / ``b`` shapes that do not match ``x`` and
            each other (each named with its shape).
    """
    if x.ndim != 2:
        raise ValueError(f"lora_bgmv: x must be [T, in], got {x.shape}")
    num_tokens, in_features = x.shape
    if token_slots.shape != (num_tokens,) or token_slots.dtype != jnp.int32:
        raise ValueError(
            f"lora_bgmv: token_slots must be i32[T={num_tokens}], got "
            f"{token_slots.dtype}{list(token_slots.shape)}"
        )
    if a.ndim != 2 or a.shape[0] != in_features:
        raise ValueError(f"lora_bgmv: a must be [in={in_features}, S * C], got {a.shape}")
    if not isinstance(max_loras, int) or max_loras < 1 or a.shape[1] % max_loras:
        raise ValueError(
            f"lora_bgmv: max_loras must be a positive int dividing a's {a.shape[1]} columns, "
            f"got {max_loras!r}"
        )
    if b.ndim != 2 or b.shape[0] != a.shape[1]:
        raise ValueError(f"lora_bgmv: b must be [S * C={a.shape[1]}, out], got {b.shape}")
    return _lora_bgmv(
        x, token_slots, a, b, max_loras=max_loras, interpret=bool(interpret), tiling=_TILING
    )
