"""models.registry: HF architecture names -> model classes."""

from __future__ import annotations

import types

import pytest

from models.llama import LlamaForCausalLM
from models.registry import get_model_class, supported_architectures


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"])
def test_supported_architectures_map_to_the_llama_family(arch):
    assert get_model_class(types.SimpleNamespace(architectures=[arch])) is LlamaForCausalLM


def test_unsupported_architecture_is_named_with_the_supported_list():
    config = types.SimpleNamespace(architectures=["FalconForCausalLM"])
    with pytest.raises(ValueError, match="FalconForCausalLM.*LlamaForCausalLM") as info:
        get_model_class(config)
    for arch in supported_architectures():
        assert arch in str(info.value)


@pytest.mark.parametrize("architectures", [None, []])
def test_config_without_architectures_raises(architectures):
    with pytest.raises(ValueError, match="architectures"):
        get_model_class(types.SimpleNamespace(architectures=architectures))


def test_gpt2_and_bloom_map_to_their_classes_with_checkpoint_views():
    from models.gpt2 import BloomForCausalLM, GPT2LMHeadModel
    from models.registry import checkpoint_view

    for arch, cls in (("GPT2LMHeadModel", GPT2LMHeadModel), ("BloomForCausalLM", BloomForCausalLM)):
        config = types.SimpleNamespace(architectures=[arch])
        assert get_model_class(config) is cls
        assert checkpoint_view(config) is not None
    assert checkpoint_view(types.SimpleNamespace(architectures=["LlamaForCausalLM"])) is None
