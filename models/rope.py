"""Rotary position embeddings (Su et al. 2021, "RoFormer", arXiv:2104.09864) in the Hugging Face
*rotate-half* layout: the config's RoPE parameters, the scaled inverse frequencies and the rotation.

Shape letters (``T``, ``H``, ``D``) as in ``pallas_kernels``.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(config: Any) -> dict[str, Any]:
    """The RoPE parameters of an HF config as one dict with ``rope_type`` and ``rope_theta``.

    transformers 5 keeps them in ``config.rope_parameters``; older configs carry ``rope_theta``
    plus an optional ``rope_scaling`` dict whose type key is ``rope_type`` or the legacy ``type``.
    Both are read; ``rope_parameters`` wins when present.

    Raises:
        ValueError: a rope type other than "default", "linear" or "llama3", or a
            ``partial_rotary_factor`` other than 1.
    """
    params = getattr(config, "rope_parameters", None)
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
    else:
        params = dict(params)
    if "rope_theta" not in params or params["rope_theta"] is None:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported; supported: {list(_SUPPORTED_ROPE_TYPES)}"
        )
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if partial is not None and partial != 1.0:
        raise ValueError(f"partial_rotary_factor must be 1.0, got {partial}")
    if rope_type == "llama3" and "original_max_position_embeddings" not in params:
        params["original_max_position_embeddings"] = config.max_position_embeddings
    return params


def rope_inv_freq(head_dim: int, params: dict[str, Any]) -> np.ndarray:
    """Inverse frequencies ``f32[D // 2]`` of RoPE, after the configured scaling.

    ``inv_freq[i] = theta ** (-2i / D)`` (Su et al. 2021). ``"linear"`` divides all of them by
    ``factor``. ``"llama3"`` (Meta's Llama 3.1 reference, HF ``_compute_llama3_parameters``)
    keeps wavelengths shorter than ``original_max_position_embeddings / high_freq_factor``,
    divides those longer than ``original_max_position_embeddings / low_freq_factor`` by
    ``factor`` and interpolates smoothly in between. Computed in float32 like HF.

    Args:
        head_dim: ``D``, even.
        params: the output of :func:`rope_parameters`.
    """
    theta = np.float32(params["rope_theta"])
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / theta**exponent).astype(np.float32)
    rope_type = params["rope_type"]
    if rope_type == "linear":
        inv_freq = inv_freq / np.float32(params["factor"])
    elif rope_type == "llama3":
        factor = params["factor"]
        low_freq_factor = params["low_freq_factor"]
        high_freq_factor = params["high_freq_factor"]
        old_context_len = params["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = np.float32(2 * math.pi) / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / np.float32(factor), inv_freq)
        band = high_freq_factor - low_freq_factor
        smooth = (old_context_len / wavelen - low_freq_factor) / band
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = np.where(is_medium, smoothed, scaled)
    return np.asarray(inv_freq, dtype=np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotates ``x[T, H, D]`` by the angles ``positions[T] * inv_freq`` (rotate-half layout).

    Dimension ``i < D/2`` pairs with ``i + D/2`` (HF convention, not GPT-J's adjacent pairs).
    Angles, cos and sin are computed in float32 from the integer positions; the result has
    ``x``'s dtype.
    """
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, None, :]  # [T, 1, D]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)
