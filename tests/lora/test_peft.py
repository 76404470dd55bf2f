"""PEFT adapter loading: scaling, layout, and refusals naming what is wrong."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import safetensors.numpy

from jaxpaged.lora.dummy import write_random_peft_adapter
from jaxpaged.lora.peft import load_peft_adapter
from jaxpaged.lora.request import LoRARequest
from models.lora import ProjectionSpec

SPECS = {
    "qkv_proj": ProjectionSpec(8, (8, 4, 4)),
    "o_proj": ProjectionSpec(8, (8,)),
    "gate_up_proj": ProjectionSpec(8, (12, 12)),
    "down_proj": ProjectionSpec(12, (8,)),
}


def _write(path, **kwargs):
    args = dict(specs=SPECS, num_layers=2, rank=4, lora_alpha=8.0, target_modules=["q_proj"])
    return write_random_peft_adapter(str(path), **{**args, **kwargs})


def _load(path, max_lora_rank=16):
    return load_peft_adapter(str(path), specs=SPECS, num_layers=2, max_lora_rank=max_lora_rank)


@pytest.mark.parametrize("use_rslora", [False, True])
def test_b_is_transposed_and_scaled_by_alpha_over_r_or_sqrt_r(tmp_path, use_rslora):
    _write(tmp_path, target_modules=["q_proj", "down_proj"], use_rslora=use_rslora)
    adapter = _load(tmp_path)
    scaling = 8.0 / math.sqrt(4) if use_rslora else 8.0 / 4
    assert adapter.scaling == scaling
    tensors = safetensors.numpy.load_file(os.path.join(tmp_path, "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.1.mlp.down_proj"
    a, b = adapter.weights[(1, "down_proj")]
    np.testing.assert_array_equal(a, tensors[f"{prefix}.lora_A.weight"].T)
    np.testing.assert_allclose(b, tensors[f"{prefix}.lora_B.weight"].T * scaling, rtol=1e-6)
    assert adapter.target_modules == {"q_proj", "down_proj"}


def test_rank_above_max_lora_rank_is_refused(tmp_path):
    _write(tmp_path, rank=16)
    with pytest.raises(ValueError, match="LoRA rank 16 is greater than max_lora_rank 8"):
        _load(tmp_path, max_lora_rank=8)


def test_unknown_target_module_is_refused_by_name(tmp_path):
    _write(tmp_path)
    config_path = tmp_path / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["target_modules"] = ["q_proj", "lm_head"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"target_modules \['lm_head'\] are not supported"):
        _load(tmp_path)


def test_unknown_tensor_is_refused_by_name(tmp_path):
    _write(tmp_path)
    weights = tmp_path / "adapter_model.safetensors"
    tensors = safetensors.numpy.load_file(str(weights))
    tensors["base_model.model.lm_head.lora_A.weight"] = np.zeros((4, 8), np.float32)
    safetensors.numpy.save_file(tensors, str(weights))
    with pytest.raises(ValueError, match="lm_head.lora_A.weight"):
        _load(tmp_path)


def test_wrong_shape_names_the_tensor(tmp_path):
    _write(tmp_path)
    other = {**SPECS, "qkv_proj": ProjectionSpec(16, (8, 4, 4))}
    with pytest.raises(ValueError, match=r"q_proj.lora_A.weight' has shape \(4, 8\), expected"):
        load_peft_adapter(str(tmp_path), specs=other, num_layers=2, max_lora_rank=16)


@pytest.mark.parametrize(
    ("key", "value"), [("use_dora", True), ("bias", "all"), ("modules_to_save", ["lm_head"])]
)
def test_unsupported_options_are_refused_by_name(tmp_path, key, value):
    _write(tmp_path)
    config_path = tmp_path / "adapter_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), key: value}))
    with pytest.raises(ValueError, match=f"{key}=.* is not supported"):
        _load(tmp_path)


def test_bad_path_is_refused(tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        _load(tmp_path / "missing")
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        _load(tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(lora_name="a", lora_int_id=0, lora_path="/x"), "lora_int_id must be > 0, got 0"),
        (dict(lora_name="", lora_int_id=1, lora_path="/x"), "lora_name must be"),
        (dict(lora_name="a", lora_int_id=1, lora_path=""), "lora_path must name"),
    ],
)
def test_lora_request_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoRARequest(**kwargs)


def test_lora_requests_compare_by_name_as_in_vllm():
    assert LoRARequest("a", 1, "/x") == LoRARequest("a", 2, "/y")
    assert len({LoRARequest("a", 1, "/x"), LoRARequest("b", 1, "/x")}) == 2


def test_a_corrupt_config_or_weights_file_is_refused_naming_the_path(tmp_path):
    _write(tmp_path / "a")
    (tmp_path / "a" / "adapter_config.json").write_text("not json")
    with pytest.raises(ValueError, match="adapter_config.json is not valid JSON"):
        _load(tmp_path / "a")
    _write(tmp_path / "b")
    (tmp_path / "b" / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="adapter_model.safetensors is unreadable"):
        _load(tmp_path / "b")
