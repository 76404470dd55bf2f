"""Stored AWQ/GPTQ layers repacked for the W4A16 kernel equal ``awq_linear`` / ``gptq_linear``.

The existing linears are the independent reference (they match AutoAWQ / gptqmodel bit for bit,
``test_awq.py`` / ``test_gptq.py``); the kernel runs in interpret mode.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from models.quantization.awq import awq_linear
from models.quantization.gptq import gptq_linear
from models.quantization.w4a16 import repack_awq, repack_gptq, to_w4a16_layout
from pallas_kernels.w4a16_matmul import w4a16_matmul
from tests.pallas_kernels.test_w4a16_matmul import assert_close, random_words


def _awq_stored(rng, in_features, out_features, group_size):
    groups = in_features // group_size
    return {
        "qweight": random_words(rng, (in_features, out_features // 8)),
        "qzeros": random_words(rng, (groups, out_features // 8)),
        "scales": (rng.uniform(0.5, 1.5, (groups, out_features)) * 1e-2).astype(np.float16),
    }


@pytest.mark.parametrize("tokens,group_size", [(1, 32), (17, 64)])
def test_repacked_awq_equals_awq_linear(tokens, group_size):
    rng = np.random.default_rng(group_size)
    stored = _awq_stored(rng, 256, 32, group_size)
    x = jnp.asarray(rng.standard_normal((tokens, 256)), jnp.float32)
    got = w4a16_matmul(x, **repack_awq(**stored), group_size=group_size, interpret=True)
    assert_close(got, awq_linear(x, *map(jnp.asarray, stored.values())), 1e-4)


@pytest.mark.parametrize("checkpoint_format,symmetric", [("gptq", True), ("gptq", False),
                                                         ("gptq_v2", False)])  # fmt: skip
def test_repacked_gptq_equals_gptq_linear(checkpoint_format, symmetric):
    rng = np.random.default_rng(3)
    in_features, out_features, group_size = 256, 32, 128
    groups = in_features // group_size
    if symmetric:  # every zero point 8: v1 stores 7 in each nibble
        qzeros = np.full((groups, out_features // 8), 0x77777777, np.int64).astype(np.int32)
    else:
        qzeros = random_words(rng, (groups, out_features // 8))
    stored = {
        "qweight": random_words(rng, (in_features // 8, out_features)),
        "qzeros": qzeros,
        "scales": (rng.uniform(0.5, 1.5, (groups, out_features)) * 1e-2).astype(np.float16),
    }
    x = jnp.asarray(rng.standard_normal((2, in_features)), jnp.float32)
    kernel = repack_gptq(**stored, checkpoint_format=checkpoint_format)
    if symmetric:
        assert np.all(kernel["zeros"] == 8)
    got = w4a16_matmul(x, **kernel, group_size=group_size, interpret=True)
    want = gptq_linear(x, *map(jnp.asarray, stored.values()), bits=4,
                       checkpoint_format=checkpoint_format)  # fmt: skip
    assert_close(got, want, 1e-4)


def test_repack_gptq_refuses_act_order_and_8_bit():
    stored = {"qweight": np.zeros((32, 32), np.int32), "qzeros": np.zeros((2, 4), np.int32),
              "scales": np.ones((2, 32), np.float16)}  # fmt: skip
    with pytest.raises(ValueError, match="g_idx"):
        repack_gptq(**stored, g_idx=np.zeros(256, np.int32))
    with pytest.raises(ValueError, match="bits=8"):
        repack_gptq(**stored, bits=8)


def test_layout_is_the_documented_planes():
    """Slot j of word [r, o] holds q[j * in / 8 + r, o], read back bit by bit."""
    rng = np.random.default_rng(5)
    q = rng.integers(0, 16, (64, 16))
    packed = to_w4a16_layout(q, np.zeros((1, 16)), np.ones((1, 16)))["qweight"]
    words = packed.view(np.uint32)
    for j in range(8):
        np.testing.assert_array_equal((words >> (4 * j)) & 0xF, q[j * 8 : (j + 1) * 8])
    with pytest.raises(ValueError, match="in_features"):
        to_w4a16_layout(q[:60], np.zeros((1, 16)), np.ones((1, 16)))


# --- linear_backend="pallas": the kernel inside a whole model (interpret mode) -------------------

# The kernel tiles a layer whose in / 8 and group size share a factor of 16 or more: the shared
# tiny Llama (hidden 64) is too narrow, so these models are 128 wide with groups of 32.
WIDE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, num_hidden_layers=2)  # fmt: skip
PROMPTS = [[1, 17, 29, 3, 77, 101, 5, 64, 9, 33, 120, 2, 45], [1, 90, 12, 7]]


def _wide_checkpoint(kind: str, tmp_path) -> str:
    from tests.models.quantization import checkpoints as ckpt

    tiny = ckpt.tiny_llama(str(tmp_path / "float"), **WIDE)
    if kind == "awq":  # no AutoAWQ tool run here: dummy tensors of a config-only directory
        import json

        config = json.loads((tmp_path / "float" / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32,
                                         "zero_point": True, "version": "gemm"}  # fmt: skip
        (tmp_path / "awq").mkdir()
        (tmp_path / "awq" / "config.json").write_text(json.dumps(config))
        return str(tmp_path / "awq")
    if kind == "gptq":
        quantize, config = ckpt.gptq_quantizer(4, 32, False, False)
    else:
        quantize, config = ckpt.compressed_tensors_quantizer(
            dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
            None, "pack-quantized",
        )  # fmt: skip
    out = str(tmp_path / kind)
    return ckpt.quantize_checkpoint(tiny, out, str(tmp_path / "ref"), quantize, config)[0]


@pytest.mark.parametrize("kind", ["awq", "gptq", "ct-w4a16"])
def test_pallas_linear_backend_gives_the_xla_paths_greedy_tokens(kind, tmp_path):
    from flax import nnx

    from models.linear_backends import with_linear_backend
    from models.quantized_linear import QuantizedLinear
    from models.weights import load_config, load_model, model_quantization
    from tests.models.conftest import relative_diff
    from tests.models.quantization.quality import greedy, make_runner

    model_dir = _wide_checkpoint(kind, tmp_path)
    load_format = "dummy" if kind == "awq" else "auto"
    config = model_quantization(load_config(model_dir), None, load_format)
    runs = {}
    for backend in ("xla", "pallas"):
        model, hf = load_model(model_dir, dtype="float32", load_format=load_format,
                               quant_config=with_linear_backend(config, backend))  # fmt: skip
        layers = [n for _, n in nnx.iter_graph(model) if isinstance(n, QuantizedLinear)]
        assert all(("zeros" in n.tensor_names) == (backend == "pallas") for n in layers)
        runs[backend] = greedy(make_runner(model, hf, 32, len(PROMPTS)), PROMPTS, 4)
    for a, b in zip(runs["xla"], runs["pallas"], strict=True):
        assert a.tokens + [a.next_token] == b.tokens + [b.next_token]
        assert relative_diff(np.stack(a.logits), np.stack(b.logits)) < 1e-4


def test_pallas_linear_backend_refuses_what_the_kernel_does_not_run():
    from models.linear_backends import with_linear_backend
    from models.quantization.config import resolve_quantization

    awq = resolve_quantization(None, {"quant_method": "awq", "bits": 4, "group_size": 128})
    assert with_linear_backend(awq, "auto") is awq
    assert with_linear_backend(awq, "pallas").linear_backend == "pallas"
    gptq8 = resolve_quantization(None, {"quant_method": "gptq", "bits": 8, "group_size": 128})
    for config, kwargs, match in (
        (None, {}, "quantization is None"),
        (resolve_quantization("fp8", None), {}, "quantization is 'fp8'"),
        (gptq8, {}, "bits=8"),
        (awq, {"tensor_parallel_size": 2}, "tensor_parallel_size 1"),
    ):
        with pytest.raises(ValueError, match=match):
            with_linear_backend(config, "pallas", **kwargs)
    with pytest.raises(ValueError, match="linear_backend must be one of"):
        with_linear_backend(awq, "triton")
