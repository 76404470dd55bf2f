"""LoRA through the reshaped decoder of Qwen3, Gemma-2, Mixtral and Phi-3, against HF
transformers + peft (float32, greedy), on the tiny random checkpoints of
``tests/models/test_families.py``.

Qwen3's q/k norms act on the adapted projections' outputs, Gemma-2's extra norms wrap the
adapted o_proj and MLP, Mixtral takes adapters on its attention only (an adapter that targets
its MLP is refused by name), and Phi-3's adapters target its fused ``qkv_proj`` /
``gate_up_proj`` (written here by peft itself). Each family runs two adapters and the base model in one
batch, so every token must pick its own slot.
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.lora.dummy import write_random_peft_adapter
from jaxpaged.lora.request import LoRARequest
from models.lora import llama_projection_specs
from models.weights import load_config
from tests.models.conftest import make_hf_checkpoint

pytest.importorskip("torch")
pytest.importorskip("peft")

MAX_TOKENS = 6
_RNG = np.random.default_rng(11)
PROMPTS = [[int(x) for x in _RNG.integers(3, 128, size=n)] for n in (9, 5, 12)]
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL = (*ATTENTION, "gate_proj", "up_proj", "down_proj")
# family -> the targets of its two adapters
FAMILIES = {
    "qwen3": (ALL, ("q_proj", "k_proj", "down_proj")),
    "gemma2": (ALL, ("v_proj", "o_proj", "up_proj")),
    "mixtral": (ATTENTION, ("q_proj", "v_proj")),
}


def _adapter(base: str, out: pathlib.Path, targets, rank: int, seed: int) -> str:
    config = load_config(base)
    return write_random_peft_adapter(
        str(out),
        specs=llama_projection_specs(config),
        num_layers=config.num_hidden_layers,
        rank=rank,
        lora_alpha=2.0 * rank,
        target_modules=targets,
        seed=seed,
    )


def _hf_greedy(base: str, adapter: str | None) -> list[list[int]]:
    import torch
    import transformers
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(
        base, dtype=torch.float32, attn_implementation="eager"
    )
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    outputs = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = list(prompt)
            for _ in range(MAX_TOKENS):
                ids.append(int(torch.argmax(model(torch.tensor([ids])).logits[0, -1])))
            outputs.append(ids[len(prompt) :])
    return outputs


def _lora_llm(base: str, stories_dir: str) -> LLM:
    """A float32 LLM of ``base`` with 2 LoRA slots of rank <= 8 (``stories_dir``'s tokenizer:
    any will do, prompts and outputs are token ids)."""
    return LLM(
        model=base, tokenizer=stories_dir, dtype="float32", block_size=8, max_model_len=32,
        max_num_seqs=8, max_num_batched_tokens=64, enable_lora=True, max_loras=2, max_lora_rank=8,
    )  # fmt: skip


@pytest.mark.parametrize("name", list(FAMILIES))
def test_mixed_adapters_match_hf_peft(tmp_path, stories_dir, name):
    base = make_hf_checkpoint(str(tmp_path / name), name)
    first, second = FAMILIES[name]
    paths = [
        _adapter(base, tmp_path / "a", first, 8, seed=1),
        _adapter(base, tmp_path / "b", second, 4, seed=2),
    ]
    expected = {i: _hf_greedy(base, path) for i, path in enumerate(paths)}
    expected[None] = _hf_greedy(base, None)
    assert expected[0] != expected[None] and expected[1] != expected[None]  # the adapters matter
    llm = _lora_llm(base, stories_dir)
    loras = [LoRARequest(f"{name}-{i}", i + 1, path) for i, path in enumerate(paths)]
    choice = [0, 1, None]  # prompt i runs with adapter choice[i] (None: base)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for shift in range(3):  # every prompt under every adapter, all three in one batch
        picks = [choice[(i + shift) % 3] for i in range(3)]
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            params,
            lora_request=[None if k is None else loras[k] for k in picks],
            use_tqdm=False,
        )
        got = [list(o.outputs[0].token_ids) for o in outputs]
        assert got == [expected[k][i] for i, k in enumerate(picks)], (name, shift)
    # The default layout (``models.lora.LORA_FOLD`` off): separate slot ``a``, no folded kernel.
    slot_weights = llm.llm_engine.lora_manager.slots.weights
    assert not any(w.base_columns for layer in slot_weights for w in layer.values())


def test_mixtral_refuses_an_adapter_on_its_experts(tmp_path, stories_dir):
    base = make_hf_checkpoint(str(tmp_path / "mixtral"), "mixtral")
    config = load_config(base)
    specs = llama_projection_specs(config)
    assert sorted(specs) == ["o_proj", "qkv_proj"]
    # Written against a dense config's sizes so that the file holds MLP tensors.
    dense = dict(
        llama_projection_specs(config.__class__(**{**config.to_dict(), "num_local_experts": 0}))
    )
    path = write_random_peft_adapter(
        str(tmp_path / "mlp"),
        specs=dense,
        num_layers=config.num_hidden_layers,
        rank=4,
        lora_alpha=8.0,
        target_modules=("q_proj", "gate_proj"),
        seed=3,
    )
    llm = LLM(
        model=base, tokenizer=stories_dir, dtype="float32", max_model_len=32, enable_lora=True
    )
    with pytest.raises(ValueError, match=r"not on \['gate_proj'\].*mixture-of-experts"):
        llm.generate(
            [{"prompt_token_ids": PROMPTS[0]}],
            SamplingParams(max_tokens=1),
            lora_request=LoRARequest("mlp", 1, path),
            use_tqdm=False,
        )


def _peft_phi3_adapter(base: str, out: pathlib.Path, rank: int, seed: int) -> str:
    """A PEFT adapter on Phi-3's own (fused) module names, with random A and B."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0)
    model = get_peft_model(model, config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * 0.3)
    model.save_pretrained(str(out))
    return str(out)


def test_phi3_fused_module_adapters_match_hf_peft(tmp_path, stories_dir):
    base = make_hf_checkpoint(str(tmp_path / "phi3"), "phi3")
    paths = [_peft_phi3_adapter(base, tmp_path / f"a{i}", 4 * (i + 1), seed=i) for i in range(2)]
    expected = {i: _hf_greedy(base, path) for i, path in enumerate(paths)}
    expected[None] = _hf_greedy(base, None)
    assert expected[0] != expected[None] and expected[1] != expected[None]
    llm = _lora_llm(base, stories_dir)
    loras = [LoRARequest(f"phi3-{i}", i + 1, path) for i, path in enumerate(paths)]
    picks = [0, 1, None]
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        lora_request=[None if k is None else loras[k] for k in picks],
        use_tqdm=False,
    )
    got = [list(o.outputs[0].token_ids) for o in outputs]
    assert got == [expected[k][i] for i, k in enumerate(picks)]
