"""W4A16 matmul: 16-bit (or float32) activations times 4-bit grouped weights, dequantized in-kernel.

Layout of this file: the kernel layout's description, the Pallas kernel body, the public
``w4a16_matmul`` with its argument checks and tile choice, and last the plain-JAX
``w4a16_matmul_reference``, which shares no code with the kernel. The host-side repacks from the
stored AWQ GEMM and GPTQ formats are ``models.quantization.w4a16`` (imports point
``pallas_kernels`` <- ``models``).

Why a kernel: on the H200, XLA compiles ``models.quantization.awq.awq_linear`` at ``T = 1`` into
a loop fusion that reads the packed weights at about 223 GB/s, against 2.7 TB/s for the bf16
GEMV (``docs/benchmarks.md``, "Quantized linears (issue 14)"). This kernel streams the packed
words and dequantizes each K-tile in registers. Its GPU speed is not measured yet
(``scripts/benchmark_quantized_linear.py --methods bf16,awq,pallas``).

Kernel layout (``in`` inputs, ``out`` outputs, ``G = in // group_size`` groups, ``P = in // 8``):

- ``qweight: i32[P, out]``, packed along ``in`` in eight *planes*: bits ``[4 j, 4 j + 4)``
  (slot ``j``) of word ``[r, o]`` hold ``q[j * P + r, o]``. Slot ``j`` of a run of words
  ``r0 .. r0 + block_k - 1`` is therefore the contiguous row range ``j * P + r0 ..`` of the
  weight, so a K-step unpacks eight ``[block_k, block_n]`` tiles with one shift and one mask
  each and multiplies them by eight contiguous ``[block_t, block_k]`` slices of ``x``: no
  interleaving reshape, no strided load, and the layout does not depend on the tile sizes.
- ``scales: [G, out]`` (float16, bfloat16 or float32) and ``zeros: i8[G, out]`` (unpacked zero
  points, ``0 .. 16``; GPTQ v1's stored ``15`` reads as ``16``).

The weight is ``W[i, o] = (q[i, o] - zeros[i // group_size, o]) * scales[i // group_size, o]``
(AWQ's and GPTQ's formula) and the result is ``x @ W``.

Backend: on GPU ``pallas_call`` lowers through the Pallas Triton backend; on CPU it runs with
``interpret=True``. Triton needs power-of-two tiles of at least 16 for a dot, so the T tile of
a decode step (``T = 1``, a GEMV) is padded to 16 rows: ``x`` is zero-padded to a multiple of
``block_t`` and the padding rows are dropped from the result.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

PACK = 8  # 4-bit values per int32 word
MIN_TILE = 16  # Triton's smallest dot dimension
_X_DTYPES = ("bfloat16", "float16", "float32")
_SCALE_DTYPES = ("bfloat16", "float16", "float32")
# Launch defaults, not measured yet: 64 output columns per program (out=4096 gives 64 programs
# per T tile), K-steps of up to 64 words (512 input rows, eight dots of 64), T tiles of 16..64.
_BLOCK_N = 64
_BLOCK_K = 64
_MAX_BLOCK_T = 64
_NUM_WARPS = 4
_NUM_STAGES = 3
# Shared memory a Triton program may use on the H200 is 232,448 bytes (227 KiB); pipelining keeps
# one K-step's tiles per stage, so the stage count is cut until they fit, with headroom for the
# compiler's own buffers (T=1024, bf16, 64/64/64 tiles at 3 stages asked for 240,640 bytes).
_SHARED_MEMORY_BUDGET = 200 * 1024


# --- The kernel -----------------------------------------------------------------------------


def _w4a16_kernel(
    x_ref,  # [block_t, in]: this program's rows of x
    w_ref,  # i32[P, block_n]: this program's columns of the plane-packed weight
    s_ref,  # [G, block_n]: scales
    z_ref,  # i8[G, block_n]: zero points
    o_ref,  # [block_t, block_n]
    *,
    planes: int,
    group_size: int,
    block_k: int,
):
    block_t, block_n = o_ref.shape
    dtype = x_ref.dtype
    # float32 x: true float32 dots (Triton would otherwise use TF32 on the GPU).
    precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None

    def body(step, acc):
        r0 = pl.multiple_of(step * block_k, block_k)
        words = w_ref[pl.ds(r0, block_k), :]  # [block_k, block_n]
        for j in range(PACK):
            row0 = j * planes + r0  # first weight row of slot j: block_k rows in one group
            group = row0 // group_size
            zero = z_ref[pl.ds(group, 1), :].astype(jnp.int32)  # [1, block_n]
            scale = s_ref[pl.ds(group, 1), :].astype(jnp.float32)
            q = jnp.right_shift(words, 4 * j) & 0xF
            # (q - z) * s in float32, rounded once to x's dtype, as dequantize_groups does.
            w = ((q - zero).astype(jnp.float32) * scale).astype(dtype)
            xs = x_ref[:, pl.ds(pl.multiple_of(row0, block_k), block_k)]
            acc += jnp.dot(xs, w, precision=precision, preferred_element_type=jnp.float32)
        return acc

    acc = lax.fori_loop(0, planes // block_k, body, jnp.zeros((block_t, block_n), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _num_stages(block_t: int, block_n: int, block_k: int, x_itemsize: int) -> int:
    """Pipeline stages whose tiles fit ``_SHARED_MEMORY_BUDGET``: one K-step holds eight
    ``[block_t, block_k]`` slices of ``x`` and one ``i32[block_k, block_n]`` tile of words."""
    per_stage = 8 * block_t * block_k * x_itemsize + 4 * block_k * block_n
    return max(1, min(_NUM_STAGES, _SHARED_MEMORY_BUDGET // per_stage))


@functools.partial(
    jax.jit, static_argnames=("group_size", "block_t", "block_n", "block_k", "interpret")
)
def _w4a16_matmul(x, qweight, scales, zeros, *, group_size, block_t, block_n, block_k, interpret):
    tokens, in_features = x.shape
    planes, out_features = qweight.shape
    groups = scales.shape[0]
    padded = pl.cdiv(tokens, block_t) * block_t
    if padded != tokens:
        x = jnp.pad(x, ((0, padded - tokens), (0, 0)))
    kernel = functools.partial(_w4a16_kernel, planes=planes, group_size=group_size, block_k=block_k)
    out = pl.pallas_call(
        kernel,
        grid=(out_features // block_n, padded // block_t),
        in_specs=[
            pl.BlockSpec((block_t, in_features), lambda n, t: (t, 0)),
            pl.BlockSpec((planes, block_n), lambda n, t: (0, n)),
            pl.BlockSpec((groups, block_n), lambda n, t: (0, n)),
            pl.BlockSpec((groups, block_n), lambda n, t: (0, n)),
        ],
        out_specs=pl.BlockSpec((block_t, block_n), lambda n, t: (t, n)),
        out_shape=jax.ShapeDtypeStruct((padded, out_features), x.dtype),
        compiler_params=pltriton.CompilerParams(
            num_warps=_NUM_WARPS,
            num_stages=_num_stages(block_t, block_n, block_k, jnp.dtype(x.dtype).itemsize),
        ),
        interpret=interpret,
        name="w4a16_matmul",
    )(x, qweight, scales, zeros)
    return out[:tokens]


def _is_tile(n: int) -> bool:
    return n >= MIN_TILE and n & (n - 1) == 0


def _largest_tile_dividing(n: int, limit: int) -> int:
    """The largest power of two ``<= limit`` dividing ``n`` (0 if it is below 16)."""
    tile = 1 << (max(limit, 1).bit_length() - 1)
    while tile >= MIN_TILE and n % tile:
        tile //= 2
    return tile if tile >= MIN_TILE else 0


def w4a16_matmul(
    x: jax.Array,
    qweight: jax.Array,
    scales: jax.Array,
    zeros: jax.Array,
    *,
    group_size: int,
    block_t: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """``x @ W`` with ``W`` 4-bit, grouped, dequantized tile by tile inside the kernel.

    Args:
        x: ``[T, in]``, bfloat16, float16 or float32.
        qweight: ``i32[in / 8, out]`` in the kernel's plane layout (module docstring; made by
            ``models.quantization.w4a16.repack_awq`` / ``repack_gptq``).
        scales: ``[G, out]``, float16, bfloat16 or float32, ``G = in / group_size``.
        zeros: ``[G, out]`` integer zero points (``i8`` from the repacks).
        group_size: input rows per scale group (``in`` for one group per column).
        block_t: rows of ``x`` per program, a power of two >= 16; default the smallest such
            tile holding ``T``, at most 64 (a decode step's ``T = 1`` is padded to 16 rows).
        block_n: output columns per program, a power of two >= 16 dividing ``out``; default 64
            or the largest power of two below it that divides ``out``.
        block_k: packed words (per plane) per loop step, a power of two >= 16 dividing both
            ``in / 8`` and ``group_size``; default the largest such tile up to 64. Each step
            makes eight dots of ``[block_t, block_k] x [block_k, block_n]``.
        interpret: run the Pallas kernel in interpret mode (CPU).

    Returns:
        ``[T, out]`` in ``x.dtype``. The weight tile is ``(q - z) * s`` formed in float32 and
        rounded once to ``x.dtype`` (as ``awq_linear`` / ``gptq_linear`` do), and the dots
        accumulate in float32.

    Raises:
        ValueError: ``x`` not 2-D or of another dtype; ``qweight`` not ``i32[in / 8, out]``;
            ``scales``/``zeros`` not ``[in / group_size, out]`` of a float / integer dtype;
            ``group_size`` not dividing ``in``; a tile that is not a power of two >= 16 or does
            not divide its dimension (each message names the argument and the limit).
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
    if block_t is None:
        block_t = min(_MAX_BLOCK_T, max(MIN_TILE, pl.next_power_of_2(tokens)))
    if block_n is None:
        block_n = _largest_tile_dividing(out_features, _BLOCK_N)
        if not block_n:
            raise ValueError(f"out must be a multiple of {MIN_TILE}, got {out_features}")
    if block_k is None:
        block_k = _largest_tile_dividing(math.gcd(planes, group_size), _BLOCK_K)
        if not block_k:
            raise ValueError(
                f"in / 8 = {planes} and group_size = {group_size} must share a power-of-two "
                f"factor >= {MIN_TILE}"
            )
    for name, tile, dims in (
        ("block_t", block_t, ()),
        ("block_n", block_n, (("out", out_features),)),
        ("block_k", block_k, (("in / 8", planes), ("group_size", group_size))),
    ):
        if not _is_tile(tile):
            raise ValueError(f"{name} must be a power of two >= {MIN_TILE}, got {tile}")
        for dim_name, dim in dims:
            if dim % tile:
                raise ValueError(f"{name}={tile} must divide {dim_name}={dim}")
    zeros = zeros.astype(jnp.int8) if zeros.dtype != jnp.int8 else zeros
    return _w4a16_matmul(
        x,
        qweight,
        scales,
        zeros,
        group_size=int(group_size),
        block_t=int(block_t),
        block_n=int(block_n),
        block_k=int(block_k),
        interpret=bool(interpret),
    )


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
