"""Stored AWQ / GPTQ / compressed-tensors 4-bit layers repacked into the W4A16 kernel layout.

Each repack is checked bit for bit against the tool's own dequantization (AutoAWQ's
``dequantize_gemm`` fixture, gptqmodel's formula, compressed-tensors' ``decompress``), act-order
included, and the kernel (interpret mode) and the XLA path on the repacked tensors against the
format's own linear. Then ``auto``'s per-T dispatch and the ``pallas`` backend in whole models.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import linear_backends
from models.linear_backends import auto_max_tokens, backend_for_tokens
from models.quantization import w4a16
from models.quantization.awq import awq_linear
from models.quantization.compressed_tensors import (
    compressed_tensors_linear,
    dequantize_wna16,
    load_compressed_tensors_layer,
    sort_wna16_act_order,
)
from models.quantization.config import GPTQConfig
from models.quantization.gptq import gptq_linear, gptq_sort_act_order, load_gptq_layer
from models.quantization.w4a16 import (
    gptq_to_kernel,
    repack_awq,
    repack_gptq,
    to_w4a16_layout,
    w4a16_linear,
    w4a16_xla_linear,
    wna16_to_kernel,
)
from tests.pallas_kernels.test_w4a16_matmul import assert_close, random_words

AWQ_FIXTURE = pathlib.Path(__file__).resolve().parents[2] / "data" / "quantization" / "awq_gemm.npz"


def kernel_dequantize(layout) -> np.ndarray:
    """The kernel layout's weight ``[in, out]`` in float64, rows in the stored (unsorted) input
    order: read bit by bit from the documented planes, independent of the code under test."""
    words = np.asarray(layout["qweight"]).view(np.uint32)
    planes = words.shape[0]
    q = np.concatenate([(words >> np.uint32(4 * j)) & 0xF for j in range(8)]).astype(np.int64)
    groups = layout["scales"].shape[0]
    g = np.arange(8 * planes) // (8 * planes // groups)
    z = np.asarray(layout["zeros"], np.int64)[g]
    w = (q - z) * np.asarray(layout["scales"], np.float64)[g]
    if "perm" in layout:  # sorted row i is stored row perm[i]
        unsorted = np.empty_like(w)
        unsorted[np.asarray(layout["perm"])] = w
        w = unsorted
    return w


def _awq_stored(rng, in_features, out_features, group_size):
    groups = in_features // group_size
    return {
        "qweight": random_words(rng, (in_features, out_features // 8)),
        "qzeros": random_words(rng, (groups, out_features // 8)),
        "scales": (rng.uniform(0.5, 1.5, (groups, out_features)) * 1e-2).astype(np.float16),
    }


@pytest.mark.parametrize("group_size", [32, 128])
def test_repacked_awq_is_autoawqs_dequantization(group_size):
    """AutoAWQ's own ``dequantize_gemm`` (the fixture) equals the repacked layout's weight
    rounded once to float16, bit for bit, and the kernel equals ``awq_linear``."""
    d = np.load(AWQ_FIXTURE)
    stored = {k: d[f"g{group_size}_{k}"] for k in ("qweight", "qzeros", "scales")}
    layout = repack_awq(**stored)
    ours = kernel_dequantize(layout).astype(np.float16)
    np.testing.assert_array_equal(ours.view(np.uint16), d[f"g{group_size}_dequant"].view(np.uint16))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 128)), jnp.float32)
    got = w4a16_linear(x, jax.tree.map(jnp.asarray, layout))
    assert_close(got, awq_linear(x, *map(jnp.asarray, stored.values())), 1e-4)


GPTQ_CASES = [  # group_size, desc_act, sym, checkpoint_format
    (32, False, True, "gptq"),
    (32, False, False, "gptq"),
    (64, False, False, "gptq_v2"),
    (32, True, False, "gptq"),
    (-1, False, True, "gptq"),
]


@pytest.mark.parametrize("group_size,desc_act,sym,checkpoint_format", GPTQ_CASES)
def test_repacked_gptq_is_gptqs_dequantization(group_size, desc_act, sym, checkpoint_format):
    """gptqmodel's formula (``test_gptq._checkpoint``: ``scales[g_idx] * (q - zeros[g_idx])``
    in float16) equals the repacked layout's weight rounded once, bit for bit, act-order
    included (rows sorted by group at load, ``perm`` kept); the kernel (x's columns permuted)
    and the XLA path on the same tensors equal ``gptq_linear`` with the stored ``g_idx``."""
    from tests.models.quantization.test_gptq import IN, _checkpoint

    tensors, _, _, reference = _checkpoint(4, group_size, desc_act, sym, checkpoint_format)
    config = GPTQConfig(weight_bits=4, group_size=group_size, desc_act=desc_act, sym=sym,
                        checkpoint_format=checkpoint_format)  # fmt: skip
    loaded = load_gptq_layer("l", tensors, IN, reference.shape[1], config)
    placed = gptq_sort_act_order(loaded, 4) if desc_act else loaded
    assert ("perm" in placed) == desc_act
    layout = repack_gptq(placed["qweight"], placed["qzeros"], placed["scales"],
                         checkpoint_format=checkpoint_format, perm=placed.get("perm"))  # fmt: skip
    ours = kernel_dequantize(layout).astype(np.float16)
    np.testing.assert_array_equal(ours.view(np.uint16), reference.view(np.uint16))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, IN)), jnp.float32)
    want = gptq_linear(x, *(jnp.asarray(tensors[k]) for k in ("qweight", "qzeros", "scales")),
                       jnp.asarray(tensors["g_idx"]) if desc_act else None, bits=4,
                       checkpoint_format=checkpoint_format)  # fmt: skip
    on_device = jax.tree.map(jnp.asarray, layout)
    assert_close(w4a16_linear(x, on_device), want, 1e-4)
    assert_close(w4a16_xla_linear(x, on_device), want, 1e-4)
    on_device_jit = gptq_to_kernel(*(jnp.asarray(placed[k]) for k in ("qweight", "qzeros", "scales")),
                                   placed.get("perm"), checkpoint_format=checkpoint_format)  # fmt: skip
    for k, v in layout.items():
        np.testing.assert_array_equal(np.asarray(on_device_jit[k]), v)


@pytest.mark.parametrize(
    "weights,act_order",
    [
        (dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32), False),
        (dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=64), False),
        (dict(num_bits=4, type="int", symmetric=True, strategy="channel"), False),
        (dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32), True),
    ],
    ids=["sym-g32", "asym-g64", "sym-channel", "asym-g32-act-order"],
)
def test_repacked_compressed_tensors_is_the_compressors_dequantization(weights, act_order):
    """compressed-tensors' own ``decompress`` (float16) equals the repacked layout's weight
    rounded once, bit for bit; with act-order (``weight_g_idx``, sorted at load) the weight is
    the gathered form (``dequantize_wna16`` with ``g_idx``, pinned to the tool in
    ``test_compressed_tensors.py``); the kernel equals ``compressed_tensors_linear``."""
    from tests.models.quantization.test_compressed_tensors import IN, OUT, _make

    scheme, stored, expected = _make(weights)
    params = load_compressed_tensors_layer("l", stored, IN, OUT, scheme)
    if act_order:
        g_idx = np.random.default_rng(3).permutation(np.arange(IN) // 32).astype(np.int32)
        params = dict(params, weight_g_idx=g_idx)
        keys = ("weight_packed", "weight_scale", "weight_zero_point")
        expected = np.asarray(dequantize_wna16(*(jnp.asarray(params[k]) for k in keys),
                                               jnp.asarray(g_idx), bits=4))  # fmt: skip
        placed = sort_wna16_act_order(params, 4)
    else:
        placed = params
    layout = wna16_to_kernel(
        jnp.asarray(placed["weight_packed"]), jnp.asarray(placed["weight_scale"]),
        None if "weight_zero_point" not in placed else jnp.asarray(placed["weight_zero_point"]),
        None if "perm" not in placed else jnp.asarray(placed["perm"]),
    )  # fmt: skip
    ours = kernel_dequantize(layout).T.astype(np.float16)
    np.testing.assert_array_equal(ours.view(np.uint16), expected.view(np.uint16))
    x = jnp.asarray(np.random.default_rng(4).standard_normal((2, IN)), jnp.float32)
    want = compressed_tensors_linear(x, jax.tree.map(jnp.asarray, params), scheme)
    assert_close(w4a16_linear(x, layout), want, 1e-4)


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


def test_repack_gptq_refuses_8_bit_and_unknown_formats():
    stored = {"qweight": np.zeros((32, 32), np.int32), "qzeros": np.zeros((2, 4), np.int32),
              "scales": np.ones((2, 32), np.float16)}  # fmt: skip
    with pytest.raises(ValueError, match="bits=8"):
        repack_gptq(**stored, bits=8)
    with pytest.raises(ValueError, match="checkpoint_format"):
        repack_gptq(**stored, checkpoint_format="marlin")


# --- auto: the table's choice per token count ----------------------------------------------------


def test_auto_table_picks_per_token_count(monkeypatch):
    table = {"w4a16": ((1, "pallas"), (32, "xla"), (None, "pallas")), "w8": ((0, "pallas"),)}
    monkeypatch.setattr(linear_backends, "AUTO_BACKENDS", table)
    picks = [backend_for_tokens("w4a16", "auto", t) for t in (1, 2, 32, 33, 4096)]
    assert picks == ["pallas", "xla", "xla", "pallas", "pallas"]
    assert backend_for_tokens("w4a16", "xla", 1) == "xla"  # a forced backend is kept
    assert backend_for_tokens("w8", "auto", 1) == "xla"  # past the last bound
    assert auto_max_tokens("w4a16", "pallas") == 1
    assert auto_max_tokens("w8", "pallas") == 0


@pytest.mark.parametrize("platform,tokens,expected", [("gpu", 1, "kernel"), ("gpu", 33, "xla"),
                                                      ("cpu", 1, "xla")])  # fmt: skip
def test_auto_dispatch_on_the_static_token_count(monkeypatch, platform, tokens, expected):
    """``w4a16_apply`` under ``auto`` runs what the table says for the step's T on a GPU, and
    XLA off one (the kernel would only run interpreted there)."""
    table = {"w4a16": ((32, "pallas"), (None, "xla")), "w8": ((0, "pallas"),)}
    monkeypatch.setattr(linear_backends, "AUTO_BACKENDS", table)
    monkeypatch.setattr(w4a16.jax, "default_backend", lambda: platform)
    monkeypatch.setattr(w4a16, "w4a16_linear", lambda x, p: "kernel")
    monkeypatch.setattr(w4a16, "w4a16_xla_linear", lambda x, p: "xla")
    x = jnp.zeros((tokens, 256), jnp.float32)
    assert w4a16.w4a16_apply(x, {}, "auto") == expected
    assert w4a16.w4a16_apply(x, {}, "pallas") == "kernel"  # forced
    assert w4a16.w4a16_apply(x, {}, "xla") == "xla"


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
    if kind in ("gptq", "gptq-act-order"):
        quantize, config = ckpt.gptq_quantizer(4, 32, kind == "gptq-act-order", False)
    else:
        quantize, config = ckpt.compressed_tensors_quantizer(
            dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
            None, "pack-quantized",
        )  # fmt: skip
    out = str(tmp_path / kind)
    return ckpt.quantize_checkpoint(tiny, out, str(tmp_path / "ref"), quantize, config)[0]


@pytest.mark.parametrize("kind", ["awq", "gptq", "ct-w4a16", "gptq-act-order"])
def test_pallas_linear_backend_gives_the_xla_paths_greedy_tokens(kind, tmp_path):
    """Act-order: rows sorted at load, ``perm`` applied to x; it also runs ``auto`` (the kernel
    layout through the XLA path on the CPU)."""
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
    backends = ("xla", "pallas", "auto") if kind == "gptq-act-order" else ("xla", "pallas")
    for backend in backends:
        model, hf = load_model(model_dir, dtype="float32", load_format=load_format,
                               quant_config=with_linear_backend(config, backend))  # fmt: skip
        layers = [n for _, n in nnx.iter_graph(model) if isinstance(n, QuantizedLinear)]
        assert all(("zeros" in n.tensor_names) == (backend != "xla") for n in layers)
        assert all(("perm" in n.tensor_names) == (kind == "gptq-act-order") for n in layers)
        runs[backend] = greedy(make_runner(model, hf, 32, len(PROMPTS)), PROMPTS, 4)
    for backend in backends[1:]:
        for a, b in zip(runs["xla"], runs[backend], strict=True):
            assert a.tokens + [a.next_token] == b.tokens + [b.next_token]
            assert relative_diff(np.stack(a.logits), np.stack(b.logits)) < 1e-4


def test_pallas_linear_backend_refuses_what_the_kernel_does_not_run():
    from models.linear_backends import with_linear_backend
    from models.quantization.config import resolve_quantization

    awq = resolve_quantization(None, {"quant_method": "awq", "bits": 4, "group_size": 128})
    assert with_linear_backend(awq, "auto").linear_backend == "auto"  # the table uses pallas
    assert with_linear_backend(awq, "xla") is awq
    assert with_linear_backend(awq, "auto", tensor_parallel_size=2) is awq  # auto: XLA there
    assert with_linear_backend(awq, "pallas").linear_backend == "pallas"
    act_order = resolve_quantization(None, {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                            "desc_act": True})  # fmt: skip
    assert with_linear_backend(act_order, "pallas").linear_backend == "pallas"
    gptq8 = resolve_quantization(None, {"quant_method": "gptq", "bits": 8, "group_size": 128})
    fp8 = resolve_quantization("fp8", None)
    assert with_linear_backend(gptq8, "auto") is gptq8
    assert with_linear_backend(fp8, "auto") is fp8
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
