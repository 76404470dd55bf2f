"""``models.linear_backends.step_compiler_options``: the XLA options step executables compile
with (8-bit GEMMs on cuBLASLt on a GPU; XLA's defaults otherwise)."""

from __future__ import annotations

import json
import os

import pytest

from models.linear_backends import runs_8bit_gemms, step_compiler_options
from models.quantization.config import resolve_quantization

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "configs")


def _checkpoint_config(name):
    with open(os.path.join(CONFIGS, name, "config.json")) as f:
        return resolve_quantization(None, json.load(f)["quantization_config"], "auto")


OFF = {"xla_gpu_enable_triton_gemm": False}


@pytest.mark.parametrize(
    "config,expected",
    [
        (lambda: resolve_quantization("fp8", None, "auto"), OFF),
        (lambda: _checkpoint_config("llama-3-8b-w8a8-int8"), OFF),
        (lambda: _checkpoint_config("llama-3-8b-awq"), {}),  # 4-bit: Triton fuses the unpack
        (lambda: _checkpoint_config("llama-3-8b-gptq"), {}),
        (lambda: None, {}),  # bf16
    ],
)
def test_8bit_gemm_models_compile_without_triton_gemms_on_gpu(config, expected):
    config = config()
    assert runs_8bit_gemms(config) == bool(expected)
    assert step_compiler_options(config, "gpu") == expected
    assert step_compiler_options(config, "cpu") == {}


def test_forced_choices_and_a_bad_one():
    fp8 = resolve_quantization("fp8", None, "auto")
    assert step_compiler_options(fp8, "gpu", "on") == {}
    assert step_compiler_options(None, "gpu", "off") == OFF
    with pytest.raises(ValueError, match="triton_gemm must be one of"):
        step_compiler_options(None, "gpu", "maybe")
