"""FP8 KV cache (``kv_cache_dtype="fp8"``): quantize on write, dequantize on read, per-layer scales.

vLLM's semantics (``vllm/attention/layer.py`` ``Attention``; ``csrc/cache_kernels.cu``
``reshape_and_cache_flash`` with ``fp8::scaled_convert``): each attention layer has two float32
scalars, ``k_scale`` and ``v_scale``; the cache stores ``fp8(k / k_scale)`` and a kernel reads
``float(k_fp8) * k_scale``. The scales come from the checkpoint (``*.self_attn.k_scale`` /
``v_scale``, calibrated by llm-compressor), default to 1.0, or, with ``calculate_kv_scales``,
from the first batch as ``amax(|k|) / K_SCALE_CONSTANT`` and ``amax(|v|) / V_SCALE_CONSTANT``
(vLLM's ``calc_kv_scales``; 200 and 100 are vLLM's defaults, ``vllm/envs.py``).

``kv_cache_dtype`` names (vLLM's): ``fp8`` and ``fp8_e4m3`` store ``float8_e4m3fn`` (max 448,
3 mantissa bits), ``fp8_e5m2`` stores ``float8_e5m2`` (max 57344, 2 mantissa bits). Values are
clipped to the format's finite range before the cast (e4m3fn has no infinity: an unclipped
overflow would become NaN).

These are plain elementwise JAX functions: ``kv_cache_update`` calls :func:`quantize_kv` on the
new ``[T, Hkv, D]`` K/V before the scatter, and the attention kernels call :func:`dequantize_kv`
on each ``[block_size, Hkv, D]`` block they load (inside a Pallas body they lower to a convert
and a multiply). Shape letters as in ``pallas_kernels``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

KV_CACHE_FP8_DTYPES = {
    "fp8": jnp.float8_e4m3fn,
    "fp8_e4m3": jnp.float8_e4m3fn,
    "fp8_e5m2": jnp.float8_e5m2,
}
"""``kv_cache_dtype`` -> the cache's element dtype, for the FP8 names vLLM accepts."""
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0


def kv_cache_fp8_dtype(kv_cache_dtype: str):
    """The FP8 element dtype of ``kv_cache_dtype`` (``fp8``, ``fp8_e4m3``, ``fp8_e5m2``).

    Raises:
        ValueError: any other name (``auto`` is not an FP8 cache).
    """
    if kv_cache_dtype not in KV_CACHE_FP8_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_FP8_DTYPES)} for an FP8 cache, "
            f"got {kv_cache_dtype!r}"
        )
    return KV_CACHE_FP8_DTYPES[kv_cache_dtype]


def is_fp8_kv_cache_dtype(dtype) -> bool:
    """Whether a cache of element ``dtype`` holds FP8 K/V (read with per-layer scales)."""
    return any(jnp.dtype(dtype) == jnp.dtype(d) for d in KV_CACHE_FP8_DTYPES.values())


def check_kv_scales(cache_dtype, k_scale, v_scale) -> jax.Array | None:
    """The attention kernels' scale operand: ``f32[2] = [k_scale, v_scale]`` for an FP8 cache
    (a missing scale is vLLM's default, 1.0), None for any other cache.

    Args:
        cache_dtype: the K/V cache's element dtype.
        k_scale, v_scale: ``f32[]`` (traced or concrete), a Python number, or None.

    Raises:
        ValueError: a scale that is not a scalar, or a scale given with a cache that is not FP8
            (its values are stored unscaled, so a scale would be silently wrong).
    """
    if not is_fp8_kv_cache_dtype(cache_dtype):
        if k_scale is not None or v_scale is not None:
            raise ValueError(
                "k_scale and v_scale apply to an FP8 KV cache only, got a "
                f"{jnp.dtype(cache_dtype).name} cache"
            )
        return None
    scales = []
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        scale = jnp.asarray(1.0 if scale is None else scale, jnp.float32)
        if scale.shape != ():
            raise ValueError(f"{name} must be a scalar (f32[]), got shape {scale.shape}")
        scales.append(scale)
    return jnp.stack(scales)


def cache_bytes(cache: jax.Array) -> jax.Array:
    """The cache as a Pallas Triton kernel's operand: an FP8 cache as its bytes (``uint8``, a free
    bitcast of the same shape), any other cache unchanged.

    Why: a masked Pallas Triton load pads with an integer zero (``other=0``), and Triton cannot
    splat that zero into an FP8 tensor (``cannot cast ... tt.splat ... to
    tensor<64x128xf8E4M3FN>``, seen on the H200 at ``078b2b9``). Bytes pad with 0, which is
    +0.0 in both FP8 formats; the kernel reinterprets them with :func:`from_cache_bytes`.
    """
    if is_fp8_kv_cache_dtype(cache.dtype):
        return jax.lax.bitcast_convert_type(cache, jnp.uint8)
    return cache


def from_cache_bytes(x: jax.Array, cache_dtype) -> jax.Array:
    """Inside a kernel: a tile loaded from :func:`cache_bytes`'s operand, back in the cache's
    element dtype ``cache_dtype`` (a bitcast for FP8, else ``x`` unchanged)."""
    if x.dtype != jnp.dtype(cache_dtype):
        return jax.lax.bitcast_convert_type(x, cache_dtype)
    return x


def quantize_kv(x: jax.Array, scale: jax.Array | float, dtype=jnp.float8_e4m3fn) -> jax.Array:
    """``fp8(clip(x / scale))``: K or V entering the cache.

    Args:
        x: ``[T, Hkv, D]`` (any shape) in the compute dtype.
        scale: the layer's ``k_scale`` or ``v_scale``, a positive ``f32[]``.
        dtype: ``float8_e4m3fn`` or ``float8_e5m2``.

    Returns:
        ``x``'s shape in ``dtype``. With ``fmax`` the format's largest finite value, an element
        with ``|x| <= fmax * scale`` is rounded to nearest (relative error at most ``2 ** -4``
        for e4m3, ``2 ** -3`` for e5m2, above the smallest normal); larger ones saturate to
        ``+-fmax``.
    """
    fmax = float(jnp.finfo(dtype).max)
    scaled = x.astype(jnp.float32) / jnp.asarray(scale, jnp.float32)
    return jnp.clip(scaled, -fmax, fmax).astype(dtype)


def dequantize_kv(x: jax.Array, scale: jax.Array | float, out_dtype=jnp.float32) -> jax.Array:
    """``float(x) * scale`` in ``out_dtype``: an FP8 K or V block read from the cache."""
    return (x.astype(jnp.float32) * jnp.asarray(scale, jnp.float32)).astype(out_dtype)


def kv_scale_from_amax(x: jax.Array, scale_constant: float) -> jax.Array:
    """``f32[]``: vLLM's ``calculate_kv_scales`` scale, ``amax(|x|) / scale_constant``.

    ``scale_constant`` is :data:`K_SCALE_CONSTANT` for K and :data:`V_SCALE_CONSTANT` for V;
    an all-zero ``x`` gives 1.0 (the default scale) rather than 0.
    """
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
    return jnp.where(amax > 0, amax / scale_constant, 1.0)
