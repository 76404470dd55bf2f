"""HF ``quantization_config`` -> one frozen config per method, and the ``quantization=`` flag check.

No JAX and no numpy here, so ``jaxpaged.config`` can validate ``quantization`` at argument time
(as it does the TP layout through ``models.tp_layout``).

Method names and auto-detection follow vLLM (``vllm/model_executor/layers/quantization/``,
``ModelConfig._verify_quantization``): ``quantization=None`` takes the method from the
checkpoint's ``quantization_config.quant_method``; a flag that names another method than the
checkpoint's is an error; ``fp8`` and ``bitsandbytes`` may also quantize an unquantized checkpoint
at load ("online"). Field names are the tools' own:

- AutoAWQ (``awq/models/base.py`` ``save_quantized``): ``bits``/``w_bit``,
  ``group_size``/``q_group_size``, ``zero_point``, ``version``, ``modules_to_not_convert``.
- GPTQ (AutoGPTQ / gptqmodel ``QuantizeConfig``): ``bits``, ``group_size`` (-1: one group over
  the whole input), ``desc_act``, ``sym``, ``lm_head`` (must be false), ``checkpoint_format`` (``gptq`` = v1,
  zero points stored minus one; ``gptq_v2`` stored as is).
- compressed-tensors (``compressed_tensors/quantization/quant_config.py``, ``quant_args.py``):
  ``config_groups`` of ``targets`` + ``weights`` / ``input_activations`` args, ``ignore``,
  ``format``.
- FP8 (vLLM ``Fp8Config``): ``activation_scheme``, ``weight_block_size``, ``ignored_layers``.
- bitsandbytes (transformers ``BitsAndBytesConfig``): ``load_in_8bit``, ``load_in_4bit``,
  ``llm_int8_skip_modules``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from models.quantization import QUANTIZATION_METHODS

# quant_method spellings found in checkpoints -> vLLM's method name.
_QUANT_METHOD_ALIASES = {
    "awq": "awq",
    "gptq": "gptq",
    "compressed-tensors": "compressed-tensors",
    "compressed_tensors": "compressed-tensors",
    "fp8": "fp8",
    "bitsandbytes": "bitsandbytes",
}
# Methods that can quantize an unquantized checkpoint while loading it.
_ONLINE_METHODS = ("fp8", "bitsandbytes")
_BNB_LOAD_FORMATS = ("bitsandbytes", "dummy")


def _field(config: Mapping[str, Any], keys: tuple[str, ...], default: Any = ...) -> Any:
    """The first of ``keys`` present in ``config``; ``default`` (or ValueError) if none is."""
    for key in keys:
        if key in config and config[key] is not None:
            return config[key]
    if default is ...:
        raise ValueError(f"quantization_config is missing the field {' / '.join(keys)}")
    return default


def _int_field(config: Mapping[str, Any], keys: tuple[str, ...], default: Any = ...) -> int:
    value = _field(config, keys, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"quantization_config.{keys[0]} must be an integer, got {value!r}")
    return value


def _bool_field(config: Mapping[str, Any], key: str, default: bool) -> bool:
    value = config.get(key, default)
    value = default if value is None else value
    if not isinstance(value, bool):
        raise ValueError(f"quantization_config.{key} must be true or false, got {value!r}")
    return value


def _names(config: Mapping[str, Any], key: str) -> tuple[str, ...]:
    value = config.get(key) or ()
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"quantization_config.{key} must be a list of module names, got {value!r}")
    return tuple(value)


def _group_size(value: int, method: str) -> int:
    if value != -1 and value < 1:
        raise ValueError(
            f"quantization_config.group_size must be -1 (one group) or positive for {method}, "
            f"got {value}"
        )
    return value


def _skipped(layer_name: str, modules: tuple[str, ...]) -> bool:
    """vLLM's ``is_layer_skipped_awq`` rule: a listed name occurring in the layer's dotted name."""
    return any(module in layer_name for module in modules)


@dataclasses.dataclass(frozen=True)
class AWQConfig:
    """AutoAWQ GEMM checkpoint: 4-bit weights with zero points, per-group fp16 scales."""

    weight_bits: int
    group_size: int  # 32, 64, 128, ... input rows per scale; -1: one group
    zero_point: bool
    modules_to_not_convert: tuple[str, ...] = ()
    # The backend of its 4-bit layers (models.linear_backends): set by the engine, not stored.
    linear_backend: str = "xla"
    method = "awq"

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> AWQConfig:
        bits = _int_field(config, ("bits", "w_bit"))
        if bits != 4:
            raise ValueError(
                f"quantization_config.bits must be 4 for awq (AutoAWQ GEMM), got {bits}"
            )
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(
                f"quantization_config.version must be 'gemm' for awq (AutoAWQ GEMM layout), got "
                f"{config.get('version')!r}"
            )
        zero_point = _bool_field(config, "zero_point", True)
        if not zero_point:
            raise ValueError(
                "quantization_config.zero_point must be true for awq: AutoAWQ GEMM checkpoints "
                "store qzeros"
            )
        group_size = _group_size(_int_field(config, ("group_size", "q_group_size")), "awq")
        return cls(bits, group_size, zero_point, _names(config, "modules_to_not_convert"))

    def is_skipped(self, layer_name: str) -> bool:
        """Whether ``layer_name`` (e.g. ``model.layers.0.mlp.gate_proj``) stays unquantized."""
        return _skipped(layer_name, self.modules_to_not_convert)


@dataclasses.dataclass(frozen=True)
class GPTQConfig:
    """GPTQ checkpoint (AutoGPTQ / gptqmodel): 4- or 8-bit, optional act-order ``g_idx``."""

    weight_bits: int
    group_size: int  # -1: one group over the whole input
    desc_act: bool  # act-order: rows belong to groups through g_idx, not in blocks
    sym: bool
    checkpoint_format: str = "gptq"  # "gptq" (v1: qzeros stored minus one) or "gptq_v2"
    # The backend of its 4-bit layers (models.linear_backends): set by the engine, not stored.
    linear_backend: str = "xla"
    method = "gptq"

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> GPTQConfig:
        bits = _int_field(config, ("bits",))
        if bits not in (4, 8):
            raise ValueError(f"quantization_config.bits must be 4 or 8 for gptq, got {bits}")
        group_size = _group_size(_int_field(config, ("group_size",)), "gptq")
        checkpoint_format = str(config.get("checkpoint_format") or "gptq")
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise ValueError(
                "quantization_config.checkpoint_format must be 'gptq' or 'gptq_v2' for gptq, got "
                f"{checkpoint_format!r}"
            )
        if config.get("lm_head"):
            raise ValueError(
                "quantization_config.lm_head=true (a quantized lm_head) is not supported, got "
                f"{config['lm_head']!r}"
            )
        if config.get("dynamic"):
            raise ValueError(
                "quantization_config.dynamic (per-module GPTQ overrides) is not supported, got "
                f"{config['dynamic']!r}"
            )
        return cls(
            weight_bits=bits,
            group_size=group_size,
            desc_act=_bool_field(config, "desc_act", False),
            sym=_bool_field(config, "sym", True),
            checkpoint_format=checkpoint_format,
        )

    def is_skipped(self, layer_name: str) -> bool:
        """Only ``lm_head`` is unquantized in a GPTQ checkpoint (``lm_head: true`` is refused)."""
        return layer_name.split(".")[-1] == "lm_head"


@dataclasses.dataclass(frozen=True)
class QuantizationArgs:
    """One compressed-tensors ``QuantizationArgs`` (weights or input activations)."""

    num_bits: int
    type: str  # "int" or "float"
    symmetric: bool
    strategy: str  # "tensor", "channel", "group", "token"
    group_size: int | None
    dynamic: bool  # activations only: scales computed per call (else the stored input_scale)
    actorder: str | None  # None, "static", "group" (weight_g_idx stored), "weight"

    @classmethod
    def from_config(cls, args: Mapping[str, Any], where: str) -> QuantizationArgs:
        def fail(name: str, rule: str) -> ValueError:
            return ValueError(f"{where}.{name} {rule}, got {args.get(name)!r}")

        kind = args.get("type", "int")
        if kind not in ("int", "float"):
            raise fail("type", "must be 'int' or 'float'")
        strategy = args.get("strategy") or "tensor"
        if strategy not in ("tensor", "channel", "group", "token"):
            raise fail("strategy", "must be one of tensor, channel, group, token")
        dynamic = args.get("dynamic", False)
        if dynamic not in (True, False):  # "local" (tensor-group dynamic, NVFP4) is not handled
            raise fail("dynamic", "must be true or false")
        group_size = args.get("group_size")
        if strategy == "group" and (not isinstance(group_size, int) or group_size < 1):
            raise fail("group_size", "must be a positive integer with strategy 'group'")
        actorder = args.get("actorder")
        if isinstance(actorder, bool):  # older configs wrote true for "group"
            actorder = "group" if actorder else None
        if actorder not in (None, "static", "group", "weight"):
            raise fail("actorder", "must be null, 'static', 'group' or 'weight'")
        num_bits = args.get("num_bits", 8)
        if isinstance(num_bits, bool) or not isinstance(num_bits, int):
            raise fail("num_bits", "must be an integer")
        return cls(
            num_bits=num_bits,
            type=kind,
            symmetric=bool(args.get("symmetric", True)),
            strategy=strategy,
            group_size=group_size if strategy == "group" else None,
            dynamic=bool(dynamic),
            actorder=actorder,
        )


# The compressed-tensors scheme kinds jaxpaged runs (``QuantizationScheme.kind``); every layer's
# scheme is classified into one of them or refused (``jaxpaged bench matrix`` lists a row for each).
COMPRESSED_TENSORS_SCHEME_KINDS: tuple[str, ...] = ("wna16", "w8a8_int8", "w8a8_fp8")


@dataclasses.dataclass(frozen=True)
class QuantizationScheme:
    """The compressed-tensors scheme of one layer, classified into the kinds jaxpaged runs
    (:data:`COMPRESSED_TENSORS_SCHEME_KINDS`).

    ``kind`` is ``"wna16"`` (int4/int8 weights packed in int32, activations unquantized),
    ``"w8a8_int8"`` (int8 weights and per-token / per-tensor int8 activations) or ``"w8a8_fp8"``
    (e4m3 weights, e4m3 activations).
    """

    weights: QuantizationArgs
    input_activations: QuantizationArgs | None
    kind: str

    @classmethod
    def from_config(cls, group: Mapping[str, Any], where: str) -> QuantizationScheme:
        if group.get("weights") is None:
            raise ValueError(f"{where}.weights is missing: weight quantization is required")
        if group.get("output_activations") is not None:
            raise ValueError(f"{where}.output_activations is not supported, got a value")
        weights = QuantizationArgs.from_config(group["weights"], f"{where}.weights")
        act_cfg = group.get("input_activations")
        acts = (
            None
            if act_cfg is None
            else QuantizationArgs.from_config(act_cfg, f"{where}.input_activations")
        )
        kind = _scheme_kind(weights, acts, where)
        if kind not in COMPRESSED_TENSORS_SCHEME_KINDS:  # a new kind must be listed (and run)
            raise ValueError(f"{where}: scheme kind {kind!r} is not one jaxpaged runs")
        return cls(weights, acts, kind)


def _scheme_kind(w: QuantizationArgs, a: QuantizationArgs | None, where: str) -> str:
    if a is None:
        if w.type != "int":
            raise ValueError(
                f"{where}.weights.type 'float' without input_activations (FP8 weight-only) is "
                "not supported; use an FP8 W8A8 scheme"
            )
        if w.num_bits not in (4, 8):
            raise ValueError(f"{where}.weights.num_bits must be 4 or 8, got {w.num_bits}")
        if w.strategy not in ("channel", "group"):
            raise ValueError(
                f"{where}.weights.strategy must be 'channel' or 'group' for weight-only "
                f"quantization, got {w.strategy!r}"
            )
        if w.actorder == "weight":
            raise ValueError(f"{where}.weights.actorder 'weight' is not supported")
        return "wna16"
    if w.num_bits != 8 or a.num_bits != 8:
        raise ValueError(
            f"{where}: activation quantization needs 8-bit weights and activations, got weights "
            f"num_bits {w.num_bits} and input_activations num_bits {a.num_bits}"
        )
    if w.type != a.type:
        raise ValueError(
            f"{where}.input_activations.type must equal weights.type, got {a.type!r} and {w.type!r}"
        )
    if w.strategy not in ("tensor", "channel"):
        raise ValueError(
            f"{where}.weights.strategy must be 'tensor' or 'channel' for W8A8, got {w.strategy!r}"
        )
    if not w.symmetric or not a.symmetric:
        raise ValueError(f"{where}: W8A8 needs symmetric weights and input_activations")
    if a.dynamic and a.strategy not in ("token", "tensor"):
        raise ValueError(
            f"{where}.input_activations.strategy must be 'token' or 'tensor' when dynamic, "
            f"got {a.strategy!r}"
        )
    if not a.dynamic and a.strategy != "tensor":
        raise ValueError(
            f"{where}.input_activations.strategy must be 'tensor' for static scales, got "
            f"{a.strategy!r}"
        )
    return "w8a8_int8" if w.type == "int" else "w8a8_fp8"


# compressed-tensors CompressionFormat values whose tensors jaxpaged reads (None: inferred).
_CT_FORMATS = (None, "pack-quantized", "int-quantized", "float-quantized", "naive-quantized")


def _check_format(fmt: Any, where: str) -> None:
    if fmt not in _CT_FORMATS:
        raise ValueError(
            f"{where} must be one of {', '.join(str(f) for f in _CT_FORMATS[1:])}, got {fmt!r}"
        )


def _match(target: str, layer_name: str) -> bool:
    """compressed-tensors' name match: ``re:`` prefix for a regex, else the exact name."""
    if target.startswith("re:"):
        return re.match(target[3:], layer_name) is not None
    return target == layer_name


@dataclasses.dataclass(frozen=True)
class CompressedTensorsConfig:
    """A compressed-tensors checkpoint (llm-compressor): schemes per target, ``ignore`` list."""

    groups: tuple[tuple[tuple[str, ...], QuantizationScheme], ...]  # (targets, scheme)
    ignore: tuple[str, ...]
    format: str | None
    # FP8 KV cache with calibrated per-layer k_scale / v_scale stored in the checkpoint.
    kv_cache_scheme: QuantizationArgs | None = None
    # The backend of its 4-bit layers (models.linear_backends): set by the engine, not stored.
    linear_backend: str = "xla"
    method = "compressed-tensors"

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> CompressedTensorsConfig:
        groups_cfg = config.get("config_groups")
        if not isinstance(groups_cfg, Mapping) or not groups_cfg:
            raise ValueError(
                "quantization_config.config_groups must be a non-empty mapping for "
                f"compressed-tensors, got {groups_cfg!r}"
            )
        status = config.get("quantization_status", "compressed")
        if status not in ("compressed", "frozen"):
            raise ValueError(
                "quantization_config.quantization_status must be 'compressed' or 'frozen' "
                f"(a saved checkpoint), got {status!r}"
            )
        if config.get("sparsity_config"):
            raise ValueError(
                "quantization_config.sparsity_config (sparse compressed-tensors) is not "
                "supported, got a value"
            )
        _check_format(config.get("format"), "quantization_config.format")
        groups = []
        for name, group in groups_cfg.items():
            where = f"quantization_config.config_groups.{name}"
            _check_format(group.get("format"), f"{where}.format")
            targets = group.get("targets")
            if not targets or isinstance(targets, str):
                raise ValueError(f"{where}.targets must be a non-empty list, got {targets!r}")
            groups.append((tuple(targets), QuantizationScheme.from_config(group, where)))
        kv_cache_scheme = None
        if config.get("kv_cache_scheme") is not None:
            where = "quantization_config.kv_cache_scheme"
            kv_cache_scheme = QuantizationArgs.from_config(config["kv_cache_scheme"], where)
            if (kv_cache_scheme.type, kv_cache_scheme.num_bits) != ("float", 8) or (
                kv_cache_scheme.strategy != "tensor"
            ):
                raise ValueError(
                    f"{where} must be 8-bit float with strategy 'tensor' (per-layer k_scale / "
                    f"v_scale), got type {kv_cache_scheme.type!r}, num_bits "
                    f"{kv_cache_scheme.num_bits}, strategy {kv_cache_scheme.strategy!r}"
                )
        return cls(tuple(groups), _names(config, "ignore"), config.get("format"), kv_cache_scheme)

    def scheme_for(self, layer_name: str) -> QuantizationScheme | None:
        """The scheme of linear layer ``layer_name``; None when ignored or targeted by no group.

        A target ``"Linear"`` matches every linear layer; other targets match the name exactly or,
        with the ``re:`` prefix, as a regex from its start (compressed-tensors' rule).
        """
        if any(_match(pattern, layer_name) for pattern in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(t == "Linear" or _match(t, layer_name) for t in targets):
                return scheme
        return None


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    """vLLM's ``fp8``: per-tensor e4m3 weights, from an FP8 checkpoint or quantized at load."""

    is_checkpoint_fp8_serialized: bool
    activation_scheme: str  # "dynamic" (per-token scales per call) or "static" (input_scale)
    ignored_layers: tuple[str, ...] = ()
    method = "fp8"

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None) -> Fp8Config:
        """``None``: online FP8 of an unquantized checkpoint (dynamic activation scales)."""
        if config is None:
            return cls(False, "dynamic")
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(
                "quantization_config.activation_scheme must be 'dynamic' or 'static' for fp8, "
                f"got {scheme!r}"
            )
        if config.get("weight_block_size") is not None:
            raise ValueError(
                "quantization_config.weight_block_size (block-wise FP8) is not supported, got "
                f"{config['weight_block_size']!r}"
            )
        return cls(True, scheme, _names(config, "ignored_layers"))

    def is_skipped(self, layer_name: str) -> bool:
        return _skipped(layer_name, self.ignored_layers)


@dataclasses.dataclass(frozen=True)
class BitsAndBytesConfig:
    """bitsandbytes LLM.int8 layout: int8 weights with one absmax per output row (``SCB``)."""

    is_prequantized: bool  # the checkpoint stores int8 ``weight`` + ``SCB``
    llm_int8_skip_modules: tuple[str, ...] = ()
    method = "bitsandbytes"

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None) -> BitsAndBytesConfig:
        """``None``: 8-bit quantization at load of an unquantized checkpoint."""
        if config is None:
            return cls(False)
        if _bool_field(config, "load_in_4bit", False):
            raise ValueError("quantization_config.load_in_4bit is not supported; use 8-bit")
        if not _bool_field(config, "load_in_8bit", False):
            raise ValueError(
                "quantization_config.load_in_8bit must be true for bitsandbytes, got "
                f"{config.get('load_in_8bit')!r}"
            )
        return cls(True, _names(config, "llm_int8_skip_modules"))

    def is_skipped(self, layer_name: str) -> bool:
        return _skipped(layer_name, self.llm_int8_skip_modules)


QuantizationConfig = (
    AWQConfig | GPTQConfig | CompressedTensorsConfig | Fp8Config | BitsAndBytesConfig
)

_CONFIG_CLASSES = {
    "awq": AWQConfig,
    "gptq": GPTQConfig,
    "compressed-tensors": CompressedTensorsConfig,
    "fp8": Fp8Config,
    "bitsandbytes": BitsAndBytesConfig,
}


def checkpoint_method(hf_quantization_config: Mapping[str, Any] | None) -> str | None:
    """vLLM's method name for a checkpoint's ``quantization_config`` (None: unquantized).

    Raises:
        ValueError: ``quant_method`` is missing or names a method jaxpaged does not implement.
    """
    if hf_quantization_config is None:
        return None
    quant_method = hf_quantization_config.get("quant_method")
    if quant_method is None:
        raise ValueError("quantization_config is missing the field quant_method")
    method = _QUANT_METHOD_ALIASES.get(str(quant_method).lower())
    if method is None:
        raise ValueError(
            f"quantization_config.quant_method {quant_method!r} is not supported; supported: "
            f"{', '.join(QUANTIZATION_METHODS)}"
        )
    return method


def resolve_quantization(
    quantization: str | None,
    hf_quantization_config: Mapping[str, Any] | None,
    load_format: str = "auto",
) -> QuantizationConfig | None:
    """The quantization config to load a checkpoint with, from the flag and the checkpoint.

    Args:
        quantization: the ``quantization=`` argument (vLLM's names, :data:`QUANTIZATION_METHODS`);
            None auto-detects from the checkpoint.
        hf_quantization_config: the ``quantization_config`` dict of the checkpoint's
            ``config.json``, or None for an unquantized checkpoint.
        load_format: the ``load_format`` argument; ``bitsandbytes`` goes with
            ``quantization="bitsandbytes"`` (``dummy`` is also allowed with it).

    Returns:
        None (no quantization) or the method's frozen config.

    Raises:
        ValueError: an unknown method (flag or ``quant_method``); a flag naming another method
            than the checkpoint's; ``awq``/``gptq``/``compressed-tensors`` asked of an unquantized
            checkpoint; ``bitsandbytes`` without ``load_format="bitsandbytes"`` or the reverse;
            any invalid field of the config (named).
    """
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} or None, got "
            f"{quantization!r}"
        )
    stored = checkpoint_method(hf_quantization_config)
    if quantization is not None and stored is not None and quantization != stored:
        raise ValueError(
            f"quantization={quantization!r} does not match the checkpoint's "
            f"quantization_config.quant_method {hf_quantization_config.get('quant_method')!r}"
        )
    method = quantization or stored
    if method is None:
        if load_format == "bitsandbytes":
            raise ValueError(
                "load_format='bitsandbytes' needs quantization='bitsandbytes', got "
                f"quantization={quantization!r}"
            )
        return None
    if stored is None and method not in _ONLINE_METHODS:
        raise ValueError(
            f"quantization={method!r} needs a checkpoint quantized by its tool (config.json has "
            f"no quantization_config); only {' and '.join(_ONLINE_METHODS)} quantize at load"
        )
    if (method == "bitsandbytes") != (load_format == "bitsandbytes") and not (
        method == "bitsandbytes" and load_format in _BNB_LOAD_FORMATS
    ):
        raise ValueError(
            f"quantization='bitsandbytes' and load_format='bitsandbytes' go together, got "
            f"quantization={method!r} and load_format={load_format!r}"
        )
    return _CONFIG_CLASSES[method].from_config(hf_quantization_config)
