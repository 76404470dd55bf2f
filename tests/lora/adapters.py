"""The test adapters on stories260k and their reference tokens (``tests/data/lora``).

Three random adapters of different ranks, targets and scalings (``SPECS``) are written at test
time by ``jaxpaged.lora.dummy`` (deterministic from their seeds). Their greedy continuations
come from HF transformers + peft (unmerged ``PeftModel``) in float32 on CPU; running torch in
every test run costs ~30 s, so ``python -m tests.lora.adapters`` computes them once into
``tests/data/lora/golden.json`` (committed). peft loading our files is itself the check that
the writer's layout is PEFT's.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import tempfile

from jaxpaged.config import default_model_path
from jaxpaged.lora.dummy import write_random_peft_adapter
from models.lora import llama_projection_specs

GOLDEN = pathlib.Path(__file__).parent.parent / "data" / "lora" / "golden.json"
MAX_TOKENS = 12
PROMPTS = ([1, 403, 261, 21, 29, 78], [1, 22, 33, 44], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13])


@dataclasses.dataclass(frozen=True)
class AdapterSpec:
    name: str
    rank: int
    alpha: float
    targets: tuple[str, ...]
    use_rslora: bool = False
    seed: int = 0


ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SPECS = (
    AdapterSpec("qv-r4", 4, 8.0, ("q_proj", "v_proj"), seed=1),
    AdapterSpec("all-r8", 8, 16.0, ALL, seed=2),
    AdapterSpec("mlp-o-r16-rslora", 16, 4.0, ("gate_proj", "down_proj", "o_proj"), True, seed=3),
)


def write_adapter(base_dir: str, out_dir: pathlib.Path, spec: AdapterSpec) -> str:
    """Write ``spec``'s adapter for the HF checkpoint at ``base_dir`` into ``out_dir``."""
    from models.weights import load_config

    config = load_config(base_dir)
    return write_random_peft_adapter(
        str(out_dir),
        specs=llama_projection_specs(config),
        num_layers=config.num_hidden_layers,
        rank=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=spec.targets,
        use_rslora=spec.use_rslora,
        seed=spec.seed,
    )


def reference_greedy(base_dir: str, adapter_dir: str | None) -> list[list[int]]:
    """Greedy continuations of ``PROMPTS`` from HF transformers (+ peft), float32, CPU."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    outputs = []
    with torch.no_grad():
        for ids in PROMPTS:
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(out[0, len(ids) :].tolist())
    return outputs


def main() -> None:
    base = default_model_path()
    golden = {"prompts": [list(p) for p in PROMPTS], "max_tokens": MAX_TOKENS}
    golden["base"] = reference_greedy(base, None)
    with tempfile.TemporaryDirectory() as tmp:
        for spec in SPECS:
            path = write_adapter(base, pathlib.Path(tmp) / spec.name, spec)
            golden[spec.name] = reference_greedy(base, path)
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
