"""The backends a quantized linear layer can run on, and which one ``auto`` picks; imports no JAX.

``"xla"`` dequantizes in the dot's operand and lets XLA fuse it (``models.quantization``);
``"pallas"`` runs the 4-bit layers (AWQ, GPTQ 4-bit without act-order, compressed-tensors
W4A16) through the W4A16 kernel ``pallas_kernels.w4a16_matmul`` (Pallas Triton on GPU,
``interpret=True`` elsewhere), their tensors repacked to its layout once at load
(``LinearMethod.repack``). ``auto`` is ``xla`` until the H200 figures say otherwise
(``benchmarks/quantization.sh``). The engine's configuration validates the choice
with :func:`with_linear_backend` and records it on the quantization config, which every layer's
``LinearMethod`` holds.
"""

from __future__ import annotations

import dataclasses
from typing import Any

LINEAR_BACKENDS: tuple[str, ...] = ("xla", "pallas")
# What ``--linear-backend`` accepts: ``auto`` resolves with ``resolve_linear_backend``.
LINEAR_BACKEND_CHOICES: tuple[str, ...] = ("auto", *LINEAR_BACKENDS)
# The quantization methods with 4-bit layers the W4A16 kernel takes.
W4A16_KERNEL_METHODS: tuple[str, ...] = ("awq", "gptq", "compressed-tensors")


def resolve_linear_backend(backend: str) -> str:
    """The backend to run: ``auto`` is ``xla`` (the kernel is not yet measured on a GPU).

    Raises:
        ValueError: a name outside :data:`LINEAR_BACKEND_CHOICES`.
    """
    if backend == "auto":
        return "xla"
    if backend not in LINEAR_BACKENDS:
        raise ValueError(
            f"linear_backend must be one of {list(LINEAR_BACKEND_CHOICES)}, got {backend!r}"
        )
    return backend


def with_linear_backend(config: Any, backend: str, *, tensor_parallel_size: int = 1) -> Any:
    """``config`` (a resolved quantization config or None) with its 4-bit layers on ``backend``.

    ``xla`` (and ``auto``) return ``config`` unchanged. ``pallas`` needs a method of
    :data:`W4A16_KERNEL_METHODS` with 4-bit layers; layers the kernel cannot tile (``out`` not a
    multiple of 16, or ``in / 8`` and the group size without a common power-of-two factor of 16)
    and a compressed-tensors model's other schemes keep the XLA path.

    Raises:
        ValueError: ``pallas`` without such a method, with GPTQ of another width or with
            ``desc_act``, or with ``tensor_parallel_size > 1`` (the kernel's packed planes run
            along ``in``, which a row-parallel split cuts), naming the reason.
    """
    backend = resolve_linear_backend(backend)
    if backend == "xla":
        return config
    method = None if config is None else config.method
    if method not in W4A16_KERNEL_METHODS:
        raise ValueError(
            f"linear_backend {backend!r} runs 4-bit weights ({', '.join(W4A16_KERNEL_METHODS)}); "
            f"the model's quantization is {method!r}"
        )
    if tensor_parallel_size > 1:
        raise ValueError(
            f"linear_backend {backend!r} needs tensor_parallel_size 1, got {tensor_parallel_size}"
        )
    if method == "gptq" and (config.weight_bits != 4 or config.desc_act):
        raise ValueError(
            f"linear_backend {backend!r} takes 4-bit GPTQ without desc_act; got "
            f"bits={config.weight_bits}, desc_act={config.desc_act}"
        )
    if method == "compressed-tensors" and not any(
        s.kind == "wna16" and s.weights.num_bits == 4 for _, s in config.groups
    ):
        raise ValueError(
            f"linear_backend {backend!r} needs a compressed-tensors W4A16 scheme (pack-quantized "
            "4-bit); the checkpoint has none"
        )
    return dataclasses.replace(config, linear_backend=backend)
