"""PEFT LoRA adapter directories -> host arrays ready for a device slot.

A PEFT adapter directory (``peft.PeftModel.save_pretrained``) holds ``adapter_config.json``
(``r``, ``lora_alpha``, ``target_modules``, ``use_rslora``, ...) and
``adapter_model.safetensors`` with, per adapted module, ``...layers.{i}.{self_attn|mlp}.
{module}.lora_A.weight`` (``[r, in]``) and ``...lora_B.weight`` (``[out, r]``), torch's
``[out, in]`` Linear layout. PEFT computes ``y = x W^T + (x A^T B^T) * scaling`` with
``scaling = lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA (Kalajdzievski 2023,
arXiv:2312.03732; peft ``LoraLayer.update_layer``).

Phi-3's checkpoints fuse ``qkv_proj`` and ``gate_up_proj``, so its adapters target those
names: one ``A`` for all parts and one ``B`` whose rows are the parts' (q, k, v / gate, up, in
the checkpoint's order). Part ``p``'s update is ``x A B_p``: the adapter is read as one
``(A, B_p)`` pair per part, the same as separate q/k/v adapters sharing their ``A``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import numpy as np
import safetensors.numpy

from models.lora import LORA_PROJECTIONS, ProjectionSpec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The seven HF module names an adapter may target.
TARGET_MODULES = tuple(name for parts in LORA_PROJECTIONS.values() for name in parts)
# Fused HF modules (Phi-3's checkpoint names) -> their parts, in row order.
FUSED_MODULES = {"qkv_proj": LORA_PROJECTIONS["qkv_proj"], "gate_up_proj": ("gate_proj", "up_proj")}
_ACCEPTED = (*TARGET_MODULES, *FUSED_MODULES)
_TENSOR = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# Config options whose non-default values change the adapter's maths; refused by name.
_UNSUPPORTED = {
    "use_dora": False,
    "fan_in_fan_out": False,
    "bias": "none",
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "lora_bias": False,
    "trainable_token_indices": None,
    "layer_replication": None,
}


@dataclasses.dataclass
class LoRAAdapter:
    """One adapter on the host, float32.

    ``weights[(layer, module)] = (A [in, r], B [r, out] * scaling)`` for each adapted module
    (``module`` one of ``TARGET_MODULES``).
    """

    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]

    @property
    def target_modules(self) -> set[str]:
        return {module for _, module in self.weights}

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def read_adapter_config(path: str) -> dict:
    """The adapter directory's ``adapter_config.json`` as a dict.

    Raises:
        ValueError: ``path`` is not a directory, lacks the config or the weights file, or its
            config is not a JSON object.
    """
    if not os.path.isdir(path):
        raise ValueError(f"lora_path {path!r} is not a directory")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not os.path.isfile(os.path.join(path, name)):
            raise ValueError(f"lora_path {path!r} has no {name}")
    with open(os.path.join(path, CONFIG_FILE)) as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"lora_path {path!r}: {CONFIG_FILE} is not valid JSON: {error}"
            ) from None
    if not isinstance(config, dict):
        raise ValueError(f"lora_path {path!r}: {CONFIG_FILE} must hold a JSON object")
    return config


def adapter_rank(path: str, config: dict, max_lora_rank: int) -> int:
    """The rank ``r`` of the adapter at ``path`` (its ``read_adapter_config`` dict).

    Raises:
        ValueError: ``r`` is not a positive int, or is above ``max_lora_rank``.
    """
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"adapter {path!r}: r must be a positive int, got {rank!r}")
    if rank > max_lora_rank:
        raise ValueError(
            f"adapter {path!r}: LoRA rank {rank} is greater than max_lora_rank {max_lora_rank}"
        )
    return rank


def load_peft_adapter(
    path: str,
    *,
    specs: dict[str, ProjectionSpec],
    num_layers: int,
    max_lora_rank: int,
) -> LoRAAdapter:
    """Read and check a PEFT LoRA adapter directory.

    Args:
        path: the adapter directory.
        specs: the base model's projection sizes (``models.lora.llama_projection_specs``).
        num_layers: the base model's layer count.
        max_lora_rank: the engine's largest rank.

    Raises:
        ValueError: a bad path, a rank above ``max_lora_rank``, a target module other than
            q/k/v/o/gate/up/down_proj, an unsupported config option (DoRA, biases,
            ``modules_to_save``, rank/alpha patterns, ``fan_in_fan_out``), or a tensor whose
            name, layer or shape does not fit the base model; each names what is wrong.
    """
    config = read_adapter_config(path)
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"adapter {path!r}: peft_type must be 'LORA', got {peft_type!r}")
    for key, default in _UNSUPPORTED.items():
        value = config.get(key, default)
        if value and value != default:
            raise ValueError(
                f"adapter {path!r}: {key}={value!r} is not supported (only {default!r})"
            )
    rank = adapter_rank(path, config, max_lora_rank)
    targets = config.get("target_modules") or []
    if isinstance(targets, (list, tuple)):
        unknown = sorted(set(targets) - set(_ACCEPTED))
        if unknown:
            raise ValueError(
                f"adapter {path!r}: target_modules {unknown} are not supported; supported: "
                f"{list(_ACCEPTED)}"
            )
    alpha = float(config.get("lora_alpha", 8))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank

    sizes = {
        module: (spec.in_features, size)
        for spec_name, spec in specs.items()
        for module, size in zip(LORA_PROJECTIONS[spec_name], spec.part_sizes, strict=True)
    }
    for fused, parts in FUSED_MODULES.items():
        if all(part in sizes for part in parts):
            sizes[fused] = (sizes[parts[0]][0], sum(sizes[part][1] for part in parts))
    if isinstance(targets, (list, tuple)):
        _check_model_has(path, set(targets), sizes)
    try:
        tensors = safetensors.numpy.load_file(os.path.join(path, WEIGHTS_FILE))
    except safetensors.SafetensorError as error:
        raise ValueError(f"lora_path {path!r}: {WEIGHTS_FILE} is unreadable: {error}") from None
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR.search(name)
        if match is None or match.group(2) not in _ACCEPTED:
            raise ValueError(
                f"adapter {path!r}: tensor {name!r} is not a LoRA A/B weight of {list(_ACCEPTED)}"
            )
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        _check_model_has(path, {module}, sizes)
        if layer >= num_layers:
            raise ValueError(
                f"adapter {path!r}: tensor {name!r} is for layer {layer}; the model has "
                f"{num_layers} layers"
            )
        in_features, out_features = sizes[module]
        expected = (rank, in_features) if which == "A" else (out_features, rank)
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"adapter {path!r}: tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                f"{expected}"
            )
        pairs.setdefault((layer, module), {})[which] = tensor.astype(np.float32)
    weights = {}
    for (layer, module), pair in pairs.items():
        if len(pair) != 2:
            raise ValueError(f"adapter {path!r}: layer {layer} {module} lacks lora_A or lora_B")
        # torch [r, in] / [out, r] -> [in, r] / [r, out]; the scale goes into B once, here.
        a = np.ascontiguousarray(pair["A"].T)
        b = pair["B"].T * np.float32(scaling)
        parts = FUSED_MODULES.get(module, (module,))
        bounds = np.cumsum([0] + [sizes[part][1] for part in parts])
        for part, lo, hi in zip(parts, bounds[:-1], bounds[1:], strict=True):
            if (layer, part) in weights:
                raise ValueError(
                    f"adapter {path!r}: layer {layer} {part} is adapted twice (on its own and "
                    "inside a fused module)"
                )
            weights[(layer, part)] = (a, np.ascontiguousarray(b[:, lo:hi]))
    if not weights:
        raise ValueError(f"adapter {path!r}: {WEIGHTS_FILE} holds no LoRA weights")
    return LoRAAdapter(rank=rank, scaling=scaling, weights=weights)


def _check_model_has(path: str, modules: set[str], sizes: dict) -> None:
    """Refuse target modules the base model offers no LoRA for (a sparse-MoE model's MLP)."""
    missing = sorted(modules - set(sizes))
    if missing:
        raise ValueError(
            f"adapter {path!r}: this model takes LoRA only on {sorted(sizes)}, not on "
            f"{missing} (LoRA on mixture-of-experts MLPs is not supported)"
        )
