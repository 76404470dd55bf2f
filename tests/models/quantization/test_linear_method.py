"""get_linear_method: one object per layer dispatches loading, splitting and the matmul."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.quantization.awq import awq_linear
from models.quantization.config import (
    AWQConfig,
    BitsAndBytesConfig,
    Fp8Config,
    GPTQConfig,
    resolve_quantization,
)
from models.quantization.linear_method import get_linear_method

DATA = pathlib.Path(__file__).resolve().parents[2] / "data" / "quantization"
LAYER = "model.layers.0.mlp.up_proj"


def test_awq_layer_loads_as_stored_and_applies_the_awq_matmul():
    d = np.load(DATA / "awq_gemm.npz")
    stored = {k: d[f"g32_{k}"] for k in ("qweight", "qzeros", "scales")}
    method = get_linear_method(AWQConfig(4, 32, True), LAYER)
    assert method.method == "awq"
    assert method.tensor_specs(128, 32)["qweight"].shape == (128, 4)
    params = {k: jnp.asarray(v) for k, v in method.load(LAYER, stored, 128, 32).items()}
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 128)), jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(method.apply(x, params)), np.asarray(awq_linear(x, *params.values()))
    )
    assert method.split_axis("qweight", "column", (128, 4)) == 1
    assert method.split_axis("scales", "row", (4, 32)) == 0


def test_act_order_changes_the_row_split_of_group_tensors():
    method = get_linear_method(GPTQConfig(4, 32, desc_act=True, sym=True), LAYER)
    assert method.split_axis("scales", "row", (4, 64)) is None
    assert method.split_axis("g_idx", "row", (128,)) == 0
    method = get_linear_method(GPTQConfig(4, 32, desc_act=False, sym=True), LAYER)
    assert method.split_axis("scales", "row", (4, 64)) == 0


def test_unquantized_layers_get_no_method():
    assert get_linear_method(None, LAYER) is None
    assert get_linear_method(GPTQConfig(4, 32, False, True), "lm_head") is None
    awq = AWQConfig(4, 32, True, modules_to_not_convert=("mlp.up_proj",))
    assert get_linear_method(awq, LAYER) is None
    ct = resolve_quantization(
        None,
        {
            "quant_method": "compressed-tensors",
            "ignore": [LAYER],
            "config_groups": {
                "g": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 4, "strategy": "group", "group_size": 32},
                }
            },
        },
    )
    assert get_linear_method(ct, LAYER) is None
    assert get_linear_method(ct, "model.layers.0.mlp.down_proj").scheme.kind == "wna16"


@pytest.mark.parametrize(
    "config,stored_dtype",
    [(Fp8Config(False, "dynamic"), "float8_e4m3fn"), (BitsAndBytesConfig(False), "int8")],
    ids=["fp8", "bitsandbytes"],
)
def test_online_methods_read_the_float_weight_and_keep_only_the_quantized_one(config, stored_dtype):
    method = get_linear_method(config, LAYER)
    assert method.tensor_specs(64, 32)["weight"].dtypes == ("float16", "bfloat16", "float32")
    weight = np.random.default_rng(1).standard_normal((32, 64)).astype(np.float32)
    params = method.load(LAYER, {"weight": weight}, 64, 32)
    assert str(params["weight"].dtype) == stored_dtype
    x = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    y = np.asarray(method.apply(jnp.asarray(x), {k: jnp.asarray(v) for k, v in params.items()}))
    exact = x @ weight.T
    # 8-bit weights (and FP8 activations): a few percent of the output's scale at most.
    assert np.abs(y - exact).max() <= 0.1 * np.abs(exact).max()
    with pytest.raises(ValueError, match=rf"{LAYER}\.weight is missing"):
        method.load(LAYER, {}, 64, 32)


def test_int4_dequantization_is_shifts_and_masks_into_one_dot():
    """The lowered AWQ and GPTQ linears: the packed words reach the single dot only through
    elementwise ops (shift, mask, subtract, convert, multiply) and reshapes; no gather, so XLA
    can fuse the dequantization into the dot's operand."""
    d = np.load(DATA / "awq_gemm.npz")
    stored = {k: d[f"g32_{k}"] for k in ("qweight", "qzeros", "scales")}
    x = jnp.zeros((4, 128), jnp.bfloat16)
    for config in (AWQConfig(4, 32, True), GPTQConfig(4, 32, desc_act=False, sym=True)):
        method = get_linear_method(config, LAYER)
        if config.method == "gptq":
            stored = {
                "qweight": np.zeros((16, 32), np.int32),
                "qzeros": np.zeros((4, 4), np.int32),
                "scales": np.ones((4, 32), np.float16),
            }
        params = {k: jnp.asarray(v) for k, v in method.load(LAYER, stored, 128, 32).items()}
        text = jax.jit(method.apply).lower(x, params).as_text()
        ops = {line.split("=")[1].split()[0] for line in text.splitlines() if " = " in line}
        assert sum("dot_general" in line for line in text.splitlines()) == 1
        assert "stablehlo.shift_right_arithmetic" in ops and "stablehlo.and" in ops
        assert not any("gather" in op for op in ops), ops
