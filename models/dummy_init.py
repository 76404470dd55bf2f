"""Dummy weights (``load_format="dummy"``): the real shapes filled with ``normal * DUMMY_STD``.

One place for the draw, so every loader (one device, a ``tp`` mesh, quantize-at-load methods)
makes the same values from the same ``(key, index)``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

# Scale of the dummy weights: the usual ``initializer_range`` of HF configs.
DUMMY_STD = 0.02


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def dummy_normal(key: jax.Array, index: int, *, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """``DUMMY_STD * normal`` of ``shape``, drawn in float32 from ``fold_in(key, index)`` on the
    default device and cast to ``dtype``. One compile per ``(shape, dtype)``: a model has only a
    handful of distinct shapes."""
    noise = jax.random.normal(jax.random.fold_in(key, index), shape, dtype=jnp.float32)
    return (DUMMY_STD * noise).astype(dtype)
