"""Random PEFT LoRA adapters on a HF Llama checkpoint, and peft's greedy reference tokens.

The adapters are made with peft itself (``LoraConfig(init_lora_weights=False)`` leaves A and B
at torch's random Linear init instead of B = 0), saved with ``save_pretrained``, and generated
from with HF transformers + peft on CPU in float32: an independent reference for
``jaxpaged.lora``.
"""

from __future__ import annotations

import dataclasses
import pathlib


@dataclasses.dataclass(frozen=True)
class AdapterSpec:
    name: str
    rank: int
    alpha: float
    targets: tuple[str, ...]
    use_rslora: bool = False
    seed: int = 0


# Three adapters of different ranks and target sets (the "Must show").
SPECS = (
    AdapterSpec("qv-r4", 4, 8.0, ("q_proj", "v_proj"), seed=1),
    AdapterSpec("all-r8", 8, 16.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                    "up_proj", "down_proj"), seed=2),
    AdapterSpec("mlp-r16-rs", 16, 4.0, ("gate_proj", "down_proj", "o_proj"), use_rslora=True,
                seed=3),
)


def make_adapter(base_dir: str, out_dir: pathlib.Path, spec: AdapterSpec, *, scale: float = 0.5):
    """Write a random PEFT adapter for the HF checkpoint ``base_dir`` into ``out_dir``.

    B is drawn like A (torch's default Linear init) and then multiplied by ``scale``, so the
    adapter changes greedy tokens without drowning the base model.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=list(spec.targets),
        use_rslora=spec.use_rslora,
        init_lora_weights=False,
        lora_dropout=0.0,
    )
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(scale)
    peft_model.save_pretrained(str(out_dir))
    return out_dir


def reference_greedy(base_dir: str, adapter_dir: str | None, prompts: list[list[int]],
                     max_tokens: int) -> list[list[int]]:
    """Greedy continuations from HF transformers (+ peft, unmerged) in float32 on CPU."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    outputs = []
    with torch.no_grad():
        for ids in prompts:
            tokens = torch.tensor([ids])
            out = model.generate(
                tokens, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                pad_token_id=0,
            )
            outputs.append(out[0, len(ids):].tolist())
    return outputs
