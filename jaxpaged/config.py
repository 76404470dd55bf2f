"""Engine configuration: ``EngineArgs`` (what a user sets) validated once into typed configs.

Names and defaults follow vLLM's ``EngineArgs`` (vllm/engine/arg_utils.py) where vLLM has the
knob.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from importlib import resources

from jaxpaged.core.scheduler import PREEMPTION_MODES
from jaxpaged.spec_decode.config import SpeculationTarget, SpeculativeConfig
from jaxpaged.structured_output.config import StructuredOutputsConfig
from models.attention_backends import ATTENTION_BACKEND_CHOICES
from models.dtypes import DTYPE_CHOICES
from models.hub import resolve_model_path
from models.linear_backends import LINEAR_BACKEND_CHOICES, with_linear_backend
from models.orbax_metadata import (
    check_shard_count,
    checkpoint_quantization,
    is_orbax_checkpoint,
    read_metadata,
)
from models.quantization import QUANTIZATION_METHODS
from models.quantization.config import QuantizationConfig, resolve_quantization
from models.tp_layout import TPLayout

DEFAULT_MODEL_NAME = "stories260k"

_LOAD_FORMATS = ("auto", "safetensors", "dummy", "bitsandbytes")
KV_CACHE_DTYPE_CHOICES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
BLOCK_SIZE_CHOICES = (8, 16, 32, 64, 128)
# vLLM's --logprobs-mode choices (ModelConfig.logprobs_mode), default raw_logprobs.
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def default_model_path() -> str:
    """Path of the embedded stories260k checkpoint (package data), used when no model is given."""
    return str(resources.files("jaxpaged") / "model_data" / DEFAULT_MODEL_NAME)


def _arg(default, help_text: str):
    """A field whose one-line help (meaning, unit, range, special values) the CLI shows."""
    return dataclasses.field(default=default, metadata={"help": help_text})


@dataclasses.dataclass
class EngineArgs:
    """Everything a user can set on the engine; every field mirrors vLLM's name and meaning."""

    model: str | None = _arg(
        None,
        "Local HF model directory (config.json + safetensors + tokenizer) or Hugging Face Hub id "
        "(org/name; HF_HOME, HF_HUB_OFFLINE apply). None: embedded stories260k.",
    )
    revision: str | None = _arg(
        None, "Branch, tag or commit of a Hub model id; None means main. Ignored for directories."
    )
    download_dir: str | None = _arg(
        None, "Cache directory for Hub downloads; None means huggingface_hub's (HF_HOME/hub)."
    )
    tokenizer: str | None = _arg(None, "Tokenizer directory; None means the model directory.")
    skip_tokenizer_init: bool = _arg(
        False,
        "Load no tokenizer: prompts must be token ids and outputs carry token ids with empty text "
        "(benchmarks on config-only model directories).",
    )
    dtype: str = _arg(
        "auto",
        "Compute and weight dtype: auto (the checkpoint's dtype), float32/float, bfloat16, float16/half.",
    )
    max_model_len: int | None = _arg(
        None,
        "Context limit in tokens (prompt + output); None means the model's max_position_embeddings.",
    )
    block_size: int = _arg(16, "Tokens per KV-cache block; one of 8, 16, 32, 64, 128.")
    gpu_memory_utilization: float = _arg(
        0.90,
        "Fraction (0, 1] of accelerator memory this engine may use for weights, activations and KV.",
    )
    kv_cache_memory_bytes: int | None = _arg(
        None,
        "KV-cache size in bytes per device; overrides gpu_memory_utilization. Default on CPU: 256 MiB.",
    )
    num_gpu_blocks_override: int | None = _arg(
        None, "Force this many KV blocks regardless of memory (tests use it to force preemption)."
    )
    # FP8 KV cache (docs/quantization.md, "FP8 KV cache"); vLLM's names and choices.
    kv_cache_dtype: str = _arg(
        "auto",
        "KV cache element type: auto (the compute dtype), fp8 / fp8_e4m3 (e4m3fn) or fp8_e5m2; "
        "FP8 stores k / k_scale per layer (checkpoint scales, else 1.0) and holds ~2x the blocks "
        "of bf16.",
    )
    calculate_kv_scales: bool = _arg(
        False, "Compute k_scale / v_scale from the first batch (vLLM's); not supported yet."
    )
    swap_space: float = _arg(
        4, "Host memory in GiB for KV blocks of swap-preempted requests, >= 0; 0 disables swap."
    )
    enable_prefix_caching: bool = _arg(
        True,
        "Reuse the KV blocks of a cached prompt prefix (automatic prefix caching); "
        "--no-enable-prefix-caching turns it off.",
    )
    max_num_seqs: int = _arg(256, "Most sequences in one step (the running batch).")
    max_num_batched_tokens: int | None = _arg(
        None,
        "Per-step token budget (decodes + prefill chunks); None means max(2048, max_num_seqs).",
    )
    seed: int = _arg(0, "Engine seed; requests without their own seed draw from it.")
    load_format: str = _arg(
        "auto",
        "auto/safetensors: read weights; dummy: random weights of the real shapes (benchmarks); "
        "bitsandbytes: read and quantize to 8 bits (with quantization=bitsandbytes).",
    )
    # Quantization (docs/quantization.md).
    quantization: str | None = _arg(
        None,
        f"Weight quantization, one of {', '.join(QUANTIZATION_METHODS)}; None: the checkpoint's "
        "quantization_config.quant_method (unquantized if none). fp8 and bitsandbytes also "
        "quantize an unquantized checkpoint at load.",
    )
    attention_backend: str = _arg(
        "auto",
        "reference (plain JAX), pallas (kernels; interpret mode on CPU), or auto (pallas on GPU).",
    )
    linear_backend: str = _arg(
        "auto",
        "Backend of 4-bit quantized linears (awq, gptq, compressed-tensors W4A16): xla "
        "(dequantize into XLA's dot), pallas (the W4A16 Pallas kernel; one device), or auto (per "
        "step's token count from models.linear_backends.AUTO_BACKENDS, on a GPU).",
    )
    preemption_mode: str | None = _arg(
        None,
        "recompute (free the KV, prefill again) or swap (KV to host memory); None: recompute for "
        "single-sequence requests, swap for n>1 / best_of / beam search (vLLM's rule).",
    )
    enforce_eager: bool | None = _arg(
        None,
        "Compile step buckets on first use instead of all at start-up; None: eager on CPU only.",
    )
    async_scheduling: bool = _arg(
        False,
        "Schedule and launch step N+1 before step N's tokens reach the host, so the device never "
        "waits on Python between steps (vLLM's --async-scheduling). Beam-search steps run "
        "synchronously.",
    )
    enable_compilation_cache: bool = _arg(
        True,
        "Keep compiled step executables on disk (JAX's persistent compilation cache) so a restart "
        "compiles nothing; --no-enable-compilation-cache turns it off.",
    )
    compilation_cache_dir: str | None = _arg(
        None,
        "Root directory of the compilation cache; None: ~/.cache/jaxpaged/xla. Entries go under "
        "jax-<version>/<platform>-<device kind>/ (jaxpaged/worker/compilation_cache.py).",
    )
    disable_log_stats: bool = _arg(True, "Silence the periodic stats log line.")
    tensor_parallel_size: int = _arg(
        1,
        "Devices one model is split over (tensor parallelism), >= 1 and at most the number of "
        "devices of all processes; 1 means no sharding.",
    )
    nnodes: int = _arg(
        1,
        "Processes (hosts) one model spans, >= 1; above 1 every process runs the same engine "
        "(multi-controller JAX, jax.distributed.initialize) and only process 0 prints.",
    )
    node_rank: int = _arg(0, "This process's rank in [0, nnodes); rank 0 hosts the coordinator.")
    master_addr: str = _arg(
        "127.0.0.1", "Host (IP or name) of the rank-0 process, reachable from every process."
    )
    master_port: int = _arg(29501, "Port of the JAX coordinator on master_addr, in [1, 65535].")
    max_logprobs: int = _arg(
        20,
        "Most logprobs / prompt_logprobs a request may ask for per token, >= 0 (vLLM's cap); "
        "-1 means the whole vocabulary (then requests may ask for -1); logprob_token_ids (up to "
        "128 ids) need no more than the default.",
    )
    structured_outputs_config: str | dict | None = _arg(
        None,
        'Constrained decoding settings as JSON, e.g. \'{"backend": "xgrammar"}\' (or a bare '
        "backend name): backend auto (xgrammar if installed, else guidance) | xgrammar | guidance "
        "(llguidance), disable_any_whitespace, disable_additional_properties, and the budgets "
        "grammar_cache_mb (512), grammar_compile_timeout_s (10), max_grammar_bytes (1 MiB). "
        "None: backend auto (xgrammar) and those defaults.",
    )
    speculative_config: str | dict | None = _arg(
        None,
        'Speculative decoding as JSON (vLLM\'s keys), e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\'; methods ngram, draft_model '
        '(with "model"), eagle, eagle3 (with the head\'s "model"). None: off. Not yet wired '
        "into the step: an engine refuses it (docs/spec_decode.md).",
    )

    enable_lora: bool = _arg(
        False, "Serve LoRA adapters (PEFT directories) on top of the base model, per request."
    )
    max_loras: int = _arg(
        1, "Most distinct LoRA adapters in one step (device slots), >= 1; with enable_lora."
    )
    max_lora_rank: int = _arg(
        16, f"Largest LoRA rank served; one of {list(_LORA_RANKS)} (vLLM's choices)."
    )
    max_cpu_loras: int | None = _arg(
        None, "LoRA adapters kept in host memory (LRU), >= max_loras; None means max_loras."
    )

    enable_sleep_mode: bool = _arg(
        False,
        "Allow sleep()/wake_up() (server: /sleep, /wake_up with --enable-dev-endpoints): level 1 "
        "frees the KV cache, level 2 also the weights.",
    )
    logprobs_mode: str = _arg(
        "raw_logprobs",
        f"What logprobs report for requests that don't choose: one of {list(LOGPROBS_MODES)}; "
        "raw = the model's float32 output before penalties, temperature, top-k/top-p; processed "
        "= after them.",
    )
    model_impl_module: str | None = _arg(
        None,
        "Python module imported (in every engine process) before the model is built, which "
        "registers out-of-tree architectures with jaxpaged.ModelRegistry.register_model.",
    )

    def create_engine_config(self) -> EngineConfig:
        """Validate every field and derive the typed configs.

        Raises:
            ValueError: naming the field, the rule and the value received; also a valid
                ``speculative_config``, which no engine step runs yet.
        """
        config = EngineConfig.from_args(self)
        spec = config.speculative_config
        if spec is not None:
            # Parsed and checked above; the step pipeline has no speculation stages yet.
            raise ValueError(
                f"speculative_config is not yet wired into the step: speculative decoding "
                f"(method {spec.method!r}) cannot run in this version"
            )
        return config


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model: str
    tokenizer: str
    skip_tokenizer_init: bool
    dtype: str
    max_model_len: int
    load_format: str
    seed: int
    hf_config_json: dict
    max_logprobs: int = 20
    # vLLM's --logprobs-mode: the default of requests whose logprobs_mode is None.
    logprobs_mode: str = "raw_logprobs"
    # Quantization: the flag as given and what it resolved to with the checkpoint (None: float).
    quantization: str | None = None
    quant_config: QuantizationConfig | None = None


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    block_size: int
    gpu_memory_utilization: float
    kv_cache_memory_bytes: int | None
    num_gpu_blocks_override: int | None
    swap_space_bytes: int
    enable_prefix_caching: bool
    cache_dtype: str = "auto"  # kv_cache_dtype (vLLM's CacheConfig.cache_dtype)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    preemption_mode: str | None


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29501

    @property
    def coordinator_address(self) -> str:
        """``host:port`` of the JAX coordinator (``jax.distributed.initialize``)."""
        return f"{self.master_addr}:{self.master_port}"


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA limits (``jaxpaged.lora``); present only with ``enable_lora``."""

    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int


def _lora_config(args: EngineArgs) -> LoRAConfig | None:
    if not args.enable_lora:
        return None
    if args.max_loras < 1:
        raise ValueError(f"max_loras must be at least 1, got {args.max_loras}")
    _check_choice("max_lora_rank", args.max_lora_rank, _LORA_RANKS)
    max_cpu_loras = args.max_loras if args.max_cpu_loras is None else args.max_cpu_loras
    if max_cpu_loras < args.max_loras:
        raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({args.max_loras})")
    return LoRAConfig(args.max_loras, args.max_lora_rank, max_cpu_loras)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    attention_backend: str
    enforce_eager: bool | None
    parallel_config: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    async_scheduling: bool = False
    enable_compilation_cache: bool = True
    compilation_cache_dir: str | None = None  # None: compilation_cache.DEFAULT_CACHE_ROOT
    # Multi-LoRA limits; None without enable_lora.
    lora_config: LoRAConfig | None = None
    enable_sleep_mode: bool = False
    structured_outputs_config: StructuredOutputsConfig = dataclasses.field(
        default_factory=StructuredOutputsConfig
    )
    # Speculative decoding (jaxpaged.spec_decode); None: off.
    speculative_config: SpeculativeConfig | None = None

    @classmethod
    def from_args(cls, args: EngineArgs) -> EngineConfig:
        """Check every field of ``args`` and derive the typed configs, reading the model's
        ``config.json`` (a Hub id is downloaded first).

        Raises:
            ValueError: naming the field, the rule and the value received.
        """
        import_model_impl(args.model_impl_module)  # registers its architectures
        _check_choice("logprobs_mode", args.logprobs_mode, LOGPROBS_MODES)
        model, hf_config_json = _model_directory(args)
        _check_engine_args(args)
        quant_config, parallel_config = _quantization_and_parallelism(args, model, hf_config_json)
        max_model_len = _max_model_len(args, hf_config_json)
        max_num_batched_tokens = args.max_num_batched_tokens
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(2048, args.max_num_seqs)
        if max_num_batched_tokens < args.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({args.max_num_seqs}) so every running sequence can decode"
            )
        return cls(
            model_config=_model_config(args, model, hf_config_json, max_model_len, quant_config),
            cache_config=CacheConfig(
                block_size=args.block_size,
                gpu_memory_utilization=args.gpu_memory_utilization,
                kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                num_gpu_blocks_override=args.num_gpu_blocks_override,
                swap_space_bytes=int(args.swap_space * 1024**3),
                enable_prefix_caching=bool(args.enable_prefix_caching),
                cache_dtype=args.kv_cache_dtype,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
                preemption_mode=args.preemption_mode,
            ),
            attention_backend=args.attention_backend,
            enforce_eager=args.enforce_eager,
            parallel_config=parallel_config,
            async_scheduling=args.async_scheduling,
            enable_compilation_cache=bool(args.enable_compilation_cache),
            compilation_cache_dir=args.compilation_cache_dir,
            lora_config=_lora_config(args),
            enable_sleep_mode=bool(args.enable_sleep_mode),
            structured_outputs_config=StructuredOutputsConfig.parse(args.structured_outputs_config),
            speculative_config=SpeculativeConfig.parse(
                args.speculative_config,
                SpeculationTarget(
                    hf_config_json=hf_config_json,
                    max_model_len=max_model_len,
                    max_num_batched_tokens=max_num_batched_tokens,
                    tensor_parallel_size=parallel_config.tensor_parallel_size,
                    enable_lora=bool(args.enable_lora),
                    load_format=args.load_format,
                    download_dir=args.download_dir,
                ),
            ),
        )


def _model_directory(args: EngineArgs) -> tuple[str, dict]:
    """The model's local directory (a Hub id becomes its snapshot, ``models.hub``; a directory
    stays as is) and its ``config.json``."""
    model = args.model or default_model_path()
    model = resolve_model_path(
        model, revision=args.revision, download_dir=args.download_dir,
        require_weights=args.load_format != "dummy",
    )  # fmt: skip
    config_path = os.path.join(model, "config.json")
    if not os.path.isdir(model):
        raise ValueError(
            f"model directory {model!r} does not exist (give a local HF model directory)"
        )
    if not os.path.isfile(config_path):
        raise ValueError(f"model directory {model!r} has no config.json")
    return model, read_config_json(config_path)


def _check_engine_args(args: EngineArgs) -> None:
    """The checks of fields that need nothing but their own value."""
    _check_choice("dtype", args.dtype, DTYPE_CHOICES)
    _check_choice("load_format", args.load_format, _LOAD_FORMATS)
    _check_choice("attention_backend", args.attention_backend, ATTENTION_BACKEND_CHOICES)
    _check_choice("block_size", args.block_size, BLOCK_SIZE_CHOICES)
    _check_choice("preemption_mode", args.preemption_mode, PREEMPTION_MODES)
    _check_kv_cache_dtype(args)
    if not args.swap_space >= 0:
        raise ValueError(f"swap_space must be a non-negative number of GiB, got {args.swap_space}")
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise ValueError(
            f"gpu_memory_utilization must be in (0, 1], got {args.gpu_memory_utilization}"
        )
    if args.max_logprobs < -1:
        raise ValueError(f"max_logprobs must be non-negative or -1, got {args.max_logprobs}")
    if args.max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {args.max_num_seqs}")
    if args.num_gpu_blocks_override is not None and args.num_gpu_blocks_override < 1:
        raise ValueError(
            f"num_gpu_blocks_override must be at least 1, got {args.num_gpu_blocks_override}"
        )
    if args.kv_cache_memory_bytes is not None and args.kv_cache_memory_bytes < 1:
        raise ValueError(
            f"kv_cache_memory_bytes must be positive, got {args.kv_cache_memory_bytes}"
        )


def _quantization_and_parallelism(
    args: EngineArgs, model: str, hf_config_json: dict
) -> tuple[QuantizationConfig | None, ParallelConfig]:
    """The quantization, resolved once here (auto-detection, flag/checkpoint mismatch) with its
    linear backend, and the parallel layout. A `jaxpaged convert` directory records the
    quantization its tensors were made with, and the device count it was sharded for (checked
    before any process starts)."""
    orbax_meta = None
    if args.load_format != "dummy" and is_orbax_checkpoint(model):
        orbax_meta = read_metadata(model)
        quant_config = checkpoint_quantization(model, orbax_meta, hf_config_json, args.quantization)
    else:
        quant_config = resolve_quantization(
            args.quantization, hf_config_json.get("quantization_config"), args.load_format
        )
    parallel_config = _parallel_config(args, hf_config_json)
    if orbax_meta is not None:
        check_shard_count(model, orbax_meta, parallel_config.tensor_parallel_size)
    _check_choice("linear_backend", args.linear_backend, LINEAR_BACKEND_CHOICES)
    quant_config = with_linear_backend(
        quant_config, args.linear_backend,
        tensor_parallel_size=parallel_config.tensor_parallel_size,
    )  # fmt: skip
    return quant_config, parallel_config


def _max_model_len(args: EngineArgs, hf_config_json: dict) -> int:
    """``max_model_len``, or the model's limit when None; at most that limit."""
    # GPT-2 names it n_positions; BLOOM (ALiBi) has none: vLLM's default of 2048.
    model_limit = int(
        hf_config_json.get("max_position_embeddings") or hf_config_json.get("n_positions") or 2048
    )
    max_model_len = args.max_model_len if args.max_model_len is not None else model_limit
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be at least 1, got {max_model_len}")
    if max_model_len > model_limit:
        raise ValueError(
            f"max_model_len ({max_model_len}) is larger than the model's "
            f"max_position_embeddings ({model_limit})"
        )
    return max_model_len


def _model_config(
    args: EngineArgs,
    model: str,
    hf_config_json: dict,
    max_model_len: int,
    quant_config: QuantizationConfig | None,
) -> ModelConfig:
    return ModelConfig(
        model=model,
        tokenizer=args.tokenizer or model,
        skip_tokenizer_init=bool(args.skip_tokenizer_init),
        dtype=args.dtype,
        max_model_len=max_model_len,
        load_format=args.load_format,
        seed=args.seed,
        hf_config_json=hf_config_json,
        # -1: the whole vocabulary (the step then ranks every token: vLLM's meaning).
        max_logprobs=(
            int(hf_config_json.get("vocab_size", 0))
            if args.max_logprobs == -1
            else args.max_logprobs
        ),
        logprobs_mode=args.logprobs_mode,
        quantization=args.quantization,
        quant_config=quant_config,
    )


def read_config_json(config_path: str) -> dict:
    """The JSON object of a model's ``config.json``.

    Raises:
        ValueError: the file is not UTF-8 JSON, or holds no object; naming the file and
            the position (a bare ``JSONDecodeError`` named neither).
    """
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{config_path} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} must hold a JSON object, got {type(config).__name__}")
    return config


def import_model_impl(module: str | None) -> None:
    """Import ``model_impl_module`` (its import registers its architectures); None: nothing.

    Raises:
        ValueError: the module cannot be imported (named, with the import error).
    """
    if module is None:
        return
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"model_impl_module {module!r} cannot be imported: {e}") from e


def _parallel_config(args: EngineArgs, hf_config_json: dict) -> ParallelConfig:
    tp = args.tensor_parallel_size
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {tp}")
    if tp > 1:  # raises for a dimension that cannot be split (models.sharding.TPLayout)
        TPLayout.from_hf_config(hf_config_json, tp)
    if args.nnodes < 1:
        raise ValueError(f"nnodes must be at least 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        raise ValueError(
            f"node_rank must be in [0, nnodes) = [0, {args.nnodes}), got {args.node_rank}"
        )
    if args.nnodes > 1 and tp < args.nnodes:
        raise ValueError(
            f"tensor_parallel_size ({tp}) must be at least nnodes ({args.nnodes}): "
            "one model spans all processes, each holding at least one of its shards"
        )
    if not 1 <= args.master_port <= 65535:
        raise ValueError(f"master_port must be in [1, 65535], got {args.master_port}")
    return ParallelConfig(
        tensor_parallel_size=tp,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
    )


def _check_kv_cache_dtype(args: EngineArgs) -> None:
    _check_choice("kv_cache_dtype", args.kv_cache_dtype, KV_CACHE_DTYPE_CHOICES)
    if args.calculate_kv_scales:
        raise ValueError(
            "calculate_kv_scales is not supported yet (scales from the first batch would need a "
            "step that updates the model's state); with kv_cache_dtype='fp8' the scales come "
            "from the checkpoint (*.self_attn.k_scale / v_scale) or default to 1.0"
        )


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
