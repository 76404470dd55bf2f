"""The backends a quantized linear layer can run on, and which one ``auto`` picks; imports no JAX.

``"xla"`` dequantizes in the dot's operand and lets XLA fuse it (``models.quantization``);
``"pallas"`` runs the 4-bit layers (AWQ, 4-bit GPTQ incl. act-order, compressed-tensors W4A16)
through the W4A16 kernel ``pallas_kernels.w4a16_matmul`` (Pallas Triton on GPU,
``interpret=True`` elsewhere), their tensors repacked to its layout once at load
(``LinearMethod.repack``). ``"auto"`` (the default) picks per step from :data:`AUTO_BACKENDS`,
the one table of which backend is fastest for how many tokens: the quantized linears dispatch
while tracing, on the static token count of the step's bucket, so the choice costs nothing at
run time. The engine's configuration validates the choice with :func:`with_linear_backend` and
records it on the quantization config, which every layer's ``LinearMethod`` holds.
"""

from __future__ import annotations

import dataclasses
from typing import Any

LINEAR_BACKENDS: tuple[str, ...] = ("xla", "pallas")
# What ``--linear-backend`` accepts: ``auto`` resolves per step through ``AUTO_BACKENDS``.
LINEAR_BACKEND_CHOICES: tuple[str, ...] = ("auto", *LINEAR_BACKENDS)
# The quantization methods with 4-bit layers the W4A16 kernel takes.
W4A16_KERNEL_METHODS: tuple[str, ...] = ("awq", "gptq", "compressed-tensors")

# ``auto``'s choice per kernel family: ``(largest T, backend)`` pairs, the first whose T bound
# holds wins (None: any T). Families: ``w4a16`` (4-bit weights: AWQ, GPTQ, compressed-tensors
# W4A16; ``pallas`` is ``pallas_kernels.w4a16_matmul``) and ``w8`` (8-bit weights: FP8, INT8
# W8A8, bitsandbytes; ``pallas`` is the weight-only ``pallas_kernels.w8_gemv``, read by
# ``models.quantization.w8a8.W8_GEMV_MAX_TOKENS``).
# From benchmarks/quant_kernels.py on one H100 (no H200 could be had that session), µs per
# Llama-3-8B layer / bf16's: w4a16 kernel 0.79 at T = 16 and 32 (XLA's AWQ 2.6-2.7), XLA better
# from T = 256 (1.4-2.8 against the kernel's 3.6-4.0); 8-bit GEMV (weight-only) 0.58-0.63 at
# T = 1 and 0.64-0.70 at T = 16 against W8A8's 0.61-0.73 and 0.67-0.70, slower at T = 32.
# T between 32 and 256 was not measured. Re-run the sweep on new hardware and update both.
AUTO_BACKENDS: dict[str, tuple[tuple[int | None, str], ...]] = {
    "w4a16": ((32, "pallas"), (None, "xla")),
    "w8": ((16, "pallas"), (None, "xla")),
}
AUTO_BACKENDS_MEASURED: str | None = (
    "H100 80GB HBM3, tree f94aa64, 2026-12-05, docs/benchmarks.md 'Quantized kernels'"
)


def backend_for_tokens(family: str, backend: str, tokens: int) -> str:
    """The backend a step of ``tokens`` tokens runs: ``backend`` itself unless it is ``auto``,
    then :data:`AUTO_BACKENDS`' entry for ``family`` (``xla`` past its last bound)."""
    if backend != "auto":
        return backend
    for max_tokens, choice in AUTO_BACKENDS[family]:
        if max_tokens is None or tokens <= max_tokens:
            return choice
    return "xla"


def auto_max_tokens(family: str, backend: str) -> int:
    """The largest token count for which ``auto`` picks ``backend`` in ``family``, counting
    from T = 1 (0: never; a large number for an unbounded entry)."""
    largest = 0
    for max_tokens, choice in AUTO_BACKENDS[family]:
        if choice != backend:
            break
        largest = 1 << 30 if max_tokens is None else max_tokens
    return largest


def _uses(family: str, backend: str) -> bool:
    return any(choice == backend for _, choice in AUTO_BACKENDS[family])


def resolve_linear_backend(backend: str) -> str:
    """``backend`` checked (``auto`` stays ``auto``: it resolves per step).

    Raises:
        ValueError: a name outside :data:`LINEAR_BACKEND_CHOICES`.
    """
    if backend not in LINEAR_BACKEND_CHOICES:
        raise ValueError(
            f"linear_backend must be one of {list(LINEAR_BACKEND_CHOICES)}, got {backend!r}"
        )
    return backend


def _kernel_refusal(config: Any, tensor_parallel_size: int) -> str | None:
    """Why the W4A16 kernel cannot run ``config``'s layers (None: it can)."""
    method = None if config is None else config.method
    if method not in W4A16_KERNEL_METHODS:
        return f"it runs 4-bit weights ({', '.join(W4A16_KERNEL_METHODS)}); the model's " \
            f"quantization is {method!r}"  # fmt: skip
    if tensor_parallel_size > 1:
        return f"it needs tensor_parallel_size 1, got {tensor_parallel_size}"
    if method == "gptq" and config.weight_bits != 4:
        return f"it takes 4-bit GPTQ; got bits={config.weight_bits}"
    if method == "compressed-tensors" and not any(
        s.kind == "wna16" and s.weights.num_bits == 4 for _, s in config.groups
    ):
        return "it needs a compressed-tensors W4A16 scheme (pack-quantized 4-bit); the " \
            "checkpoint has none"  # fmt: skip
    return None


def with_linear_backend(config: Any, backend: str, *, tensor_parallel_size: int = 1) -> Any:
    """``config`` (a resolved quantization config or None) with its 4-bit layers on ``backend``.

    ``xla`` returns ``config`` unchanged. ``auto`` records ``auto`` where the W4A16 kernel can
    run the model and the table uses it for some T (its layers are then repacked at load and
    pick per step), and otherwise returns ``config`` unchanged. ``pallas`` needs a method of
    :data:`W4A16_KERNEL_METHODS` with 4-bit layers. Layers the kernel cannot tile (``in / 8``
    and the group size without a common power-of-two factor of 16) and a compressed-tensors
    model's other schemes keep the XLA path either way. 8-bit layers follow the table's ``w8``
    row under every choice (``models.quantization.w8a8``).

    Raises:
        ValueError: ``pallas`` without such a method, with GPTQ of another width, or with
            ``tensor_parallel_size > 1`` (the kernel's packed planes run along ``in``, which a
            row-parallel split cuts), naming the reason.
    """
    backend = resolve_linear_backend(backend)
    if backend == "xla":
        return config
    refusal = _kernel_refusal(config, tensor_parallel_size)
    if backend == "auto":
        if refusal is not None or not _uses("w4a16", "pallas"):
            return config
    elif refusal is not None:
        raise ValueError(f"linear_backend {backend!r}: {refusal}")
    return dataclasses.replace(config, linear_backend=backend)


# --- XLA's own GEMMs ----------------------------------------------------------------------------

# ``step_compiler_options``' ``triton_gemm``: "on" (XLA's default: a dot may become a Triton
# GEMM fusion, autotuned per shape), "off" (cuBLAS / cuBLASLt for every dot), "auto".
TRITON_GEMM_CHOICES: tuple[str, ...] = ("auto", "on", "off")


def runs_8bit_gemms(config: Any) -> bool:
    """Whether ``config``'s layers multiply 8-bit activations by 8-bit weights (FP8, INT8
    W8A8): dots XLA can hand to cuBLASLt's FP8 / INT8 GEMMs."""
    method = None if config is None else config.method
    if method == "fp8":
        return True
    if method == "compressed-tensors":
        return any(s.kind in ("w8a8_int8", "w8a8_fp8") for _, s in config.groups)
    return False


def step_compiler_options(config: Any, platform: str, triton_gemm: str = "auto") -> dict[str, Any]:
    """XLA options for every step executable of a model quantized by ``config`` (None: float)
    on ``platform`` (``jax.default_backend()``); ``{}`` keeps XLA's defaults.

    With ``triton_gemm="auto"``, on a GPU a model with 8-bit GEMMs (:func:`runs_8bit_gemms`)
    compiles with Triton GEMM fusions off. XLA's default turns an FP8 or INT8 ``dot_general``
    into a Triton GEMM fusion that its autotuner then compiles in many tilings per shape and per
    step bucket (start-up);
    without it, XLA's GEMM rewriter maps the FP8 dot with its scale multiplications onto
    cuBLASLt's FP8 GEMM (``__cublas$lt$matmul$f8``) and the INT8 dot onto cuBLASLt's INT8 GEMM,
    at every token count above the weight-only GEMV's (``docs/quantization.md``, "FP8 on
    cuBLASLt"). ``on`` / ``off`` force either choice on a GPU (benchmarks compare them).

    Raises:
        ValueError: ``triton_gemm`` outside :data:`TRITON_GEMM_CHOICES`.
    """
    if triton_gemm not in TRITON_GEMM_CHOICES:
        raise ValueError(f"triton_gemm must be one of {TRITON_GEMM_CHOICES}, got {triton_gemm!r}")
    if platform != "gpu":
        return {}
    if triton_gemm == "auto":
        triton_gemm = "off" if runs_8bit_gemms(config) else "on"
    return {} if triton_gemm == "on" else {"xla_gpu_enable_triton_gemm": False}
