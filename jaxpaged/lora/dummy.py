"""Random PEFT LoRA adapters of real shapes, for tests and benchmarks (LoRA's ``dummy`` load
format): written in exactly the layout ``peft.PeftModel.save_pretrained`` produces
(``jaxpaged.lora.peft`` documents it), so peft itself can load them as a reference.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import numpy as np
import safetensors.numpy

from jaxpaged.lora.peft import CONFIG_FILE, TARGET_MODULES, WEIGHTS_FILE
from models.lora import LORA_PROJECTIONS, ProjectionSpec

_ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}


def write_random_peft_adapter(
    path: str,
    *,
    specs: dict[str, ProjectionSpec],
    num_layers: int,
    rank: int,
    lora_alpha: float,
    target_modules: Sequence[str],
    use_rslora: bool = False,
    seed: int = 0,
    b_scale: float = 0.5,
    dtype=np.float32,
) -> str:
    """Write a random adapter directory at ``path`` and return ``path``.

    A and B are drawn like torch's default ``nn.Linear`` init (uniform in
    ``±1/sqrt(fan_in)``), B then multiplied by ``b_scale`` (PEFT initialises B to zero; a
    trained adapter is not, and a zero B would test nothing).

    Raises:
        ValueError: a target module outside q/k/v/o/gate/up/down_proj.
    """
    unknown = sorted(set(target_modules) - set(TARGET_MODULES))
    if unknown:
        raise ValueError(f"target_modules {unknown} are not LoRA targets {list(TARGET_MODULES)}")
    rng = np.random.default_rng(seed)
    sizes = {
        module: (spec.in_features, size)
        for name, spec in specs.items()
        for module, size in zip(LORA_PROJECTIONS[name], spec.part_sizes, strict=True)
    }
    tensors = {}
    for layer in range(num_layers):
        for module in target_modules:
            in_features, out_features = sizes[module]
            block = "self_attn" if module in _ATTENTION else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            bound_a, bound_b = 1 / np.sqrt(in_features), b_scale / np.sqrt(rank)
            a = rng.uniform(-bound_a, bound_a, (rank, in_features))
            b = rng.uniform(-bound_b, bound_b, (out_features, rank))
            tensors[f"{prefix}.lora_A.weight"] = a.astype(dtype)
            tensors[f"{prefix}.lora_B.weight"] = b.astype(dtype)
    os.makedirs(path, exist_ok=True)
    safetensors.numpy.save_file(tensors, os.path.join(path, WEIGHTS_FILE))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": lora_alpha,
        "target_modules": sorted(target_modules),
        "use_rslora": use_rslora,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=1)
    return path
