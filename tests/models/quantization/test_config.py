"""quantization_config parsing, auto-detection from quant_method and the flag check."""

from __future__ import annotations

import pytest

from models.quantization.config import (
    AWQConfig,
    BitsAndBytesConfig,
    CompressedTensorsConfig,
    Fp8Config,
    GPTQConfig,
    resolve_quantization,
)

# As the tools write them into config.json.
AWQ = {
    "quant_method": "awq",
    "bits": 4,
    "group_size": 128,
    "zero_point": True,
    "version": "gemm",
    "modules_to_not_convert": None,
}
GPTQ = {
    "quant_method": "gptq",
    "bits": 4,
    "group_size": 128,
    "desc_act": True,
    "sym": True,
    "damp_percent": 0.01,
    "checkpoint_format": "gptq",
}
W8A8_INT8 = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "quantization_status": "compressed",
    "ignore": ["lm_head", "re:.*gate$"],
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 8,
                "type": "int",
                "symmetric": True,
                "strategy": "channel",
                "dynamic": False,
            },
            "input_activations": {
                "num_bits": 8,
                "type": "int",
                "symmetric": True,
                "strategy": "token",
                "dynamic": True,
            },
        }
    },
}
FP8 = {"quant_method": "fp8", "activation_scheme": "static"}
BNB = {"quant_method": "bitsandbytes", "load_in_8bit": True, "llm_int8_threshold": 6.0}


def test_auto_detects_each_method_from_quant_method():
    awq = resolve_quantization(None, AWQ)
    assert awq == AWQConfig(weight_bits=4, group_size=128, zero_point=True)
    gptq = resolve_quantization(None, GPTQ)
    assert isinstance(gptq, GPTQConfig) and gptq.desc_act and gptq.weight_bits == 4
    ct = resolve_quantization(None, W8A8_INT8)
    assert isinstance(ct, CompressedTensorsConfig)
    fp8 = resolve_quantization(None, FP8)
    assert fp8 == Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="static")
    bnb = resolve_quantization(None, BNB, load_format="bitsandbytes")
    assert bnb == BitsAndBytesConfig(is_prequantized=True)
    assert resolve_quantization(None, None) is None


def test_flag_equal_to_checkpoint_method_is_accepted():
    assert resolve_quantization("awq", AWQ).method == "awq"
    assert (
        resolve_quantization(
            "compressed-tensors", dict(W8A8_INT8, quant_method="compressed_tensors")
        ).method
        == "compressed-tensors"
    )


def test_flag_checkpoint_mismatch_names_both():
    with pytest.raises(
        ValueError, match=r"quantization='gptq' does not match .*quant_method 'awq'"
    ):
        resolve_quantization("gptq", AWQ)


def test_unknown_methods_are_refused():
    with pytest.raises(ValueError, match=r"quantization must be one of awq, gptq, .*'int4'"):
        resolve_quantization("int4", None)
    with pytest.raises(ValueError, match=r"quant_method 'hqq' is not supported"):
        resolve_quantization(None, {"quant_method": "hqq"})
    with pytest.raises(ValueError, match="missing the field quant_method"):
        resolve_quantization(None, {"bits": 4})


def test_online_methods_and_tool_methods_on_an_unquantized_checkpoint():
    assert resolve_quantization("fp8", None) == Fp8Config(False, "dynamic")
    assert resolve_quantization("bitsandbytes", None, "bitsandbytes") == BitsAndBytesConfig(False)
    assert resolve_quantization("bitsandbytes", None, "dummy") == BitsAndBytesConfig(False)
    with pytest.raises(ValueError, match=r"quantization='awq' needs a checkpoint quantized"):
        resolve_quantization("awq", None)
    with pytest.raises(ValueError, match="load_format='bitsandbytes' go together"):
        resolve_quantization("bitsandbytes", None, "auto")
    with pytest.raises(ValueError, match="load_format='bitsandbytes' needs quantization"):
        resolve_quantization(None, None, "bitsandbytes")


@pytest.mark.parametrize(
    "config,match",
    [
        (dict(AWQ, bits=3), r"bits must be 4 for awq .* got 3"),
        (dict(GPTQ, bits=3), r"bits must be 4 or 8 for gptq, got 3"),
        (dict(AWQ, version="gemv"), r"version must be 'gemm'"),
        (dict(AWQ, zero_point=False), r"zero_point must be true"),
        (dict(GPTQ, group_size=0), r"group_size must be -1 .* got 0"),
        (dict(GPTQ, checkpoint_format="marlin"), r"checkpoint_format must be"),
        (dict(GPTQ, lm_head=True), r"lm_head=true \(a quantized lm_head\) is not supported"),
        ({"quant_method": "gptq", "group_size": 128}, r"missing the field bits"),
        (dict(FP8, weight_block_size=[128, 128]), r"weight_block_size .* not supported"),
        (dict(FP8, activation_scheme="sometimes"), r"activation_scheme must be"),
        (dict(BNB, load_in_8bit=False, load_in_4bit=True), r"load_in_4bit is not supported"),
    ],
)
def test_bad_fields_are_named(config, match):
    load_format = "bitsandbytes" if config["quant_method"] == "bitsandbytes" else "auto"
    with pytest.raises(ValueError, match=match):
        resolve_quantization(None, config, load_format)


def test_gptq_8bit_and_group_minus_one():
    config = resolve_quantization(None, dict(GPTQ, bits=8, group_size=-1, desc_act=False))
    assert (config.weight_bits, config.group_size, config.desc_act) == (8, -1, False)
    assert config.is_skipped("lm_head") and not config.is_skipped("model.layers.0.mlp.up_proj")


def test_compressed_tensors_scheme_resolution_and_ignore_list():
    config = resolve_quantization(None, W8A8_INT8)
    scheme = config.scheme_for("model.layers.0.self_attn.q_proj")
    assert scheme.kind == "w8a8_int8" and scheme.input_activations.strategy == "token"
    assert config.scheme_for("lm_head") is None
    assert config.scheme_for("model.layers.3.mlp.gate") is None  # re: pattern in ignore
    targeted = dict(
        W8A8_INT8,
        config_groups={
            "g": dict(W8A8_INT8["config_groups"]["group_0"], targets=["re:.*down_proj"])
        },
    )
    config = resolve_quantization(None, targeted)
    assert config.scheme_for("model.layers.0.mlp.down_proj") is not None
    assert config.scheme_for("model.layers.0.mlp.up_proj") is None


def _group(weights, inputs=None):
    return {
        "quant_method": "compressed-tensors",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs}
        },
    }


@pytest.mark.parametrize(
    "weights,inputs,kind",
    [
        ({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}, None, "wna16"),
        ({"num_bits": 8, "type": "int", "strategy": "channel"}, None, "wna16"),
        (
            {"num_bits": 8, "type": "float", "strategy": "tensor"},
            {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False},
            "w8a8_fp8",
        ),
        (
            {"num_bits": 8, "type": "float", "strategy": "channel"},
            {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
            "w8a8_fp8",
        ),
    ],
)
def test_compressed_tensors_scheme_kinds(weights, inputs, kind):
    config = resolve_quantization(None, _group(weights, inputs))
    assert config.scheme_for("x").kind == kind


@pytest.mark.parametrize(
    "weights,inputs,match",
    [
        (
            {"num_bits": 3, "type": "int", "strategy": "group", "group_size": 128},
            None,
            r"group_0\.weights\.num_bits must be 4 or 8, got 3",
        ),
        (
            {"num_bits": 4, "type": "int", "strategy": "group"},
            None,
            r"group_0\.weights\.group_size must be a positive integer",
        ),
        (
            {"num_bits": 8, "type": "int", "strategy": "channel"},
            {
                "num_bits": 8,
                "type": "int",
                "strategy": "token",
                "dynamic": True,
                "symmetric": False,
            },
            r"W8A8 needs symmetric",
        ),
        (
            {"num_bits": 8, "type": "int", "strategy": "channel"},
            {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
            r"input_activations\.type must equal weights\.type",
        ),
        (
            {"num_bits": 8, "type": "int", "strategy": "channel"},
            {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": False},
            r"strategy must be 'tensor' for static scales",
        ),
        (
            {"num_bits": 4, "type": "nf", "strategy": "group", "group_size": 64},
            None,
            r"weights\.type must be 'int' or 'float'",
        ),
    ],
)
def test_compressed_tensors_unsupported_schemes_are_named(weights, inputs, match):
    with pytest.raises(ValueError, match=match):
        resolve_quantization(None, _group(weights, inputs))


@pytest.mark.parametrize(
    "change,match",
    [
        ({"format": "marlin-24"}, r"quantization_config\.format must be one of pack-quantized"),
        ({"sparsity_config": {"format": "sparse-24-bitmask"}}, r"sparsity_config .* not supported"),
    ],
)
def test_compressed_tensors_formats_we_cannot_read_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        resolve_quantization(None, dict(W8A8_INT8, **change))


def test_compressed_tensors_kv_cache_scheme():
    fp8_kv = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    config = resolve_quantization(None, dict(W8A8_INT8, kv_cache_scheme=fp8_kv))
    assert config.kv_cache_scheme.type == "float"
    assert resolve_quantization(None, W8A8_INT8).kv_cache_scheme is None
    with pytest.raises(ValueError, match=r"kv_cache_scheme must be 8-bit float .* 'int'"):
        resolve_quantization(None, dict(W8A8_INT8, kv_cache_scheme=dict(fp8_kv, type="int")))
