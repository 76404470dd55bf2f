"""Every Pallas kernel, at every variant and tiling an engine can select, lowered on this CPU
for the H100 and the H200 (``models.platform.abstract_gpu``): a kernel the Triton or Mosaic GPU
lowering rejects fails here, named, instead of in a GPU session.

Shapes are the real models' (Llama-3-8B's layers and heads unless a case says otherwise): the
tilings, split counts and masks an engine picks depend on them. Each case is traced once and
lowered for both cards. The engines' whole step programs are lowered per matrix row in
``test_engine_steps.py``; what this file adds is the variants a small engine cannot reach
(long contexts that split the decode kernel, every ``W4A16`` tiling by token count, the grouped
GEMM's tile table, the 8-bit GEMV and MoE decode kernels at real widths).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels
from models.lora import lora_delta
from models.platform import GPU_DEVICE_KINDS, abstract_gpu
from models.quantization.w4a16 import w4a16_linear
from models.quantization.w8a8 import W8_GEMV_MAX_TOKENS, weight_only_linear
from pallas_kernels.expert_gemv import expert_gemv
from pallas_kernels.grouped_matmul import TILE_TABLE, grouped_matmul
from pallas_kernels.w4a16_matmul import DEFAULT_TILINGS, W4A16Tiling, w4a16_matmul
from pallas_kernels.w4a16_wgmma import w4a16_wgmma
from pallas_kernels.w8_gemv import W8GemvTiling, w8_gemv

S = jax.ShapeDtypeStruct
TRITON = "__gpu$xla.gpu.triton"
MOSAIC = "mosaic_gpu_v2"
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


@dataclasses.dataclass(frozen=True)
class Case:
    """One lowering: ``build()`` gives ``(fn, args)``; the lowered text must hold ``target``
    (the kernel's custom call) at least ``count`` times."""

    kernel: str
    name: str
    build: Callable[[], tuple[Callable, tuple]]
    target: str = TRITON
    count: int = 1

    @property
    def id(self) -> str:
        return f"{self.kernel}-{self.name}"


# ----------------------------------------------------------------------------- attention
@dataclasses.dataclass(frozen=True)
class Attention:
    """An attention call's static shape: ``q`` dtype, cache dtype, heads, ``D``, block size,
    sequences, block-table columns (context / block size), and the model's options."""

    dtype: object = BF16
    cache: object = None  # None: the query's dtype
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    seqs: int = 1
    max_blocks: int = 128  # 2048 tokens of 16
    soft_cap: float | None = None
    window: int | None = None
    alibi: bool = False

    def caches(self):
        cache = self.cache or self.dtype
        shape = (self.seqs * self.max_blocks + 1, self.block_size, self.kv_heads, self.head_dim)
        return S(shape, cache), S(shape, cache)

    def options(self) -> tuple[dict, tuple]:
        """Static keyword arguments and the traced extras (slopes, FP8 scales)."""
        static = dict(scale=self.head_dim**-0.5, soft_cap=self.soft_cap, sliding_window=self.window)
        extras = (S((self.heads,), F32) if self.alibi else None,
                  S((), F32) if self.cache in (E4M3, E5M2) else None)  # fmt: skip
        return static, extras


def decode(spec: Attention) -> Callable:
    def build():
        static, extras = spec.options()

        def fn(q, k, v, tables, lens, alibi, kv_scale):
            return pallas_kernels.paged_attention(
                q, k, v, tables, lens, alibi_slopes=alibi, k_scale=kv_scale, v_scale=kv_scale,
                **static,
            )  # fmt: skip

        q = S((spec.seqs, spec.heads, spec.head_dim), spec.dtype)
        tables = S((spec.seqs, spec.max_blocks), jnp.int32)
        return fn, (q, *spec.caches(), tables, S((spec.seqs,), jnp.int32), *extras)

    return build


def ragged(spec: Attention, tokens: int) -> Callable:
    def build():
        static, extras = spec.options()

        def fn(q, k, v, tables, lens, cu_q_lens, alibi, kv_scale):
            return pallas_kernels.ragged_paged_attention(
                q, k, v, tables, lens, cu_q_lens, alibi_slopes=alibi, k_scale=kv_scale,
                v_scale=kv_scale, **static,
            )  # fmt: skip

        q = S((tokens, spec.heads, spec.head_dim), spec.dtype)
        tables = S((spec.seqs, spec.max_blocks), jnp.int32)
        seqs = S((spec.seqs,), jnp.int32)
        return fn, (q, *spec.caches(), tables, seqs, S((spec.seqs + 1,), jnp.int32), *extras)

    return build


# The models' attention geometries and options (block sizes: every BLOCK_SIZE_CHOICES value).
ATTENTION = {
    "llama3-bf16": Attention(),
    "llama3-f16-fp8-e4m3": Attention(dtype=F16, cache=E4M3, block_size=32, max_blocks=64),
    "llama3-bf16-fp8-e5m2": Attention(cache=E5M2, block_size=8, max_blocks=256),
    "llama3-f32": Attention(dtype=F32, block_size=64, max_blocks=32),
    "gemma2-softcap-window": Attention(
        heads=16, head_dim=256, soft_cap=50.0, window=4096, max_blocks=512
    ),  # fmt: skip
    "mistral-window": Attention(window=4096, block_size=128, max_blocks=256),
    "qwen2.5-group7": Attention(heads=28, kv_heads=4),
    "phi3-mha-padded-d128": Attention(kv_heads=32),
    "bloom-alibi": Attention(heads=16, kv_heads=16, head_dim=64, alibi=True),
    "gpt2-f32-mha": Attention(dtype=F32, heads=12, kv_heads=12, head_dim=64),
    "stories-f32-d8": Attention(dtype=F32, heads=8, kv_heads=4, head_dim=8, max_blocks=32),
}
CASES = []
for _name, _spec in ATTENTION.items():
    # Batch 1 at 2048+ tokens splits the decode kernel (flash-decoding); 512 sequences do not.
    CASES.append(Case("paged_attention", f"{_name}-b1-split", decode(_spec)))
    CASES.append(Case("ragged_paged_attention", f"{_name}-t16", ragged(_spec, 16)))
for _name in ("llama3-bf16", "llama3-f16-fp8-e4m3"):
    _wide = dataclasses.replace(ATTENTION[_name], seqs=512)
    CASES.append(Case("paged_attention", f"{_name}-b512", decode(_wide)))
    CASES.append(Case("ragged_paged_attention", f"{_name}-t4096-b512", ragged(_wide, 4096)))


# -------------------------------------------------------------------- quantized linears
def w4a16_layer(tokens: int, in_features: int, out_features: int, group: int, dtype,
                tiling: W4A16Tiling | None = None) -> Callable:  # fmt: skip
    """The engine's call (``models.quantization.w4a16.w4a16_linear``: the default tiling of
    ``T``, ``block_k`` cut to the layer) or, with ``tiling``, the kernel at that tiling."""

    def build():
        groups = in_features // group
        params = dict(qweight=S((in_features // 8, out_features), jnp.int32),
                      scales=S((groups, out_features), dtype),
                      zeros=S((groups, out_features), jnp.int8))  # fmt: skip
        x = S((tokens, in_features), dtype)
        if tiling is None:
            return (lambda x, p: w4a16_linear(x, p)), (x, params)
        fn = functools.partial(w4a16_matmul, group_size=group, tiling=tiling)
        return fn, (x, params["qweight"], params["scales"], params["zeros"])

    return build


# Token counts: each DEFAULT_TILINGS range (``auto`` sends T <= 32 to the kernel; ``pallas``
# sends every T), a 1-token tail; layers: qkv, down (K = 14336), an N tail; AWQ / GPTQ group 128
# and the small group 32 of tests' checkpoints.
for _t in sorted({1, *(t for t, _ in DEFAULT_TILINGS if t is not None), 4096}):
    for _dtype in (BF16, F16):
        for _shape in ((4096, 6144, 128), (14336, 4096, 128), (4096, 4100, 128),
                       (1024, 256, 32)):  # fmt: skip
            _id = f"t{_t}-{'x'.join(map(str, _shape))}-{jnp.dtype(_dtype).name}"
            CASES.append(Case("w4a16_matmul", _id, w4a16_layer(_t, *_shape, _dtype)))
for _name, _tiling in (  # the micro-benchmark's sweep tilings
    ("swap", W4A16Tiling(block_t=16, block_n=128, block_k=32, swap=True)),
    ("elementwise", W4A16Tiling(block_t=4, block_n=64, block_k=32, dot=False, magic=False)),
    ("fold", W4A16Tiling(block_t=16, block_n=64, block_k=32, fold=True)),
):
    CASES.append(Case("w4a16_matmul", f"sweep-{_name}",
                      w4a16_layer(16, 4096, 4100, 128, BF16, _tiling)))  # fmt: skip


def w8_layer(tokens, in_features, out_features, w_dtype, x_dtype, per_channel, tiling=None):
    def build():
        scale = S((out_features,) if per_channel else (1,), F32)
        w, x = S((out_features, in_features), w_dtype), S((tokens, in_features), x_dtype)
        if tiling is None:  # the engine's call (models.quantization.w8a8)
            return weight_only_linear, (x, w, scale)
        return functools.partial(w8_gemv, tiling=tiling), (x, w, scale)

    return build


for _t in (1, W8_GEMV_MAX_TOKENS):
    for _w in (E4M3, jnp.int8):
        for _x in (BF16, F16, F32):
            CASES.append(Case("w8_gemv", f"t{_t}-{jnp.dtype(_w).name}-{jnp.dtype(_x).name}",
                              w8_layer(_t, 4096, 6144, _w, _x, _x != F16)))  # fmt: skip
    CASES.append(
        Case("w8_gemv", f"t{_t}-down-int8", w8_layer(_t, 14336, 4096, jnp.int8, BF16, True))
    )
_W8_SWEEP = (  # the micro-benchmark's sweep variants
    W8GemvTiling(max_block_t=1, block_n=32, block_k=64, split_k=3, dot=False),
    W8GemvTiling(max_block_t=4, block_n=32, block_k=64, split_k=2, dot=False, bits=True),
    W8GemvTiling(block_n=32, block_k=64, split_k=3, bits=True, num_warps=8),
)
CASES += [Case("w8_gemv", f"sweep{_i}-{jnp.dtype(_w).name}",
               w8_layer(16, 4096, 4100, _w, BF16, True, _tiling))
          for _i, _tiling in enumerate(_W8_SWEEP) for _w in (E4M3, jnp.int8)]  # fmt: skip


def w4a16_wgmma_layer(tokens, dtype):
    def build():
        fn = functools.partial(w4a16_wgmma, group_size=128)
        return fn, (S((tokens, 4096), dtype), S((512, 4096), jnp.int32), S((32, 4096), dtype),
                    S((32, 4096), jnp.int8))  # fmt: skip

    return build


# Not selected by any engine path yet: lowered so that it stays lowerable for Hopper.
CASES += [Case("w4a16_wgmma", f"t{_t}-{jnp.dtype(_d).name}", w4a16_wgmma_layer(_t, _d), MOSAIC)
          for _t, _d in ((64, BF16), (100, F16))]  # fmt: skip


# ------------------------------------------------------------------------------ LoRA, MoE
def lora_layer(tokens, dtype, max_loras, rank, out_features):
    def build():
        cols = max_loras * rank
        fn = functools.partial(lora_delta, max_loras=max_loras, path="bgmv")
        return fn, (S((tokens, 4096), dtype), S((tokens,), jnp.int32), S((4096, cols), dtype),
                    S((cols, out_features), dtype))  # fmt: skip

    return build


# The bgmv path runs up to models.lora.LORA_KERNEL_MAX_TOKENS tokens (0 until measured; the
# matrix's lora-bgmv row raises it): decode and a 16-token step, qkv's C = 3 * 16 and o_proj's.
CASES += [Case("lora_bgmv", f"t{_t}-{jnp.dtype(_d).name}-loras{_s}-c{_c}",
               lora_layer(_t, _d, _s, _c, _o))
          for _t, _d, _s, _c, _o in ((1, BF16, 4, 48, 6144), (16, F16, 2, 16, 4096),
                                     (3, F32, 8, 48, 6144))]  # fmt: skip


def expert_layer(rows, dtype, k, n):
    def build():
        return expert_gemv, (S((rows, k), dtype), S((rows,), jnp.int32), S((8, k, n), dtype))

    return build


# Mixtral-8x7B decode (T * top-2 rows up to models.moe.DECODE_MAX_ROWS): gate_up and down.
CASES += [Case("expert_gemv", f"rows{_m}-{jnp.dtype(_d).name}-{_k}x{_n}",
               expert_layer(_m, _d, _k, _n))
          for _m, _d, _k, _n in ((2, BF16, 4096, 28672), (32, BF16, 14336, 4096),
                                 (8, F16, 4096, 28672))]  # fmt: skip


def grouped(rows, dtype, k, n):
    def build():
        fn = functools.partial(grouped_matmul, backend="mosaic_gpu")
        return fn, (S((rows, k), dtype), S((8, k, n), dtype), S((8,), jnp.int32))

    return build


# Mixtral's prefill experts: every TILE_TABLE entry's M range at its (K, N), and the default
# tiles above them; a ragged M (padded to a multiple of 8 for the TMA loads).
_GROUPED = sorted(
    {(m, k, n) for m, k, n, _ in TILE_TABLE} | {(8192, 4096, 28672), (130, 14336, 4096)}
)
CASES += [Case("grouped_matmul", f"m{_m}-{_k}x{_n}", grouped(_m, BF16, _k, _n), MOSAIC)
          for _m, _k, _n in _GROUPED]  # fmt: skip
CASES.append(Case("grouped_matmul", "m64-f16", grouped(64, F16, 4096, 28672), MOSAIC))


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_kernel_lowers_for_the_h100_and_the_h200(case):
    fn, args = case.build()
    kinds = list(GPU_DEVICE_KINDS.items())
    with abstract_gpu(kinds[0][1]):  # traced once: the trace reads the target platform
        try:
            traced = jax.jit(fn).trace(*args)
        except Exception as error:  # noqa: BLE001 - reported with the kernel's name
            pytest.fail(f"Pallas kernel {case.kernel} ({case.name}) does not trace for a GPU: "
                        f"{type(error).__name__}: {error}")  # fmt: skip
    for card, kind in kinds:
        with abstract_gpu(kind):
            try:
                text = traced.lower(lowering_platforms=("cuda",)).as_text()
            except Exception as error:  # noqa: BLE001
                pytest.fail(f"Pallas kernel {case.kernel} ({case.name}) does not lower for the "
                            f"{card} ({kind}): {type(error).__name__}: {error}")  # fmt: skip
        assert text.count(case.target) >= case.count, (
            f"{case.kernel} ({case.name}) lowered for the {card} without its {case.target} call"
        )


def test_every_kernel_module_of_the_package_has_a_case():
    """A new Pallas kernel must join the lowering cases: every module of ``pallas_kernels``
    that launches a kernel (``pallas_call``, a Mosaic GPU ``kernel``, JAX's Mosaic GPU grouped
    GEMM) is a case's ``kernel``."""
    import pathlib
    import re

    launches = re.compile(r"pallas_call|plgpu\.kernel|ragged_dot_mgpu")
    modules = {
        path.stem
        for path in pathlib.Path(pallas_kernels.__file__).parent.glob("*.py")
        if launches.search(path.read_text())
    }
    assert len(modules) >= 8 and modules <= {case.kernel for case in CASES}, modules
