"""The dtypes a user may name (``--dtype``), in one table; imports nothing heavy.

The engine's configuration validates names against :data:`DTYPES` (``jaxpaged.config``) and the
weight loaders resolve them to a ``jnp.dtype`` (``models.weights.resolve_dtype``). vLLM accepts
the same names (``vllm/config``: ``_STR_DTYPE_TO_TORCH_DTYPE``), plus ``auto``.
"""

from __future__ import annotations

# Name a user may give -> canonical name (``jnp.dtype(canonical)``; bfloat16 via ml_dtypes).
DTYPES: dict[str, str] = {
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}

# What ``--dtype`` accepts: ``auto`` keeps the checkpoint's dtype, or one of DTYPES.
DTYPE_CHOICES: tuple[str, ...] = ("auto", *DTYPES)
