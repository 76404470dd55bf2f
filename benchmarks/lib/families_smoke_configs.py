"""Tiny config.json files of the four families (for ``SMOKE=1 bash benchmarks/families.sh`` on CPU), written
under the directory names of benchmarks/configs/."""

import json
import os
import sys

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rms_norm_eps=1e-5, torch_dtype="bfloat16")  # fmt: skip
FAMILIES = {
    "qwen3-8b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=16),
    "phi-3-mini-4k-instruct": dict(
        architectures=["Phi3ForCausalLM"],
        model_type="phi3",
        sliding_window=8,
        pad_token_id=0,
        eos_token_id=2,
    ),
    "gemma-2-9b": dict(
        architectures=["Gemma2ForCausalLM"],
        model_type="gemma2",
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=8,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        hidden_activation="gelu_pytorch_tanh",
    ),  # fmt: skip
    "mixtral-8x7b-instruct-v0.1": dict(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        num_local_experts=4,
        num_experts_per_tok=2,
    ),  # fmt: skip
}

for name, spec in FAMILIES.items():
    os.makedirs(os.path.join(sys.argv[1], name), exist_ok=True)
    with open(os.path.join(sys.argv[1], name, "config.json"), "w") as f:
        json.dump({**TINY, **spec}, f, indent=1)
