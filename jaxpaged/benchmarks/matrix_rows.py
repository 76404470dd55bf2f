"""The declared rows of ``jaxpaged bench matrix``: one engine configuration per row, each with
the reference it is compared against, and the option domains the rows must cover.

Every option that selects a kernel or a code path has its values listed in one place
(:func:`option_domains`, read from the tuples the engine's validation uses); every value of
every domain must appear in some row (:func:`covered_values`), and a CPU test fails when one
does not (``tests/benchmarks/test_matrix_rows.py``). Adding an option value without a row is
therefore a test failure, not a silent gap on the GPU.

Models are 2-layer engines of real shapes with dummy weights (``benchmarks/configs/*``, the
layer count replaced in a copy of the config), or the embedded stories260k (real weights, a
tokenizer, and golden greedy tokens from HF transformers) where tokens must be compared with
an independent source.

References (``MatrixRow.reference``):

- ``"reference"``: the same weights (same dummy seed; the matrix checks the floating-point
  weights' checksum is equal) run through the plain-JAX path: ``attention_backend="reference"``,
  ``linear_backend="xla"``, synchronous scheduling, no module patches. For a quantized row this
  is *the same quantized weights dequantized through the XLA path*; for methods that only have
  the XLA path (fp8, W8A8, bitsandbytes, 8-bit weights) the quantized matmul is the same code on
  both sides and the row checks that it compiles on the device and that the attention kernels
  agree with it.
- ``"golden"``: stories260k's greedy tokens from HF transformers (``tests/data/stories260k/
  golden.json``); tokens only (no logprobs there).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxpaged.config import BLOCK_SIZE_CHOICES, KV_CACHE_DTYPE_CHOICES, EngineArgs
from jaxpaged.core.scheduler import PREEMPTION_MODES
from models.attention_backends import ATTENTION_BACKEND_CHOICES
from models.dtypes import DTYPE_CHOICES, DTYPES
from models.linear_backends import LINEAR_BACKEND_CHOICES
from models.lora import LORA_PATHS
from models.moe import EXPERT_BACKENDS
from models.quantization import QUANTIZATION_METHODS
from models.quantization.config import COMPRESSED_TENSORS_SCHEME_KINDS
from models.registry import supported_architectures

# What a row's requests do (``matrix.py`` builds each): greedy with logprobs; n=2 seeded top-k
# sampling; beam search; greedy with LoRA adapters; greedy constrained by a choice list.
WORKLOADS = ("greedy", "sample_n2", "beam", "lora", "structured_outputs")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model of the matrix: ``config`` a directory under ``benchmarks/configs`` (2 layers,
    dummy weights) or None for the embedded stories260k (its real weights, all its layers)."""

    config: str | None
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    quantization_config: Mapping[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class MatrixRow:
    """One engine configuration.

    Attributes:
        name: unique; ``--only`` matches a substring of it.
        model: a key of :data:`MODELS`.
        engine: ``EngineArgs`` fields on top of the matrix's common small-engine settings.
        reference: ``"reference"`` or ``"golden"`` (module docstring).
        workload: one of :data:`WORKLOADS`.
        patches: module constants set (``"module:NAME": value``) while the row's engine is
            built and run (not its reference's): policy thresholds that pick a kernel by step
            size (``models.lora.LORA_KERNEL_MAX_TOKENS``, ...).
        covers: values of internal domains the row exercises that cannot be read from its
            arguments (``{"lora_path": ("bgmv",)}``).
        tolerance: max |delta logprob| allowed; None: :data:`TOLERANCE` of the row's dtype.
    """

    name: str
    model: str
    engine: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    reference: str = "reference"
    workload: str = "greedy"
    patches: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    covers: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
    tolerance: float | None = None


# Max |delta logprob| of a sampled token between a row and its reference, per compute dtype:
# bf16 keeps 8 mantissa bits (a logit near 5 is off by up to ~0.02 per rounding) and two
# layers of differently ordered sums add up; float16 has 11 bits; float32 differs only by
# summation order. FP8 KV caches and quantized weights are quantized the same way on both sides.
TOLERANCE = {"float32": 2e-3, "float16": 5e-2, "bfloat16": 0.15}

_CT_BASE = {
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
    "ignore": ["lm_head"],
    "kv_cache_scheme": None,
}


def _ct(fmt: str, weights: dict, input_activations: dict | None) -> dict:
    group = {"targets": ["Linear"], "weights": weights, "input_activations": input_activations}
    return {**_CT_BASE, "format": fmt, "config_groups": {"group_0": group}}


def _qargs(num_bits: int, kind: str, strategy: str, *, group_size=None, dynamic=False) -> dict:
    return {"num_bits": num_bits, "type": kind, "symmetric": True, "strategy": strategy,
            "group_size": group_size, "dynamic": dynamic, "actorder": None}  # fmt: skip


_GPTQ = {"bits": 4, "group_size": 128, "desc_act": False, "sym": True, "quant_method": "gptq",
         "checkpoint_format": "gptq", "static_groups": False}  # fmt: skip
_SLIDING = {"sliding_window": 32}  # bites within the matrix's 128-token sequences

MODELS: dict[str, ModelSpec] = {
    "stories260k": ModelSpec(None),
    "llama-3-8b": ModelSpec("llama-3-8b"),
    "llama-3-8b-awq": ModelSpec("llama-3-8b-awq"),
    "llama-3-8b-gptq": ModelSpec("llama-3-8b-gptq"),
    "llama-3-8b-gptq-act-order": ModelSpec(  # float16, as GPTQ checkpoints are
        "llama-3-8b-gptq", quantization_config={**_GPTQ, "desc_act": True}
    ),
    "llama-3-8b-ct-w4a16": ModelSpec(
        "llama-3-8b",
        quantization_config=_ct("pack-quantized", _qargs(4, "int", "group", group_size=128), None),
    ),
    "llama-3-8b-ct-w4a16-actorder": ModelSpec(
        "llama-3-8b",
        quantization_config=_ct(
            "pack-quantized",
            {**_qargs(4, "int", "group", group_size=128), "actorder": "group"},
            None,
        ),
    ),
    "llama-3-8b-ct-w8a16": ModelSpec(
        "llama-3-8b",
        quantization_config=_ct("pack-quantized", _qargs(8, "int", "channel"), None),
    ),
    "llama-3-8b-ct-w8a8-int8": ModelSpec("llama-3-8b-w8a8-int8"),
    "llama-3-8b-ct-w8a8-int8-static": ModelSpec(
        "llama-3-8b",
        quantization_config=_ct(
            "int-quantized", _qargs(8, "int", "tensor"), _qargs(8, "int", "tensor")
        ),
    ),
    "llama-3-8b-ct-w8a8-fp8": ModelSpec(
        "llama-3-8b",
        quantization_config=_ct(
            "float-quantized",
            _qargs(8, "float", "channel"),
            _qargs(8, "float", "token", dynamic=True),
        ),
    ),
    "llama-3-8b-fp8": ModelSpec(
        "llama-3-8b", quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic"}
    ),
    "llama-3-8b-fp8-static": ModelSpec(
        "llama-3-8b", quantization_config={"quant_method": "fp8", "activation_scheme": "static"}
    ),
    "mistral-7b": ModelSpec("mistral-7b-v0.1", overrides=_SLIDING),
    "qwen2.5-7b": ModelSpec("qwen2.5-7b"),
    "qwen3-8b": ModelSpec("qwen3-8b"),
    "gemma-2-9b": ModelSpec("gemma-2-9b", overrides=_SLIDING),
    "phi-3-mini": ModelSpec("phi-3-mini-4k-instruct"),
    "mixtral-8x7b": ModelSpec("mixtral-8x7b-instruct-v0.1"),
    "gpt2": ModelSpec("gpt2"),
    "bloom-560m": ModelSpec("bloom-560m"),
}

_BF16 = {"dtype": "bfloat16", "attention_backend": "pallas"}
_PALLAS_LINEAR = {"attention_backend": "pallas", "linear_backend": "pallas"}
_LORA = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 16}

ROWS: tuple[MatrixRow, ...] = (
    # dtype x attention backend, on stories260k (real weights) and Llama-3-8B shapes.
    MatrixRow("stories-f32-pallas", "stories260k", {"dtype": "float32", "attention_backend": "pallas"}),
    MatrixRow("stories-f32-auto", "stories260k", {"dtype": "float32", "attention_backend": "auto"}),
    MatrixRow("stories-f32-reference-golden", "stories260k",
              {"dtype": "float32", "attention_backend": "reference"}, reference="golden"),
    MatrixRow("stories-auto-dtype-pallas", "stories260k", {"dtype": "auto", "attention_backend": "pallas"}),
    MatrixRow("llama3-bf16", "llama-3-8b", _BF16),
    MatrixRow("llama3-f16", "llama-3-8b", {"dtype": "float16", "attention_backend": "pallas"}),
    MatrixRow("llama3-f32", "llama-3-8b", {"dtype": "float32", "attention_backend": "pallas"}),
    MatrixRow("llama3-bf16-attn-auto", "llama-3-8b", {"dtype": "bfloat16", "attention_backend": "auto"}),
    # KV block sizes (16 above): the kernels' tiles follow the block size.
    *(MatrixRow(f"llama3-block{b}", "llama-3-8b", {**_BF16, "block_size": b}) for b in (8, 32, 64, 128)),
    # FP8 KV cache: every kv_cache_dtype (the reference stores the same FP8 cache).
    MatrixRow("llama3-kv-fp8", "llama-3-8b", {**_BF16, "kv_cache_dtype": "fp8"}),
    MatrixRow("llama3-kv-fp8_e4m3", "llama-3-8b", {**_BF16, "kv_cache_dtype": "fp8_e4m3"}),
    MatrixRow("llama3-kv-fp8_e5m2", "llama-3-8b", {**_BF16, "kv_cache_dtype": "fp8_e5m2"}),
    MatrixRow("llama3-f16-kv-fp8", "llama-3-8b",
              {"dtype": "float16", "attention_backend": "pallas", "kv_cache_dtype": "fp8"}),
    # Quantization: each method, scheme and linear backend.
    MatrixRow("awq-linear-auto", "llama-3-8b-awq", {"attention_backend": "pallas", "linear_backend": "auto"}),
    MatrixRow("awq-linear-pallas", "llama-3-8b-awq", _PALLAS_LINEAR),
    MatrixRow("gptq-linear-xla", "llama-3-8b-gptq", {"attention_backend": "pallas", "linear_backend": "xla"}),
    MatrixRow("gptq-linear-pallas", "llama-3-8b-gptq", _PALLAS_LINEAR),
    MatrixRow("gptq-act-order", "llama-3-8b-gptq-act-order", {"attention_backend": "pallas"}),
    MatrixRow("ct-w4a16", "llama-3-8b-ct-w4a16", {**_BF16}),
    MatrixRow("ct-w4a16-linear-pallas", "llama-3-8b-ct-w4a16", {"dtype": "bfloat16", **_PALLAS_LINEAR}),
    MatrixRow("ct-w4a16-act-order", "llama-3-8b-ct-w4a16-actorder", _BF16),
    MatrixRow("ct-w8a16", "llama-3-8b-ct-w8a16", _BF16),
    MatrixRow("ct-w8a8-int8", "llama-3-8b-ct-w8a8-int8", _BF16),
    MatrixRow("ct-w8a8-int8-static", "llama-3-8b-ct-w8a8-int8-static", _BF16),
    MatrixRow("ct-w8a8-int8-w8-gemv", "llama-3-8b-ct-w8a8-int8", _BF16,
              patches={"models.quantization.w8a8:W8_GEMV_MAX_TOKENS": 16},
              covers={"w8a8_decode": ("w8_gemv",)}),
    MatrixRow("ct-w8a8-fp8", "llama-3-8b-ct-w8a8-fp8", _BF16),
    MatrixRow("fp8-checkpoint-dynamic", "llama-3-8b-fp8", _BF16),
    MatrixRow("fp8-checkpoint-static", "llama-3-8b-fp8-static", _BF16),
    MatrixRow("fp8-online", "llama-3-8b", {**_BF16, "quantization": "fp8"}),
    MatrixRow("fp8-online-w8-gemv", "llama-3-8b", {**_BF16, "quantization": "fp8"},
              patches={"models.quantization.w8a8:W8_GEMV_MAX_TOKENS": 16},
              covers={"w8a8_decode": ("w8_gemv",)}),
    MatrixRow("bitsandbytes-online", "llama-3-8b", {**_BF16, "quantization": "bitsandbytes"}),
    # LoRA: the default path choice, and each forced path.
    MatrixRow("lora", "llama-3-8b", {**_BF16, **_LORA}, workload="lora",
              covers={"lora_path": ("dense", "gather")}),
    MatrixRow("lora-bgmv", "llama-3-8b", {**_BF16, **_LORA}, workload="lora",
              patches={"models.lora:LORA_KERNEL_MAX_TOKENS": 64}, covers={"lora_path": ("bgmv",)}),
    MatrixRow("lora-fold", "llama-3-8b", {**_BF16, **_LORA}, workload="lora",
              patches={"models.lora:LORA_FOLD": True}, covers={"lora_path": ("fold",)}),
    MatrixRow("lora-awq", "llama-3-8b-awq", {"attention_backend": "pallas", **_LORA}, workload="lora"),
    # Model families (Llama is above): sliding window, soft-cap, fused QKV, MoE, ALiBi, ...
    MatrixRow("mistral-sliding-window", "mistral-7b", _BF16),
    MatrixRow("qwen2.5", "qwen2.5-7b", _BF16),
    MatrixRow("qwen3", "qwen3-8b", _BF16),
    MatrixRow("gemma2-softcap-sliding", "gemma-2-9b", _BF16),
    MatrixRow("phi3", "phi-3-mini", _BF16),
    MatrixRow("mixtral-moe", "mixtral-8x7b", _BF16,
              covers={"moe_backend": ("mosaic_gpu", "gemv", "xla")}),
    MatrixRow("mixtral-moe-f32", "mixtral-8x7b", {"dtype": "float32", "attention_backend": "pallas"}),
    MatrixRow("gpt2", "gpt2", _BF16),
    MatrixRow("bloom-alibi", "bloom-560m", _BF16),
    # Scheduling and sampling paths.
    MatrixRow("async-scheduling", "llama-3-8b", {**_BF16, "async_scheduling": True}),
    MatrixRow("prefix-caching-off", "llama-3-8b", {**_BF16, "enable_prefix_caching": False}),
    # 10 blocks of 16 tokens hold fewer than the 4 requests' 11+ blocks: the scheduler preempts
    # (the matrix fails a row with a preemption_mode that did not preempt).
    MatrixRow("preempt-swap", "llama-3-8b",
              {**_BF16, "num_gpu_blocks_override": 10, "preemption_mode": "swap"}),
    MatrixRow("preempt-recompute", "llama-3-8b",
              {**_BF16, "num_gpu_blocks_override": 10, "preemption_mode": "recompute"}),
    MatrixRow("eager", "llama-3-8b", {**_BF16, "enforce_eager": True}),
    MatrixRow("stories-compile-all", "stories260k",
              {"dtype": "float32", "attention_backend": "pallas", "enforce_eager": False}),
    MatrixRow("n2-sampling", "llama-3-8b", _BF16, workload="sample_n2"),
    MatrixRow("beam-search", "llama-3-8b", _BF16, workload="beam"),
    MatrixRow("structured-outputs", "stories260k", {"dtype": "float32", "attention_backend": "pallas"},
              workload="structured_outputs"),
    # Async scheduling runs a constrained step as two executables (forward, then sample).
    MatrixRow("structured-outputs-async", "stories260k",
              {"dtype": "float32", "attention_backend": "pallas", "async_scheduling": True},
              workload="structured_outputs"),
)  # fmt: skip


# EngineArgs fields that select no kernel or code path of the step (or cannot run on one
# device), with the reason; every other field must be a domain of ``option_domains``.
NOT_CODE_PATHS: dict[str, str] = {
    "structured_outputs_config": "the grammar backend runs on the host; every backend feeds the "
    "same bitmask input of the step (the structured-outputs row), tests/structured_output runs "
    "both backends",
    "logprobs_mode": "a per-row value in the step's packed input (SamplingMetadata."
    "logprobs_mode): one compiled sampler selects among the four modes with jnp.where; "
    "tests/engine/test_logprobs_mode.py checks each mode against a reference",
    "enable_sleep_mode": "host-side memory management between steps: wake_up refills the KV "
    "cache at its compiled shapes with the same programs (tests/engine/test_sleep_mode.py counts "
    "zero compilations)",
    "model_impl_module": "an import before the model is built (registers out-of-tree "
    "architectures); the model's own code is the user's (tests/examples/test_my_llama.py)",
    **dict.fromkeys(("model", "revision", "download_dir", "tokenizer", "skip_tokenizer_init"),
                    "which files are read (host only)"),
    **dict.fromkeys(("max_model_len", "gpu_memory_utilization", "kv_cache_memory_bytes",
                     "num_gpu_blocks_override", "swap_space", "max_num_seqs",
                     "max_num_batched_tokens", "max_logprobs", "max_loras", "max_lora_rank",
                     "max_cpu_loras"), "sizes and limits: shapes of the same programs"),
    "seed": "values, not code",
    "load_format": "host-side loaders (tests/models); the matrix runs dummy and auto",
    "calculate_kv_scales": "refused: not supported",
    "speculative_config": "refused: not yet wired into the step (docs/spec_decode.md)",
    **dict.fromkeys(("enable_compilation_cache", "compilation_cache_dir", "disable_log_stats"),
                    "caching and logging around the step"),
    **dict.fromkeys(("tensor_parallel_size", "nnodes", "node_rank", "master_addr", "master_port"),
                    "several devices or hosts (benchmarks/tensor_parallel.py on 2 GPUs)"),
}  # fmt: skip


def option_domains() -> dict[str, tuple]:
    """Every option that selects a kernel or code path -> its values, read from the tuples the
    engine validates against (one source each); booleans as (False, True)."""
    return {
        "dtype": tuple(DTYPE_CHOICES),
        "attention_backend": tuple(ATTENTION_BACKEND_CHOICES),
        "kv_cache_dtype": tuple(KV_CACHE_DTYPE_CHOICES),
        "quantization": tuple(QUANTIZATION_METHODS),
        "compressed_tensors_scheme": tuple(COMPRESSED_TENSORS_SCHEME_KINDS),
        "linear_backend": tuple(LINEAR_BACKEND_CHOICES),
        "architecture": tuple(supported_architectures()),
        "enable_lora": (False, True),
        "lora_path": (*LORA_PATHS, "fold"),
        "moe_backend": tuple(EXPERT_BACKENDS),
        "w8a8_decode": ("scaled_matmul", "w8_gemv"),
        "block_size": tuple(BLOCK_SIZE_CHOICES),
        "preemption_mode": tuple(PREEMPTION_MODES),
        "enforce_eager": (None, False, True),
        "async_scheduling": (False, True),
        "enable_prefix_caching": (False, True),
        "act_order": (False, True),
        "workload": WORKLOADS,
    }


# Names a user may give for the same dtype count as that dtype (``models.dtypes.DTYPES``).
_DTYPE_ALIASES = {alias: canonical for alias, canonical in DTYPES.items()}


def covered_values(row: MatrixRow, config_json: Mapping[str, Any]) -> dict[str, set]:
    """The values of :func:`option_domains` that ``row`` exercises; ``config_json`` is its
    model's config.json (architecture, quantization_config) as the matrix writes it."""
    defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    engine = {**defaults, **row.engine}
    values: dict[str, set] = {name: {engine[name]} for name in option_domains() if name in defaults}
    if engine["dtype"] in _DTYPE_ALIASES:  # float32 also covers its alias "float", etc.
        canonical = _DTYPE_ALIASES[engine["dtype"]]
        values["dtype"] |= {a for a, c in _DTYPE_ALIASES.items() if c == canonical}
    values["architecture"] = set(config_json.get("architectures", [])[:1])
    quant = config_json.get("quantization_config") or {}
    method = engine.get("quantization") or quant.get("quant_method")
    values["quantization"] = {method} if method else set()
    if method == "compressed-tensors":
        groups = quant["config_groups"].values()
        values["compressed_tensors_scheme"] = {_ct_kind(g) for g in groups}
        values["act_order"] = {g["weights"].get("actorder") is not None for g in groups}
    if method == "gptq":
        values["act_order"] = {bool(quant.get("desc_act"))}
    if method in ("fp8", "bitsandbytes") or values.get("compressed_tensors_scheme", set()) & {
        "w8a8_int8",
        "w8a8_fp8",
    }:
        values["w8a8_decode"] = {"scaled_matmul"}
    values["workload"] = {row.workload}
    for domain, covered in row.covers.items():
        values.setdefault(domain, set()).update(covered)
    return values


def _ct_kind(group: Mapping[str, Any]) -> str:
    """The scheme kind of a compressed-tensors config group (as ``QuantizationScheme``)."""
    from models.quantization.config import QuantizationScheme

    return QuantizationScheme.from_config(group, "config_groups").kind
