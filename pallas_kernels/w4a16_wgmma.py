"""W4A16 matmul for many tokens on Hopper: 4-bit weights dequantized inside a tensor-core
(``wgmma``) main loop, written with Pallas Mosaic GPU.

Why: the Pallas Triton kernel (``pallas_kernels.w4a16_matmul``) dequantizes into ``tl.dot``
operands; at ``T = 256`` it measured 3.97x bf16's time per Llama-3-8B layer on an H100, and
XLA's fused dequantize-then-dot 2.17x (``docs/benchmarks.md``, "Quantized kernels"). A step of
many tokens is bound by tensor-core throughput, so the 4-bit weights must reach the tensor
cores without a round trip through HBM in bf16 and without Triton's layout conversions.

Status: checked on the CPU in Mosaic GPU's interpret mode (``InterpretGPUParams``: shared
memory, barriers, TMA and ``wgmma`` simulated, ``wgmma`` synchronously; its race detector
watches the TMA traffic), against ``w4a16_matmul_reference``. **Not yet compiled on a GPU**: the session that wrote it had no
device time. ``benchmarks/quant_kernels.py`` checks it against the reference before timing
it, and no engine path calls it until that run has passed (``models.linear_backends``).

Same contract and weight layout as ``w4a16_matmul``: ``qweight i32[P, out]`` (``P = in / 8``)
in eight planes along ``in`` (bits ``[4 j, 4 j + 4)`` of word ``[r, o]`` hold ``q[j P + r,
o]``), ``scales [G, out]``, ``zeros i8[G, out]``, ``W = (q - z) s`` per group.

Design, per output tile (``tile_m`` tokens x ``tile_n`` outputs; the grid covers ``T x out``):

- A pipeline step covers ``block_k`` words rows, i.e. ``block_k`` input rows in each of the
  eight planes. TMA brings the ``[block_k, tile_n]`` words tile, the eight ``[tile_m,
  block_k]`` activation tiles the planes multiply (rows ``j P + r0 ..`` of ``in``), and the
  eight planes' scale and zero rows, ``max_concurrent_steps`` steps ahead.
- The activations are viewed plane-major by one XLA transpose per call, ``x [T, 8, P] ->
  [8 T, P]``, so that each plane's tile is one 2-D TMA box (``T * in`` elements, small next to
  the weights' traffic at the ``T`` this kernel is for).
- ``block_k`` divides the group size and ``P`` is a whole number of groups, so the eight tiles
  of a step each sit in one group: the scales and zeros are ``[8, P / group_size, out]`` views
  (a free reshape) read one row per plane.
- Each plane's tile is unpacked in registers (``(w >> 4 j) & 0xF``, minus the zero, times the
  scale, in float32, rounded once to ``x``'s dtype as ``dequantize_groups`` does) in
  ``wgmma``'s register layout, stored to one of two swizzled shared-memory buffers, fenced
  (``commit_smem``) and multiplied by ``wgmma`` into a float32 accumulator. Two buffers let
  plane ``j + 1`` be dequantized while plane ``j``'s ``wgmma`` runs (``wgmma_wait(1)``).
- The epilogue rounds the accumulator to ``x``'s dtype and stores it by TMA.

Shared memory per CTA: ``stages * (8 * tile_m * block_k * e + 4 * block_k * tile_n +
8 * tile_n * (e_s + 1)) + 2 * block_k * tile_n * e + tile_m * tile_n * e`` bytes (``e``: bytes
of ``x``'s dtype, ``e_s``: of the scales); :func:`smem_bytes`.

The alternative, if staging through shared memory costs too much: ``wgmma`` with the
dequantized weight as its register operand A (weights stored ``int4 [out, in]``, loaded with
Mosaic's ``WGMMA_UPCAST_4X`` layout, the activations as a transposed shared-memory view B,
the result transposed), as Google's tokamax quantized ``ragged_dot`` does on Hopper. Mosaic
GPU's interpreter in JAX 0.11 cannot run a register operand (``wgmma`` from registers raises
there), so that design can be checked only on a GPU; this one was chosen to be checkable here.

Sources: the wgmma + TMA pipeline follows the structure of JAX's
``jax.experimental.pallas.ops.gpu.hopper_mixed_type_matmul_mgpu`` (int8 x bf16); the
dequantize-in-the-main-loop idea is CUTLASS's Hopper mixed-input GEMM (example 55) and
Marlin's (Frantar et al., 2024).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

PACK = 8  # 4-bit values per int32 word (the planes of the layout)
SMEM_BUDGET = 227 * 1024  # bytes of shared memory one Hopper CTA may use
_X_DTYPES = ("bfloat16", "float16")  # wgmma's 16-bit operands


@dataclasses.dataclass(frozen=True)
class WgmmaTiling:
    """Static launch parameters of :func:`w4a16_wgmma` (unmeasured defaults).

    Attributes:
        tile_m: tokens per output tile (a multiple of 64: one warpgroup's ``wgmma`` rows);
            ``T`` is padded up to a multiple.
        tile_n: outputs per tile (a multiple of 64; must divide ``out``).
        block_k: words rows per pipeline step (64: the rows of ``wgmma``'s register layout;
            must divide ``in / 8`` and the group size).
        stages: pipeline steps in flight (``max_concurrent_steps``).
    """

    tile_m: int = 64
    tile_n: int = 64
    block_k: int = 64
    stages: int = 2


DEFAULT_TILING = WgmmaTiling()


def smem_bytes(tiling: WgmmaTiling, x_itemsize: int = 2, scale_itemsize: int = 2) -> int:
    """Shared memory one CTA of :func:`w4a16_wgmma` allocates (bytes; module docstring)."""
    t = tiling
    step = (
        PACK * t.tile_m * t.block_k * x_itemsize  # the eight activation tiles
        + 4 * t.block_k * t.tile_n  # the words tile
        + PACK * t.tile_n * (scale_itemsize + 1)  # eight scale rows and eight zero rows
    )
    return (
        t.stages * step + 2 * t.block_k * t.tile_n * x_itemsize + t.tile_m * t.tile_n * x_itemsize
    )


def _transforms(columns: int, bits: int) -> tuple:
    """Tiling and swizzle of a shared-memory tile whose rows hold ``columns`` elements."""
    swizzle = plgpu.find_swizzle(columns * bits)
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


def _check(x, qweight, scales, zeros, group_size: int, tiling: WgmmaTiling) -> None:
    """The argument checks of :func:`w4a16_wgmma` (its Raises)."""
    if x.ndim != 2 or str(x.dtype) not in _X_DTYPES:
        raise ValueError(f"x must be [T, in] of {_X_DTYPES}, got {x.dtype}{list(x.shape)}")
    in_features = x.shape[1]
    if qweight.dtype != jnp.int32 or qweight.ndim != 2 or qweight.shape[0] * PACK != in_features:
        raise ValueError(
            f"qweight must be int32 [in / 8 = {in_features / PACK:g}, out], got "
            f"{qweight.dtype}{list(qweight.shape)}"
        )
    planes, out_features = qweight.shape
    if group_size <= 0 or planes % group_size:
        raise ValueError(
            f"group_size must divide in / 8 = {planes} (each plane a whole number of groups), "
            f"got {group_size}"
        )
    groups = in_features // group_size
    if scales.shape != (groups, out_features) or not jnp.issubdtype(scales.dtype, jnp.floating):
        raise ValueError(
            f"scales must be float [G={groups}, out={out_features}], got "
            f"{scales.dtype}{list(scales.shape)}"
        )
    if zeros.shape != (groups, out_features) or not jnp.issubdtype(zeros.dtype, jnp.integer):
        raise ValueError(
            f"zeros must be integer [G={groups}, out={out_features}], got "
            f"{zeros.dtype}{list(zeros.shape)}"
        )
    if tiling.tile_m % 64 or tiling.tile_n % 64 or tiling.tile_m <= 0 or tiling.tile_n <= 0:
        raise ValueError(
            f"tile_m and tile_n must be positive multiples of 64, got {tiling.tile_m} and "
            f"{tiling.tile_n}"
        )
    if out_features % tiling.tile_n:
        raise ValueError(f"tile_n={tiling.tile_n} must divide out={out_features}")
    if tiling.block_k % 64 or planes % tiling.block_k or group_size % tiling.block_k:
        raise ValueError(
            f"block_k must be a multiple of 64 dividing in / 8 = {planes} and group_size = "
            f"{group_size}, got {tiling.block_k}"
        )
    if tiling.stages < 1:
        raise ValueError(f"stages must be >= 1, got {tiling.stages}")
    need = smem_bytes(tiling, x.dtype.itemsize, scales.dtype.itemsize)
    if need > SMEM_BUDGET:
        raise ValueError(
            f"tiling {tiling} needs {need} bytes of shared memory, more than {SMEM_BUDGET}"
        )


def w4a16_wgmma(
    x: jax.Array,
    qweight: jax.Array,
    scales: jax.Array,
    zeros: jax.Array,
    *,
    group_size: int,
    tiling: WgmmaTiling | None = None,
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> jax.Array:
    """``x @ W`` with ``W`` 4-bit and grouped, dequantized inside a ``wgmma`` main loop.

    Args:
        x: ``[T, in]``, bfloat16 or float16.
        qweight: ``i32[in / 8, out]`` in the plane layout of ``pallas_kernels.w4a16_matmul``
            (made by ``models.quantization.w4a16``'s repacks).
        scales: ``[G, out]`` float, ``G = in / group_size``.
        zeros: ``[G, out]`` integer zero points (0 .. 16).
        group_size: input rows per group; must divide ``in / 8``.
        tiling: launch parameters (None: :data:`DEFAULT_TILING`).
        interpret: run in Mosaic GPU's interpret mode (CPU; simulates shared memory, barriers
            and ``wgmma``); True for default ``InterpretGPUParams``, or the params themselves
            (e.g. ``detect_races=True``).

    Returns:
        ``[T, out]`` in ``x.dtype``: float32 sums of ``x`` times the weight rounded once to
        ``x.dtype`` (as ``awq_linear`` and ``gptq_linear``).

    Raises:
        ValueError: ``x`` not 2-D bf16/f16; ``qweight``, ``scales`` or ``zeros`` of the wrong
            shape or dtype; ``group_size`` not dividing ``in / 8``; tiles that are not
            multiples of 64, a ``tile_n`` not dividing ``out``, a ``block_k`` not dividing
            ``in / 8`` and ``group_size``, or a tiling over :data:`SMEM_BUDGET` (each message
            names the argument and the limit).
    """
    tiling = DEFAULT_TILING if tiling is None else tiling
    _check(x, qweight, scales, zeros, group_size, tiling)
    return _w4a16_wgmma(
        x, qweight, scales, zeros.astype(jnp.int8), group_size=int(group_size), tiling=tiling,
        interpret=plgpu.InterpretGPUParams() if interpret is True else interpret or None,
    )  # fmt: skip


@functools.partial(jax.jit, static_argnames=("group_size", "tiling", "interpret"))
def _w4a16_wgmma(x, qweight, scales, zeros, *, group_size, tiling, interpret):
    tokens = x.shape[0]
    planes, out_features = qweight.shape
    t = tiling
    padded = -(-tokens // t.tile_m) * t.tile_m
    m_tiles = padded // t.tile_m
    # Plane-major activations: row j * padded + i of ``xt`` is token i's inputs of plane j.
    xt = jnp.pad(x, ((0, padded - tokens), (0, 0))).reshape(padded, PACK, planes)
    xt = xt.transpose(1, 0, 2).reshape(PACK * padded, planes)
    per_plane = planes // group_size  # groups per plane: group j * per_plane + r // group_size
    scales3 = scales.reshape(PACK, per_plane, out_features)
    zeros3 = zeros.reshape(PACK, per_plane, out_features)
    dtype = x.dtype
    bits = 8 * dtype.itemsize
    tile_shape = (t.block_k, t.tile_n)

    def kernel(x_gmem, words_gmem, scales_gmem, zeros_gmem, out_gmem, *, dequantized, out_smem):
        m = lax.axis_index("m")
        n = lax.axis_index("n")

        @functools.partial(pl.run_scoped, acc=plgpu.ACC((t.tile_m, t.tile_n), jnp.float32))
        def _accumulate(acc):
            def step(_, *tiles):
                x_tiles, (words_smem, scales_smem, zeros_smem) = tiles[:PACK], tiles[PACK:]
                words = plgpu.load(words_smem, layout=plgpu.Layout.WGMMA)
                row = plgpu.Layout.WGMMA.reduce(0)  # a vector along the tile's columns
                for j in range(PACK):
                    zero = plgpu.load(zeros_smem.at[j, 0], layout=row).astype(jnp.int32)
                    scale = plgpu.load(scales_smem.at[j, 0], layout=row).astype(jnp.float32)
                    q = lax.shift_right_logical(words, jnp.int32(4 * j)) & 0xF
                    q = q - lax.broadcast_in_dim(zero, tile_shape, [1])
                    weight = q.astype(jnp.float32) * lax.broadcast_in_dim(scale, tile_shape, [1])
                    buffer = dequantized.at[j % 2]
                    buffer[...] = weight.astype(dtype)
                    plgpu.commit_smem()  # the stores, visible to the tensor cores
                    plgpu.wgmma(acc, x_tiles[j], buffer)
                    plgpu.wgmma_wait(1)  # plane j - 1's product done: its buffer is free
                plgpu.wgmma_wait(0)  # the step's tiles are refilled once the body returns

            x_specs = [
                plgpu.BlockSpec(
                    (t.tile_m, t.block_k),
                    functools.partial(lambda k, j: (j * m_tiles + m, k), j=j),
                    transforms=_transforms(t.block_k, bits),
                )
                for j in range(PACK)
            ]
            group_row = lambda k: (0, (k * t.block_k) // group_size, n)  # noqa: E731
            plgpu.emit_pipeline(
                step,
                grid=(planes // t.block_k,),
                in_specs=[
                    *x_specs,
                    plgpu.BlockSpec(tile_shape, lambda k: (k, n)),
                    plgpu.BlockSpec((PACK, 1, t.tile_n), group_row),
                    plgpu.BlockSpec((PACK, 1, t.tile_n), group_row),
                ],
                max_concurrent_steps=t.stages,
            )(*([x_gmem] * PACK), words_gmem, scales_gmem, zeros_gmem)
            out_smem[...] = acc[...].astype(dtype)

        plgpu.commit_smem()
        rows, cols = pl.ds(m * t.tile_m, t.tile_m), pl.ds(n * t.tile_n, t.tile_n)
        plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[rows, cols])
        plgpu.wait_smem_to_gmem(0)

    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((padded, out_features), dtype),
        grid=(m_tiles, out_features // t.tile_n),
        grid_names=("m", "n"),
        scratch_types=dict(
            dequantized=plgpu.SMEM((2, *tile_shape), dtype, transforms=_transforms(t.tile_n, bits)),
            out_smem=plgpu.SMEM(
                (t.tile_m, t.tile_n), dtype, transforms=_transforms(t.tile_n, bits)
            ),
        ),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret,
    )
    return call(xt, qweight, scales3, zeros3)[:tokens]
