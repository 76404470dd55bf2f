"""Whole quantized checkpoints through the loaders and the Llama model (wiring).

Weight-only formats must give the greedy tokens of the same model with the dequantized weights
in float32 (``checkpoints.py`` builds both; logits within 1e-4 relative, float32 summation order
only). Activation-quantized formats are held to a stated agreement bound (see
``test_activation_quantized_formats_stay_within_their_bound``).
"""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np
import pytest
from flax import nnx

from models.quantization.config import resolve_quantization
from models.quantized_linear import QuantizedLinear, QuantizedWeight
from models.weights import load_model
from tests.models.conftest import relative_diff
from tests.models.quantization import checkpoints as ckpt
from tests.models.quantization.quality import compare, greedy, make_runner, stories260k_quality

PROMPTS = [[1, 17, 29, 3, 77, 101, 5, 64, 9, 33, 120, 2, 45], [1, 90, 12, 7]]
NUM_NEW = 6
RTOL = 1e-4


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return ckpt.tiny_llama(str(tmp_path_factory.mktemp("tiny") / "float"))


def _greedy(model_and_config):
    return greedy(make_runner(*model_and_config, 32, len(PROMPTS)), PROMPTS, NUM_NEW)


def _build(kind: str, tiny_dir: str, tmp_path) -> tuple[str, str, dict]:
    """(model dir, float32 reference dir, load_model kwargs) for a weight-only format."""
    out, ref = str(tmp_path / "quant"), str(tmp_path / "ref")
    if kind == "awq":
        return (*ckpt.awq_checkpoint(out, ref), {})
    if kind == "bnb":  # 8-bit at load of the float checkpoint; reference: its dequantization
        from models.quantization.bitsandbytes import (
            bitsandbytes_dequantize,
            quantize_weight_int8_rowwise,
        )

        def quantize(prefix, key, w):
            q = quantize_weight_int8_rowwise(w)
            return {}, np.asarray(bitsandbytes_dequantize(q["weight"], q["SCB"]))

        ckpt.quantize_checkpoint(tiny_dir, str(tmp_path / "unused"), ref, quantize, None)
        config = resolve_quantization("bitsandbytes", None, "bitsandbytes")
        return tiny_dir, ref, dict(load_format="bitsandbytes", quant_config=config)
    if kind in GPTQ:
        quantize, config = ckpt.gptq_quantizer(*GPTQ[kind])
    else:  # compressed-tensors W4A16, pack-quantized, groups of 32
        quantize, config = ckpt.compressed_tensors_quantizer(
            dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
            None, "pack-quantized",
        )  # fmt: skip
    return (*ckpt.quantize_checkpoint(tiny_dir, out, ref, quantize, config), {})


# GPTQ: bits, group_size, desc_act, sym.
GPTQ = {"gptq4-g32": (4, 32, False, False), "gptq4-g32-desc": (4, 32, True, False),
        "gptq8-gall": (8, -1, False, True)}  # fmt: skip
WEIGHT_ONLY = ["awq", *GPTQ, "ct-w4a16", "bnb"]


@pytest.mark.parametrize("kind", WEIGHT_ONLY)
def test_weight_only_greedy_equals_dequantized_float32(kind, tiny_dir, tmp_path):
    model_dir, ref_dir, kwargs = _build(kind, tiny_dir, tmp_path)
    quantized = load_model(model_dir, dtype="float32", **kwargs)
    # The weights stay quantized on the device; lm_head and embeddings stay float.
    layers = [n for _, n in nnx.iter_graph(quantized[0]) if isinstance(n, QuantizedLinear)]
    assert len(layers) == 4 * ckpt.TINY_LLAMA["num_hidden_layers"]
    stored = {str(v.get_value().dtype) for _, v in nnx.to_flat_state(
        nnx.state(quantized[0], QuantizedWeight))}  # fmt: skip
    assert stored & {"int32", "int8"}, stored
    assert quantized[0].lm_head.kernel[...].dtype == np.float32
    ours, ref = _greedy(quantized), _greedy(load_model(ref_dir, dtype="float32"))
    for a, b in zip(ours, ref, strict=True):
        assert a.tokens + [a.next_token] == b.tokens + [b.next_token]
        assert relative_diff(np.stack(a.logits), np.stack(b.logits)) < RTOL


def test_fused_parts_sorted_act_order_and_device_dtypes(tiny_dir, tmp_path):
    """GPTQ desc_act: q/k/v fused with their shared g_idx and sorted (``perm``), int32 words."""
    model_dir, _, _ = _build("gptq4-g32-desc", tiny_dir, tmp_path)
    model, _ = load_model(model_dir, dtype="float32")
    qkv = model.model.layers[0].self_attn.qkv_proj.tensors()
    assert set(qkv) == {"qweight", "qzeros", "scales", "perm"}
    assert qkv["qweight"].dtype == np.int32 and qkv["qweight"].shape == (64 // 8, 64 + 2 * 32)


# Activation-quantized formats against the same model with the dequantized weights in float32
# (online FP8: against the float model, its weights are rounded too). The difference is the
# 8-bit rounding of the activations (and of online FP8's weights): INT8 per token steps by
# amax/127 (|dx| <= amax/254), e4m3 by 2^-4 relative (half an ulp of 3 mantissa bits), 8x
# coarser for the typical element. Measured on this random tiny model over 12 positions
# (prompt logprob drift of the float model's greedy tokens): INT8 mean |dlogprob| 0.013, 11 of
# 12 top-1 equal; FP8 0.060-0.067, 10 of 12. The bounds sit ~2x above the drift and allow one
# more flip: INT8 <= 0.03 and agreement >= 0.8, FP8 <= 0.15 and >= 0.75. A random 128-token
# vocabulary has near ties, so free-running greedy sequences are reported, not required equal.
BOUNDS = {"ct-w8a8-int8": (0.8, 0.03), "ct-w8a8-fp8": (0.75, 0.15), "fp8-online": (0.75, 0.15)}
ACTIVATION = {
    "ct-w8a8-int8": (dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
                     dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True),
                     "int-quantized"),
    "ct-w8a8-fp8": (dict(num_bits=8, type="float", symmetric=True, strategy="tensor"),
                    dict(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True),
                    "float-quantized"),
}  # fmt: skip


# (INT8 W8A8 and online FP8 on real weights: the stories260k test below.)
@pytest.mark.parametrize("kind", [*ACTIVATION, "fp8-online"])
def test_activation_quantized_formats_stay_within_their_bound(kind, tiny_dir, tmp_path):
    if kind == "fp8-online":
        quantized = load_model(tiny_dir, dtype="float32",
                               quant_config=resolve_quantization("fp8", None))  # fmt: skip
        ref_dir = tiny_dir  # online FP8 also rounds the weights: compared with the float model
    else:
        quantize, config = ckpt.compressed_tensors_quantizer(*ACTIVATION[kind])
        model_dir, ref_dir = ckpt.quantize_checkpoint(
            tiny_dir, str(tmp_path / "q"), str(tmp_path / "ref"), quantize, config
        )
        quantized = load_model(model_dir, dtype="float32")
    quality = compare(load_model(ref_dir, dtype="float32"), quantized, PROMPTS, NUM_NEW)
    print(f"\n{kind}: {quality}")
    min_agreement, max_dlogprob = BOUNDS[kind]
    assert quality.teacher_forced_agreement >= min_agreement
    assert quality.mean_abs_dlogprob <= max_dlogprob


# stories260k on golden.json's prompts, 16 new tokens (docs/quantization.md has the 32-token
# table; measured here: fp8 agreement 0.9625, mean |dlogprob| 0.044; int8 1.0, 0.0098).
# Bounds: ~2x the measured drift, one more flip in 80 positions for fp8.
@pytest.mark.parametrize(
    "method,min_agreement,max_dlogprob", [("fp8", 0.95, 0.1), ("int8", 0.98, 0.025)]
)
def test_stories260k_fp8_and_int8_quality_against_float32(method, min_agreement, max_dlogprob):
    pytest.importorskip("compressed_tensors")
    quality = stories260k_quality(method, num_new=16)
    print(f"\nstories260k {method}: {quality}")
    assert quality.teacher_forced_agreement >= min_agreement
    assert quality.mean_abs_dlogprob <= max_dlogprob


# ------------------------------------------------------------------------- bad checkpoints


def _edit(model_dir: str, tmp_path, *, drop=(), replace=None, config=None) -> str:
    tensors = {k: v for k, v in ckpt.read_tensors(model_dir).items() if k not in drop}
    tensors.update(replace or {})
    with open(os.path.join(model_dir, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    return ckpt.write_checkpoint(str(tmp_path / "bad"), model_dir, tensors, config or qc)


@pytest.mark.parametrize("case,match", [
    ("missing_scales", r"model\.layers\.1\.mlp\.down_proj\.scales is missing"),
    ("wrong_qweight", r"model\.layers\.0\.self_attn\.k_proj\.qweight has shape \(8, 16\)"),
    ("bits_3", r"quantization_config\.bits must be 4 or 8 for gptq, got 3"),
    ("unknown_method", r"quant_method 'hqq' is not supported"),
])  # fmt: skip
def test_bad_checkpoints_fail_by_name_before_any_weight_reaches_the_device(
    case, match, tiny_dir, tmp_path, monkeypatch
):
    model_dir, _, _ = _build("gptq4-g32", tiny_dir, tmp_path)
    qc = json.load(open(os.path.join(model_dir, "config.json")))["quantization_config"]
    kwargs = {
        "missing_scales": dict(drop=("model.layers.1.mlp.down_proj.scales",)),
        "wrong_qweight": dict(replace={"model.layers.0.self_attn.k_proj.qweight":
                                       np.zeros((8, 16), np.int32)}),
        "bits_3": dict(config={**qc, "bits": 3}),
        "unknown_method": dict(config={**qc, "quant_method": "hqq"}),
    }[case]  # fmt: skip
    bad = _edit(model_dir, tmp_path, **kwargs)

    def no_transfer(*args, **kw):
        raise AssertionError("weights were placed on the device before the checks finished")

    import models.weights

    monkeypatch.setattr(models.weights, "_load_state", no_transfer)
    monkeypatch.setattr(models.weights, "place_quantized_layers", no_transfer)
    with pytest.raises(ValueError, match=match):
        load_model(bad, dtype="float32")


def test_dummy_online_methods_draw_float_weights_and_quantize_them(tiny_dir):
    fp8, _ = load_model(tiny_dir, load_format="dummy", dtype="float32",
                        quant_config=resolve_quantization("fp8", None, "dummy"))  # fmt: skip
    down = fp8.model.layers[1].mlp.down_proj.tensors()
    assert down["weight"].dtype == np.dtype("float8_e4m3fn") and down["weight_scale"].shape == (1,)


def _checkpoint_of(kind: str, tiny_dir: str, tmp_path) -> str:
    if kind in ACTIVATION:
        quantize, config = ckpt.compressed_tensors_quantizer(*ACTIVATION[kind])
        return ckpt.quantize_checkpoint(
            tiny_dir, str(tmp_path / "q"), str(tmp_path / "ref"), quantize, config
        )[0]
    return _build(kind, tiny_dir, tmp_path)[0]


@pytest.mark.parametrize("kind", ["awq", *GPTQ, "ct-w4a16", *ACTIVATION])
def test_dummy_prequantized_layers_have_the_checkpoints_tensors_and_generate(
    kind, tiny_dir, tmp_path
):
    """A config-only directory of a pre-quantized format: the dummy layers hold exactly the
    tensors (names, shapes, dtypes) that loading the real checkpoint gives, and the model
    generates finite logits."""
    real_dir = _checkpoint_of(kind, tiny_dir, tmp_path)
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text((pathlib.Path(real_dir) / "config.json").read_text())
    real, _ = load_model(real_dir, dtype="float32")
    dummy = load_model(str(config_only), load_format="dummy", dtype="float32")
    layers = [(path, layer) for path, layer in nnx.iter_graph(real)
              if isinstance(layer, QuantizedLinear)]  # fmt: skip
    assert layers
    for path, layer in layers:
        ours = _node(dummy[0], path).tensors()
        assert {k: (v.shape, v.dtype) for k, v in ours.items()} == {
            k: (v.shape, v.dtype) for k, v in layer.tensors().items()
        }, path
    for seq in _greedy(dummy):
        assert np.all(np.isfinite(np.stack(seq.logits)))


def _node(model, path):
    for part in path:
        model = model[int(part)] if str(part).isdigit() else getattr(model, str(part))
    return model
