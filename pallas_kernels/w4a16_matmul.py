"""W4A16 matmul: 16-bit (or float32) activations times 4-bit grouped weights, dequantized in-kernel.

Layout of this file: the kernel layout's description, the launch parameters
(:class:`W4A16Tiling`, with the defaults per token count), the Pallas kernel body, the public
``w4a16_matmul`` with its argument checks, and last the plain-JAX ``w4a16_matmul_reference``,
which shares no code with the kernel. The host/device repacks from the stored AWQ GEMM, GPTQ and
compressed-tensors formats are ``models.quantization.w4a16`` (imports point ``pallas_kernels``
<- ``models``).

Why a kernel: on the H200, XLA compiles ``models.quantization.awq.awq_linear`` at ``T = 1`` into
a loop fusion that reads the packed weights at about 223 GB/s, against 2.5-2.7 TB/s for the bf16
GEMV (``docs/benchmarks.md``, "Quantized linears"). A decode step only streams
weights, so 4-bit weights should take about a quarter of bf16's time.

Kernel layout (``in`` inputs, ``out`` outputs, ``G = in // group_size`` groups, ``P = in // 8``):

- ``qweight: i32[P, out]``, packed along ``in`` in eight *planes*: bits ``[4 j, 4 j + 4)``
  (slot ``j``) of word ``[r, o]`` hold ``q[j * P + r, o]``. Slot ``j`` of a run of words
  ``r0 .. r0 + block_k - 1`` is therefore the contiguous row range ``j * P + r0 ..`` of the
  weight, so a K-step unpacks eight ``[block_k, block_n]`` tiles with one shift and one mask
  each and multiplies them by eight contiguous ``[block_t, block_k]`` slices of ``x``: no
  interleaving reshape, no strided load, and the layout does not depend on the tile sizes. A
  ``[block_k, block_n]`` tile of words is ``block_k`` rows of ``4 * block_n`` contiguous bytes.
- ``scales: [G, out]`` (float16, bfloat16 or float32) and ``zeros: i8[G, out]`` (unpacked zero
  points, ``0 .. 16``; GPTQ v1's stored ``15`` reads as ``16``).

The weight is ``W[i, o] = (q[i, o] - zeros[i // group_size, o]) * scales[i // group_size, o]``
(AWQ's and GPTQ's formula) and the result is ``x @ W``.

One kernel, two regimes chosen by the tiling (:class:`W4A16Tiling`):

- **Decode (small T), split over K.** The grid is (token tiles, output tiles, K splits): at
  ``out = 4096`` the output tiles alone are too few programs for 132 SMs, so each program covers
  ``1 / split_k`` of the packed rows and writes a float32 partial that XLA sums (about two
  programs per SM by default, ``pallas_kernels.split_k``). With ``dot=False`` the program
  multiplies elementwise and sums (no tensor cores, no padding of ``T`` to 16 rows, no layout
  change of the dequantized tile into a dot operand), for ``T`` of a few tokens; with
  ``dot=True`` it makes eight tensor-core dots per K-step.
- **Prefill (large T).** ``split_k = 1``, large token and output tiles (up to 128 x 256) with the
  dequantization inside the dot's main loop; the result is written in ``x.dtype`` directly.

Dequantization in registers: ``magic=True`` builds the float ``2^23 + q`` from the nibble's bits
(``(word >> 4 j) & 0xF | 0x4B000000``, one shift and one three-input logic op) and subtracts
``2^23 + z``, exactly ``q - z``, avoiding the slow integer-to-float convert; ``magic=False``
converts ``q - z`` with an ``int32 -> float32`` convert. Both then multiply by the group's scale
in float32 (exact products of small integers: the two give identical results). For the dot the
tile is rounded once to ``x.dtype`` (as ``dequantize_groups`` does).

**Fold** (``fold=True``): the nibble is shifted to bits 19..22 of a float32 with the bits of
1.0 (one shift, one three-input logic op), the float ``v = 1 + q / 16``, exactly; the K-step
sums ``x_k v_k`` over the slot's ``block_k`` rows (one FMA per weight, or a dot on ``v`` in
``x``'s dtype, exact there too) and then applies the group's zero and scale once per column:
``sum_k x_k (q_k - z) s = 16 s (sum_k x_k v_k - (1 + z / 16) sum_k x_k)``. The weight is never
formed, so it is never rounded; the subtraction loses at most a few float32 ulps of
``sum_k |x_k|``.

Tails: a token count, an ``out`` or a split count that the tiles do not divide is masked (loads
pad with zero, stores are masked). ``block_k`` must divide both ``P`` and ``group_size`` (each
slot's rows of one step sit in one group: one zero row and one scale row per slot and step).

Backend: on GPU ``pallas_call`` lowers through the Pallas Triton backend; on CPU it runs with
``interpret=True``. Triton needs power-of-two tiles, and a dot needs every dimension >= 16, so
with ``dot=True`` the token tile is at least 16 (a decode step's rows are padded by masking).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.split_k import split_k_count

PACK = 8  # 4-bit values per int32 word
MIN_TILE = 16  # Triton's smallest dot dimension; also the smallest block_n / block_k
_X_DTYPES = ("bfloat16", "float16", "float32")
_SCALE_DTYPES = ("bfloat16", "float16", "float32")
_MAGIC = 0x4B000000  # float32 bits of 2^23: OR-ing a nibble q into the mantissa gives 2^23 + q
_TWO_23 = float(2**23)


@dataclasses.dataclass(frozen=True)
class W4A16Tiling:
    """Static launch parameters of :func:`w4a16_matmul`.

    Attributes:
        block_t: largest token tile (a power of two; the tile is the smallest power of two
            holding ``T``, at least 16 with ``dot``, capped here). More tokens take several
            tiles, each reading the weights again.
        block_n: output columns per program (a power of two >= 16; ``out`` need not divide).
        block_k: packed words per slot per K-step (a power of two >= 16 dividing ``in / 8`` and
            ``group_size``); a step covers ``8 * block_k`` input rows and reads ``4 * block_k *
            block_n`` bytes of weights.
        split_k: K splits (float32 partials summed by XLA); None: ``pallas_kernels.split_k``'s
            choice (about two programs per SM); 1 writes the result directly.
        num_warps, num_stages: Triton's warps per program and software-pipelining depth (cut
            until a step's tiles fit the shared-memory budget).
        dot: tensor-core dots (True) or elementwise multiply and sum (False, for small T).
        swap: with ``dot``, compute ``(W_tile^T x_tile^T)^T`` so that the dequantized weight
            tile is the dot's first operand (M = ``block_n``), the operand a Hopper ``wgmma``
            may take from registers, and the token tile its N (Machete's swap for small M).
        magic: dequantize through float bit patterns (True) or an integer convert (False).
        fold: apply zero points and scales per group after the products (module docstring,
            "fold"): three operations per weight instead of five; the weight is never rounded
            to ``x``'s dtype. Overrides ``magic`` and ``swap``.
        defer: with ``fold`` and without ``dot``, multiply ``v`` by ``16 s`` per weight (four
            operations) and sum the products once after the loop, instead of reducing each
            slot's rows every step (a cross-thread reduction per slot and step).
        slots3d: the decode GEMV form (elementwise, the fold's arithmetic; overrides ``dot``,
            ``swap``, ``magic``, ``fold`` and ``defer``): the eight slots of a K-step are one
            ``[8, block_k, block_n]`` tile, so a step makes four loads (the words, ``x`` as
            ``[block_t, 8, block_k]``, and the eight slots' scale and zero rows as ``[8,
            block_n]`` each) instead of 25, and one reduction over ``k`` per step. Needs
            ``group_size`` to divide ``in / 8`` (each slot's rows start on a group boundary);
            ``block_n * block_k`` of at most ``64 * num_warps * 32 / 8`` keeps the ``[8, block_k,
            block_n]`` tile in registers.
    """

    block_t: int = 64
    block_n: int = 64
    block_k: int = 64
    split_k: int | None = None
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = True
    swap: bool = False
    magic: bool = True
    fold: bool = False
    defer: bool = False
    slots3d: bool = False


# Defaults by token count, (largest T, tiling), first match wins. Measured on an H100 (tree
# f94aa64, docs/benchmarks.md "Quantized kernels"; the sweep's first pass only): at
# T = 16 and 32 the dot tiling runs Llama-3-8B's layer in 0.79x bf16's time, at T = 1 the
# elementwise fold in 1.08x; T = 1 therefore takes the dot tiling too (its 16-row tile does the
# same work as T = 16). The T > 32 tiling is 3.6-4.0x bf16's time: ``auto`` sends those steps
# to XLA (models.linear_backends.AUTO_BACKENDS).
DEFAULT_TILINGS: tuple[tuple[int | None, W4A16Tiling], ...] = (
    (32, W4A16Tiling(block_t=32, block_n=64, block_k=32)),
    (None, W4A16Tiling(block_t=128, block_n=128, block_k=16, split_k=1, num_warps=8)),
)

# Shared memory a Triton program may use on the H200 is 232,448 bytes (227 KiB); pipelining keeps
# one K-step's tiles per stage, so the stage count is cut until they fit, with headroom for the
# compiler's own buffers (the dequantized tile's layout change may also go through it).
_SHARED_MEMORY_BUDGET = 160 * 1024


def default_tiling(tokens: int) -> W4A16Tiling:
    """The :data:`DEFAULT_TILINGS` entry for a step of ``tokens`` tokens."""
    for max_tokens, tiling in DEFAULT_TILINGS:
        if max_tokens is None or tokens <= max_tokens:
            return tiling
    return DEFAULT_TILINGS[-1][1]


# --- The kernel -----------------------------------------------------------------------------


def _load(ref, mask):
    """A load of ``ref``, masked (padding zero) where ``mask`` is given."""
    return pltriton.load(ref) if mask is None else pltriton.load(ref, mask=mask, other=0)


def _unit_nibble(words, j):
    """Slot ``j``'s nibbles ``q`` as the floats ``v = 1 + q / 16`` (exact): the nibble's bits
    ``[4 j, 4 j + 4)`` moved to ``[19, 23)``, the top of a float32 mantissa, OR the bits of 1."""
    shift = 19 - 4 * j
    moved = jnp.left_shift(words, shift) if shift > 0 else jnp.right_shift(words, -shift)
    return lax.bitcast_convert_type((moved & 0x00780000) | 0x3F800000, jnp.float32)


def _folded(xs, words, j, zero, scale, *, dot, precision):
    """Slot ``j``'s contribution ``[bt, bn]`` by the fold (module docstring): ``16 s (sum_k x_k
    v_k - (1 + z / 16) sum_k x_k)`` with ``v = 1 + q / 16``."""
    v = _unit_nibble(words, j)
    x32 = xs.astype(jnp.float32)
    if dot:  # v has four mantissa bits: exact in bfloat16 / float16
        part = jnp.dot(xs, v.astype(xs.dtype), precision=precision,
                       preferred_element_type=jnp.float32)  # fmt: skip
    else:
        part = jnp.sum(x32[:, :, None] * v[None, :, :], axis=1)
    x_sum = jnp.sum(x32, axis=1, keepdims=True)  # [bt, 1]
    offset = 1.0 + zero.astype(jnp.float32) * 0.0625  # [1, bn]
    return (part - offset * x_sum) * (scale.astype(jnp.float32) * 16.0)


def _w4a16_kernel(
    x_ref,  # [T, in]
    w_ref,  # i32[P, out]: the plane-packed weight
    s_ref,  # [G, out]: scales
    z_ref,  # i8[G, out]: zero points
    o_ref,  # [T, out] in x.dtype (split_k = 1) or f32[split_k, T, out] (partials)
    *,
    group_size: int,
    block_t: int,
    block_n: int,
    block_k: int,
    steps_per_split: int,
    partials: bool,
    dot: bool,
    swap: bool,
    magic: bool,
    fold: bool,
    defer: bool,
):
    num_tokens, _ = x_ref.shape
    planes, n_total = w_ref.shape
    t0 = pl.program_id(0) * block_t
    n0 = pl.program_id(1) * block_n
    split = pl.program_id(2)
    toks, cols = pl.ds(t0, block_t), pl.ds(n0, block_n)
    t_ok = t0 + lax.broadcasted_iota(jnp.int32, (block_t, 1), 0) < num_tokens  # [bt, 1]
    n_ok = n0 + lax.broadcasted_iota(jnp.int32, (1, block_n), 1) < n_total  # [1, bn]
    x_mask = None if num_tokens % block_t == 0 else jnp.broadcast_to(t_ok, (block_t, block_k))
    n_tail = n_total % block_n != 0
    w_mask = jnp.broadcast_to(n_ok, (block_k, block_n)) if n_tail else None
    row_mask = n_ok if n_tail else None
    first_step = split * steps_per_split
    num_steps = jnp.minimum(steps_per_split, planes // block_k - first_step)
    dtype = x_ref.dtype
    # float32 x: true float32 dots (Triton would otherwise use TF32 on the GPU).
    precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None

    def step(i, carry):
        acc, corr = carry
        r0 = pl.multiple_of((first_step + i) * block_k, block_k)
        words = _load(w_ref.at[pl.ds(r0, block_k), cols], w_mask)
        for j in range(PACK):
            row0 = j * planes + r0  # first weight row of slot j: block_k rows in one group
            group = pl.ds(row0 // group_size, 1)
            zero = _load(z_ref.at[group, cols], row_mask)  # [1, bn]
            scale = _load(s_ref.at[group, cols], row_mask)
            xs = _load(x_ref.at[toks, pl.ds(pl.multiple_of(row0, block_k), block_k)], x_mask)
            if defer:  # 16 s v x elementwise; the zero's share 16 s (1 + z / 16) sum(x) aside
                x32 = xs.astype(jnp.float32)
                s16 = scale.astype(jnp.float32) * 16.0
                acc += x32[:, :, None] * (_unit_nibble(words, j) * s16)[None, :, :]
                offset = (1.0 + zero.astype(jnp.float32) * 0.0625) * s16
                corr += jnp.sum(x32, axis=1, keepdims=True) * offset
                continue
            if fold:
                acc += _folded(xs, words, j, zero, scale, dot=dot, precision=precision)
                continue
            nibble = jnp.right_shift(words, 4 * j) & 0xF if j else words & 0xF
            if magic:  # float(2^23 + q) - float(2^23 + z) = q - z, exactly
                q = lax.bitcast_convert_type(nibble | _MAGIC, jnp.float32)
                w = (q - (zero.astype(jnp.float32) + _TWO_23)) * scale.astype(jnp.float32)
            else:
                w = (nibble - zero.astype(jnp.int32)).astype(jnp.float32)
                w = w * scale.astype(jnp.float32)
            if swap:  # acc is [bn, bt]; the tile rounded once to x's dtype
                acc += jnp.dot(
                    w.astype(dtype).T, xs.T, precision=precision,
                    preferred_element_type=jnp.float32,
                )  # fmt: skip
            elif dot:  # the tile rounded once to x's dtype, as dequantize_groups does
                acc += jnp.dot(
                    xs, w.astype(dtype), precision=precision, preferred_element_type=jnp.float32
                )
            else:  # [bt, bk, bn] products, summed over k after the loop
                acc += xs.astype(jnp.float32)[:, :, None] * w[None, :, :]
        return acc, corr

    if swap:
        acc_shape = (block_n, block_t)
    else:
        acc_shape = (
            (block_t, block_n) if dot or (fold and not defer) else (block_t, block_k, block_n)
        )
    corr = jnp.zeros((block_t, block_n) if defer else (1, 1), jnp.float32)
    acc, corr = lax.fori_loop(0, num_steps, step, (jnp.zeros(acc_shape, jnp.float32), corr))
    if swap:
        acc = acc.T
    elif defer:
        acc = jnp.sum(acc, axis=1) - corr
    elif not dot and not fold:
        acc = jnp.sum(acc, axis=1)
    mask = t_ok & n_ok
    if partials:
        pltriton.store(o_ref.at[split, toks, cols], acc, mask=mask)
    else:
        pltriton.store(o_ref.at[toks, cols], acc.astype(o_ref.dtype), mask=mask)


def _w4a16_slots3d_kernel(
    x_ref,  # [T, 8, P]: x with slot j's rows j * P .. (j + 1) * P - 1 on axis 1
    w_ref,  # i32[P, out]
    s_ref,  # [8, P / group_size, out]: slot j's groups on axis 1
    z_ref,  # i8[8, P / group_size, out]
    o_ref,  # as _w4a16_kernel's
    *,
    group_size: int,
    block_t: int,
    block_n: int,
    block_k: int,
    steps_per_split: int,
    partials: bool,
):
    """The ``slots3d`` decode form (:class:`W4A16Tiling`): per K-step one ``[8, block_k,
    block_n]`` tile of ``v = 1 + q / 16`` and ``sum_j 16 s_j (sum_k x_jk v_jk - (1 + z_j / 16)
    sum_k x_jk)``, the fold's arithmetic (module docstring)."""
    num_tokens = x_ref.shape[0]
    planes, n_total = w_ref.shape
    t0 = pl.program_id(0) * block_t
    n0 = pl.program_id(1) * block_n
    split = pl.program_id(2)
    toks, cols = pl.ds(t0, block_t), pl.ds(n0, block_n)
    t_ok = t0 + lax.broadcasted_iota(jnp.int32, (block_t, 1), 0) < num_tokens  # [bt, 1]
    n_ok = n0 + lax.broadcasted_iota(jnp.int32, (1, block_n), 1) < n_total  # [1, bn]
    n_tail = n_total % block_n != 0
    x_mask = None
    if num_tokens % block_t:
        x_mask = jnp.broadcast_to(t_ok[:, :, None], (block_t, PACK, block_k))
    w_mask = jnp.broadcast_to(n_ok, (block_k, block_n)) if n_tail else None
    sz_mask = jnp.broadcast_to(n_ok, (PACK, block_n)) if n_tail else None
    first_step = split * steps_per_split
    num_steps = jnp.minimum(steps_per_split, planes // block_k - first_step)
    # Slot j's nibble (bits 4j .. 4j + 3) moved to bits 19 .. 22, the top of a float32 mantissa.
    shifts = 4 * lax.broadcasted_iota(jnp.int32, (PACK, 1, 1), 0)

    def step(i, acc):
        r0 = pl.multiple_of((first_step + i) * block_k, block_k)
        group = r0 // group_size  # block_k divides group_size: one group per slot and step
        words = _load(w_ref.at[pl.ds(r0, block_k), cols], w_mask)  # [bk, bn]
        xs = _load(x_ref.at[toks, :, pl.ds(r0, block_k)], x_mask).astype(jnp.float32)
        scale = _load(s_ref.at[:, group, cols], sz_mask).astype(jnp.float32)  # [8, bn]
        zero = _load(z_ref.at[:, group, cols], sz_mask).astype(jnp.float32)
        moved = jnp.left_shift(jnp.right_shift(words[None, :, :], shifts), 19)
        v = lax.bitcast_convert_type((moved & 0x00780000) | 0x3F800000, jnp.float32)
        part = jnp.sum(xs[:, :, :, None] * v[None, :, :, :], axis=2)  # [bt, 8, bn]
        x_sum = jnp.sum(xs, axis=2, keepdims=True)  # [bt, 8, 1]
        offset = 1.0 + zero * 0.0625  # [8, bn]
        contrib = (part - offset[None, :, :] * x_sum) * (scale * 16.0)[None, :, :]
        return acc + jnp.sum(contrib, axis=1)

    acc = lax.fori_loop(0, num_steps, step, jnp.zeros((block_t, block_n), jnp.float32))
    mask = t_ok & n_ok
    if partials:
        pltriton.store(o_ref.at[split, toks, cols], acc, mask=mask)
    else:
        pltriton.store(o_ref.at[toks, cols], acc.astype(o_ref.dtype), mask=mask)


def _num_stages(tiling: W4A16Tiling, block_t: int, x_itemsize: int) -> int:
    """Pipeline stages whose tiles fit ``_SHARED_MEMORY_BUDGET``: one K-step holds eight
    ``[block_t, block_k]`` slices of ``x`` and one ``i32[block_k, block_n]`` tile of words."""
    per_stage = 8 * block_t * tiling.block_k * x_itemsize + 4 * tiling.block_k * tiling.block_n
    return max(1, min(tiling.num_stages, _SHARED_MEMORY_BUDGET // per_stage))


@functools.partial(jax.jit, static_argnames=("group_size", "tiling", "interpret"))
def _w4a16_matmul(x, qweight, scales, zeros, *, group_size, tiling, interpret):
    """The launch; arguments already checked."""
    tokens, _ = x.shape
    planes, out_features = qweight.shape
    min_t = MIN_TILE if tiling.dot and not tiling.slots3d else 1
    block_t = min(tiling.block_t, max(min_t, pl.next_power_of_2(tokens)))
    block_t = max(block_t, min_t)
    block_n = min(tiling.block_n, max(MIN_TILE, pl.next_power_of_2(out_features)))
    grid_tn = (pl.cdiv(tokens, block_t), pl.cdiv(out_features, block_n))
    split_k = split_k_count(tiling.split_k, tiling.block_k, planes, grid_tn[0] * grid_tn[1])
    partials = split_k > 1
    if tiling.slots3d:  # free reshapes: slot j's rows (groups) on axis 1
        x = x.reshape(tokens, PACK, planes)
        scales = scales.reshape(PACK, -1, out_features)
        zeros = zeros.reshape(PACK, -1, out_features)
        kernel = functools.partial(
            _w4a16_slots3d_kernel, group_size=group_size, block_t=block_t, block_n=block_n,
            block_k=tiling.block_k, steps_per_split=pl.cdiv(planes // tiling.block_k, split_k),
            partials=partials,
        )  # fmt: skip
    else:
        kernel = functools.partial(
            _w4a16_kernel,
            group_size=group_size,
            block_t=block_t,
            block_n=block_n,
            block_k=tiling.block_k,
            steps_per_split=pl.cdiv(planes // tiling.block_k, split_k),
            partials=partials,
            dot=tiling.dot,
            swap=tiling.dot and tiling.swap and not tiling.fold,
            magic=tiling.magic,
            fold=tiling.fold,
            defer=tiling.fold and tiling.defer and not tiling.dot,
        )

    def whole(shape):  # every program sees the whole array and masks its own tile
        return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))

    out_shape = (split_k, tokens, out_features) if partials else (tokens, out_features)
    out = pl.pallas_call(
        kernel,
        grid=(*grid_tn, split_k),
        in_specs=[whole(x.shape), whole(qweight.shape), whole(scales.shape), whole(zeros.shape)],
        out_specs=whole(out_shape),
        out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32 if partials else x.dtype),
        compiler_params=pltriton.CompilerParams(
            num_warps=tiling.num_warps,
            num_stages=_num_stages(tiling, block_t, jnp.dtype(x.dtype).itemsize),
        ),
        interpret=interpret,
        name="w4a16_matmul",
    )(x, qweight, scales, zeros)
    return jnp.sum(out, axis=0).astype(x.dtype) if partials else out


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def w4a16_matmul(
    x: jax.Array,
    qweight: jax.Array,
    scales: jax.Array,
    zeros: jax.Array,
    *,
    group_size: int,
    tiling: W4A16Tiling | None = None,
    interpret: bool = False,
) -> jax.Array:
    """``x @ W`` with ``W`` 4-bit, grouped, dequantized tile by tile inside the kernel.

    Args:
        x: ``[T, in]``, bfloat16, float16 or float32.
        qweight: ``i32[in / 8, out]`` in the kernel's plane layout (module docstring; made by
            ``models.quantization.w4a16``'s repacks).
        scales: ``[G, out]``, float16, bfloat16 or float32, ``G = in / group_size``.
        zeros: ``[G, out]`` integer zero points (``i8`` from the repacks).
        group_size: input rows per scale group (``in`` for one group per column).
        tiling: launch parameters; None: :func:`default_tiling` of ``T`` (read at trace time).
        interpret: run the Pallas kernel in interpret mode (CPU).

    Returns:
        ``[T, out]`` in ``x.dtype``. Products are summed in float32; with ``dot`` the weight
        tile ``(q - z) * s`` (formed in float32) is rounded once to ``x.dtype`` first, as
        ``awq_linear`` / ``gptq_linear`` do; without, it stays float32.

    Raises:
        ValueError: ``x`` not 2-D or of another dtype; ``qweight`` not ``i32[in / 8, out]``;
            ``scales``/``zeros`` not ``[in / group_size, out]`` of a float / integer dtype;
            ``group_size`` not dividing ``in``; a tile that is not a power of two (>= 16 for
            ``block_n``, ``block_k`` and, with ``dot``, ``block_t``), or a ``block_k`` not
            dividing ``in / 8`` and ``group_size`` (each message names the argument and the
            limit).
    """
    if x.ndim != 2 or str(x.dtype) not in _X_DTYPES:
        raise ValueError(f"x must be [T, in] of {_X_DTYPES}, got {x.dtype}{list(x.shape)}")
    tokens, in_features = x.shape
    if in_features % PACK or qweight.dtype != jnp.int32 or qweight.ndim != 2:
        raise ValueError(
            f"qweight must be int32 [in / 8, out] with in={in_features} a multiple of 8, got "
            f"{qweight.dtype}{list(qweight.shape)}"
        )
    if qweight.shape[0] != in_features // PACK:
        raise ValueError(
            f"qweight must be [in / 8 = {in_features // PACK}, out], got {list(qweight.shape)}"
        )
    planes, out_features = qweight.shape
    if group_size <= 0 or in_features % group_size:
        raise ValueError(f"group_size must divide in={in_features}, got {group_size}")
    groups = in_features // group_size
    if scales.shape != (groups, out_features) or str(scales.dtype) not in _SCALE_DTYPES:
        raise ValueError(
            f"scales must be [G={groups}, out={out_features}] of {_SCALE_DTYPES}, got "
            f"{scales.dtype}{list(scales.shape)}"
        )
    if zeros.shape != (groups, out_features) or not jnp.issubdtype(zeros.dtype, jnp.integer):
        raise ValueError(
            f"zeros must be integer [G={groups}, out={out_features}], got "
            f"{zeros.dtype}{list(zeros.shape)}"
        )
    tiling = default_tiling(tokens) if tiling is None else tiling
    if tiling.slots3d and planes % group_size:
        raise ValueError(
            f"slots3d needs group_size={group_size} to divide in / 8 = {planes} (each slot's "
            "rows must start on a group boundary)"
        )
    min_t = MIN_TILE if tiling.dot and not tiling.slots3d else 1
    for name, tile, least in (
        ("block_t", tiling.block_t, min_t),
        ("block_n", tiling.block_n, MIN_TILE),
        ("block_k", tiling.block_k, MIN_TILE),
    ):
        if not _is_pow2(tile) or tile < least:
            raise ValueError(f"{name} must be a power of two >= {least}, got {tile}")
    for dim_name, dim in (("in / 8", planes), ("group_size", group_size)):
        if dim % tiling.block_k:
            raise ValueError(f"block_k={tiling.block_k} must divide {dim_name}={dim}")
    if tiling.split_k is not None and tiling.split_k < 1:
        raise ValueError(f"split_k must be >= 1 or None, got {tiling.split_k}")
    zeros = zeros.astype(jnp.int8) if zeros.dtype != jnp.int8 else zeros
    return _w4a16_matmul(
        x, qweight, scales, zeros, group_size=int(group_size), tiling=tiling,
        interpret=bool(interpret),
    )  # fmt: skip


def largest_block_k(in_features: int, group_size: int, limit: int) -> int:
    """The largest power of two ``<= limit`` dividing ``in / 8`` and ``group_size`` (0 if it is
    below 16): the ``block_k`` a layer can take."""
    tile = 1 << (max(limit, 1).bit_length() - 1)
    while tile >= MIN_TILE and ((in_features // PACK) % tile or group_size % tile):
        tile //= 2
    return tile if tile >= MIN_TILE else 0


# --- Reference ------------------------------------------------------------------------------


def w4a16_matmul_reference(
    x: jax.Array, qweight: jax.Array, scales: jax.Array, zeros: jax.Array, *, group_size: int
) -> jax.Array:
    """Plain-JAX reference of :func:`w4a16_matmul`: the whole weight dequantized, then one dot.

    Same arguments (kernel layout); returns ``[T, out]`` in ``x.dtype``, computed in float32
    (``Precision.HIGHEST``) from the float32 dequantized weight.

    Raises:
        ValueError: ``scales`` does not have ``in / group_size`` rows.
    """
    if scales.shape[0] * group_size != x.shape[-1]:
        raise ValueError(
            f"scales must have in / group_size = {x.shape[-1]} / {group_size} rows, got "
            f"{scales.shape[0]}"
        )
    planes, out_features = qweight.shape
    shifts = 4 * jnp.arange(PACK, dtype=jnp.int32)[:, None, None]
    values = (qweight[None] >> shifts) & 0xF  # [j, r, o] = q[j * P + r, o]
    values = values.reshape(PACK * planes, out_features)
    group = jnp.arange(PACK * planes) // group_size
    offsets = values - zeros.astype(jnp.int32)[group]
    weight = offsets.astype(jnp.float32) * scales.astype(jnp.float32)[group]
    y = jnp.dot(x.astype(jnp.float32), weight, precision=lax.Precision.HIGHEST)
    return y.astype(x.dtype)
