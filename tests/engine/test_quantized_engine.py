"""``quantization=`` through the engine: resolution, refusals, a quantized checkpoint end to end,
the start-up report, and LoRA on a quantized base."""

from __future__ import annotations

import logging
import types

import numpy as np
import pytest

from jaxpaged import LLM, EngineArgs, SamplingParams
from jaxpaged.lora.request import LoRARequest
from models.gpt2 import GPT2LMHeadModel
from models.llama import LlamaForCausalLM
from models.quantization.config import resolve_quantization
from models.weights import abstract_model, load_model
from tests.conftest import SMALL_ENGINE
from tests.lora.adapters import GOLDEN, SPECS, write_adapter
from tests.models.quantization import checkpoints as ckpt
from tests.models.quantization.quality import greedy, make_runner

PROMPTS = [[1, 17, 29, 3, 77, 101, 5, 64], [1, 90, 12, 7]]


@pytest.fixture(scope="module")
def gptq_dirs(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("gptq")
    tiny = ckpt.tiny_llama(str(root / "float"))
    quantize, config = ckpt.gptq_quantizer(4, 32, desc_act=True, sym=False)
    return ckpt.quantize_checkpoint(tiny, str(root / "q"), str(root / "ref"), quantize, config)


def test_quantization_resolves_once_and_refuses_a_mismatch(gptq_dirs, stories_dir):
    quant_dir, ref_dir = gptq_dirs
    auto = EngineArgs(model=quant_dir).create_engine_config().model_config
    assert auto.quantization is None and auto.quant_config.method == "gptq"
    assert auto.quant_config.desc_act
    with pytest.raises(ValueError, match=r"quantization='awq' does not match .*'gptq'"):
        EngineArgs(model=quant_dir, quantization="awq").create_engine_config()
    with pytest.raises(ValueError, match="needs a checkpoint quantized by its tool"):
        EngineArgs(model=ref_dir, quantization="gptq").create_engine_config()
    with pytest.raises(ValueError, match="load_format='bitsandbytes' needs quantization"):
        EngineArgs(load_format="bitsandbytes").create_engine_config()
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineArgs(quantization="int3").create_engine_config()
    online = EngineArgs(quantization="fp8").create_engine_config().model_config.quant_config
    assert online.method == "fp8" and not online.is_checkpoint_fp8_serialized


def test_families_without_quantized_layers_refuse_by_name():
    fp8 = resolve_quantization("fp8", None)
    gpt2 = types.SimpleNamespace(vocab_size=8)
    with pytest.raises(ValueError, match="not supported for the GPT2LMHeadModel family"):
        abstract_model(GPT2LMHeadModel, gpt2, np.float32, attention_backend="reference",
                       interpret=False, seed=0, quant_config=fp8)  # fmt: skip
    import transformers

    mixtral = transformers.MixtralConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
    )  # fmt: skip
    with pytest.raises(ValueError, match="not supported for the Mixtral family"):
        abstract_model(LlamaForCausalLM, mixtral, np.float32, attention_backend="reference",
                       interpret=False, seed=0, quant_config=fp8)  # fmt: skip


def test_engine_serves_a_gptq_checkpoint_like_its_dequantized_twin(gptq_dirs, caplog):
    quant_dir, ref_dir = gptq_dirs
    with caplog.at_level(logging.INFO, logger="jaxpaged.worker.worker"):
        llm = LLM(model=quant_dir, dtype="float32", skip_tokenizer_init=True, **SMALL_ENGINE)
    # The start-up report: the quantized weights' bytes and the KV blocks they free.
    report = next(r.getMessage() for r in caplog.records if "KV cache" in r.getMessage())
    assert "quantization gptq" in report and "KV blocks" in report, report
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    reference = greedy(make_runner(*load_model(ref_dir, dtype="float32"), 32, 2), PROMPTS, 6)
    for out, ref, prompt in zip(outputs, reference, PROMPTS, strict=True):
        assert list(out.outputs[0].token_ids) == ref.tokens[len(prompt) :] + [ref.next_token]


def test_a_converted_gptq_checkpoint_keeps_gptq_and_serves_the_same_tokens(gptq_dirs, tmp_path):
    from jaxpaged.entrypoints.convert import convert

    quant_dir, _ = gptq_dirs
    out = str(tmp_path / "orbax")
    meta = convert(quant_dir, out, dtype="float32")  # the method is detected and kept
    assert meta["quantization"] == "gptq" and meta["quantized_layers"]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    tokens = []
    for model in (quant_dir, out):
        llm = LLM(model=model, dtype="float32", skip_tokenizer_init=True, **SMALL_ENGINE)
        assert llm.llm_engine.config.model_config.quant_config.method == "gptq"
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tokens.append([list(o.outputs[0].token_ids) for o in outputs])
    assert tokens[0] == tokens[1]


def test_lora_applies_on_a_quantized_base(stories_dir, tmp_path):
    """bitsandbytes 8-bit base (weight-only, |dW| <= absmax/254 per row) with the LoRA test
    adapters: the adapter changes the output as it does on the float base (HF + peft golden),
    up to the quantized base's own drift (measured: every golden token equal)."""
    import json

    golden = json.loads(GOLDEN.read_text())
    llm = LLM(quantization="bitsandbytes", load_format="bitsandbytes", dtype="float32",
              enable_lora=True, max_loras=1, max_lora_rank=16, **SMALL_ENGINE)  # fmt: skip
    spec = SPECS[1]  # all seven projections, rank 8
    request = LoRARequest(spec.name, 1, write_adapter(stories_dir, tmp_path / spec.name, spec))
    params = SamplingParams(temperature=0.0, max_tokens=golden["max_tokens"], ignore_eos=True)
    prompt = {"prompt_token_ids": golden["prompts"][0]}
    (with_lora,) = llm.generate([prompt], params, lora_request=request, use_tqdm=False)
    assert list(with_lora.outputs[0].token_ids) == golden[spec.name][0]
    assert golden[spec.name][0] != golden["base"][0]
    # A quantized kernel takes no float columns: the slots keep the dense layout.
    slot_weights = llm.llm_engine.lora_manager.slots.weights
    assert not any(w.base_columns for layer in slot_weights for w in layer.values())
