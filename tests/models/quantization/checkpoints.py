"""Tiny quantized Llama checkpoints for the whole-model tests, each with its float32 reference.

Every builder writes two directories: the quantized checkpoint (``model.safetensors`` +
``config.json`` with the tool's ``quantization_config``) and the reference, an ordinary float32
checkpoint holding the same model with each quantized weight replaced by its dequantization.
The dequantization is the tool's own where the tool runs here (compressed-tensors'
``decompress``), and otherwise the format's formula in numpy (GPTQ: gptqmodel's
``dequantize_weight``; AWQ and bitsandbytes: ``models.quantization``'s dequantization, which
``test_awq.py`` / ``test_bitsandbytes.py`` pin bit for bit to AutoAWQ's ``dequantize_gemm`` and
bitsandbytes' ``int8_vectorwise_dequant``).

Sources of the quantized tensors:

- AWQ: ``tests/data/quantization/awq_tiny_llama/``, written by AutoAWQ's own
  ``pseudo_quantize_tensor`` and ``WQLinear_GEMM.from_linear`` (``make_awq_checkpoint.py``);
- GPTQ: packed in numpy with gptqmodel's ``pack_original`` layout (``test_gptq._pack_rows`` /
  ``_pack_cols``), min/max quantization per group, optional act-order ``g_idx`` (shared by the
  modules that read the same input, as GPTQ's Hessian is);
- compressed-tensors: its ``calculate_qparams`` and compressors, run live.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy

DATA = pathlib.Path(__file__).resolve().parents[2] / "data" / "quantization"
AWQ_DIR = DATA / "awq_tiny_llama"

# hidden 64, intermediate 128 (multiples of 8 and of group size 32, also per shard at tp = 2),
# GQA 4/2 with head_dim 16, untied lm_head.
TINY_LLAMA = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    initializer_range=0.1,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Modules that read the same input (act-order permutes by that input's Hessian).
_SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up",
                 "up_proj": "gate_up"}  # fmt: skip


def tiny_llama(path: str, seed: int = 0, **overrides) -> str:
    """A random float32 Llama of :data:`TINY_LLAMA` (``overrides`` replacing its entries) saved
    as an HF checkpoint at ``path`` (numpy only: linears and embeddings ``normal * 0.1``, norm
    weights ``1 + normal * 0.1``)."""
    c = {**TINY_LLAMA, **overrides}
    rng = np.random.default_rng(seed)
    hidden, inter, head_dim = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    shapes = {
        "model.embed_tokens.weight": (c["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (c["vocab_size"], hidden),
    }
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes.update({
            f"{p}.input_layernorm.weight": (hidden,),
            f"{p}.post_attention_layernorm.weight": (hidden,),
            f"{p}.self_attn.q_proj.weight": (q, hidden),
            f"{p}.self_attn.k_proj.weight": (kv, hidden),
            f"{p}.self_attn.v_proj.weight": (kv, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, q),
            f"{p}.mlp.gate_proj.weight": (inter, hidden),
            f"{p}.mlp.up_proj.weight": (inter, hidden),
            f"{p}.mlp.down_proj.weight": (hidden, inter),
        })  # fmt: skip
    tensors = {}
    for name, shape in shapes.items():
        noise = (0.1 * rng.standard_normal(shape)).astype(np.float32)
        tensors[name] = 1 + noise if name.endswith("norm.weight") else noise
    os.makedirs(path, exist_ok=True)
    config = {**c, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_act": "silu", "rope_theta": 10000.0, "torch_dtype": "float32"}  # fmt: skip
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return write_checkpoint(path, path, tensors)


def read_tensors(model_dir: str) -> dict[str, np.ndarray]:
    with safetensors.safe_open(os.path.join(model_dir, "model.safetensors"), "numpy") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def write_checkpoint(path: str, source_dir: str, tensors: dict, quantization_config=None) -> str:
    """``tensors`` and ``source_dir``'s config.json (plus ``quantization_config``) at ``path``."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(source_dir, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    safetensors.numpy.save_file(
        {k: np.ascontiguousarray(v) for k, v in tensors.items()},
        os.path.join(path, "model.safetensors"),
    )
    return path


def is_linear(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in LINEARS and "layers" in name


def quantize_checkpoint(source_dir, out_dir, ref_dir, quantize, quantization_config):
    """Quantize every layer linear of ``source_dir``: ``quantize(name, input_key, W [out, in]
    f32) -> (stored tensors by suffix, dequantized W f32)``; writes both directories."""
    stored, reference = {}, {}
    for name, value in read_tensors(source_dir).items():
        if not is_linear(name):
            stored[name] = reference[name] = value
            continue
        prefix = name.removesuffix(".weight")
        layer, module = prefix.rsplit(".", 1)[0], prefix.rsplit(".", 1)[1]
        key = f"{layer}.{_SHARED_INPUT.get(module, module)}"
        tensors, dequantized = quantize(prefix, key, value.astype(np.float32))
        stored.update({f"{prefix}.{suffix}": t for suffix, t in tensors.items()})
        reference[name] = dequantized.astype(np.float32)
    write_checkpoint(out_dir, source_dir, stored, quantization_config)
    write_checkpoint(ref_dir, source_dir, reference)
    return out_dir, ref_dir


# ------------------------------------------------------------------------------------ GPTQ


def gptq_quantizer(bits: int, group_size: int, desc_act: bool, sym: bool, seed: int = 0):
    """GPTQ v1 (``checkpoint_format: gptq``) tensors by min/max per group (round to nearest;
    the packing and dequantization are GPTQ's, the rounding search is not needed here)."""
    from tests.models.quantization.test_gptq import _pack_cols, _pack_rows

    rng = np.random.default_rng(seed)
    perms: dict[str, np.ndarray] = {}
    maxq = 2**bits - 1

    def quantize(prefix, input_key, w):
        out_f, in_f = w.shape
        size = in_f if group_size == -1 else group_size
        g_idx = np.arange(in_f) // size
        if desc_act:  # rows of a group scattered over the input, the same for a shared input
            perm = perms.setdefault(input_key, rng.permutation(in_f))
            g_idx = np.empty(in_f, np.int64)
            g_idx[perm] = np.arange(in_f) // size
        wt = w.T  # [in, out]
        groups = in_f // size
        scales = np.zeros((groups, out_f), np.float32)
        zeros = np.zeros((groups, out_f), np.int64)
        for g in range(groups):
            rows = wt[g_idx == g]
            lo, hi = np.minimum(rows.min(0), 0), np.maximum(rows.max(0), 0)
            if sym:
                scale = 2 * np.maximum(np.abs(lo), hi) / maxq
                zero = np.full(out_f, (maxq + 1) // 2)
            else:
                scale = (hi - lo) / maxq
                zero = np.round(-lo / np.where(scale > 0, scale, 1))
            scales[g] = np.where(scale > 0, scale, 1e-4)
            zeros[g] = np.clip(zero, 1, maxq)  # v1 stores zero - 1: keep it >= 0
        scales = scales.astype(np.float16)
        s, z = scales[g_idx].astype(np.float32), zeros[g_idx]
        q = np.clip(np.round(wt / s) + z, 0, maxq).astype(np.int64)
        dequantized = ((q - z) * s).T  # gptqmodel dequantize_weight: scales * (weight - zeros)
        tensors = {
            "qweight": _pack_rows(q, bits),
            "qzeros": _pack_cols(zeros - 1, bits),
            "scales": scales,
            "g_idx": g_idx.astype(np.int32),
        }
        return tensors, dequantized

    config = {"quant_method": "gptq", "bits": bits, "group_size": group_size,
              "desc_act": desc_act, "sym": sym, "checkpoint_format": "gptq"}  # fmt: skip
    return quantize, config


# ------------------------------------------------------------------------ compressed-tensors


def _np(t) -> np.ndarray:
    import torch

    t = t.detach().cpu()
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return t.numpy()


def compressed_tensors_qparams(weight, args):
    """``(scale, zero_point)`` of a torch ``weight [out, in]`` by compressed-tensors' own
    ``calculate_qparams`` over the observed min/max of each group, channel or the whole tensor
    (``args.strategy``), as its min-max observer feeds it."""
    from compressed_tensors.quantization.utils import calculate_qparams

    if args.strategy == "group":
        grouped = weight.reshape(weight.shape[0], -1, args.group_size)
        lo, hi = grouped.amin(-1), grouped.amax(-1)
    elif args.strategy == "channel":
        lo, hi = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    else:
        lo, hi = weight.amin().reshape(1), weight.amax().reshape(1)
    return calculate_qparams(lo, hi, args)


def compressed_tensors_quantizer(weights: dict, inputs: dict | None, fmt: str):
    """compressed-tensors' own ``calculate_qparams`` + compressor ``compress`` per layer; the
    reference weight is the same compressor's ``decompress``."""
    import torch
    from compressed_tensors.compressors.naive_quantized.base import (
        FloatQuantizationCompressor,
        IntQuantizationCompressor,
    )
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
    )

    args = QuantizationArgs(**weights)
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=args,
        input_activations=None if inputs is None else QuantizationArgs(**inputs),
    )
    compressor = {
        "pack-quantized": PackedQuantizationCompressor,
        "int-quantized": IntQuantizationCompressor,
        "float-quantized": FloatQuantizationCompressor,
    }[fmt]

    def quantize(prefix, input_key, w):
        del prefix, input_key
        weight = torch.from_numpy(w)
        scale, zero_point = compressed_tensors_qparams(weight, args)
        state = {"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point}
        stored = compressor.compress(state, scheme)
        dequantized = compressor.decompress(stored, scheme)["weight"].float()
        return {k: _np(v) for k, v in stored.items()}, _np(dequantized)

    config = QuantizationConfig(
        config_groups={"group_0": scheme}, format=fmt, ignore=["lm_head"],
        quantization_status="compressed",
    ).model_dump(mode="json")  # fmt: skip
    return quantize, config


# ---------------------------------------------------------------------------------- AWQ


def awq_checkpoint(out_dir: str, ref_dir: str) -> tuple[str, str]:
    """The committed AutoAWQ checkpoint (copied) and its reference, dequantized by
    ``awq_dequantize`` (AutoAWQ's ``dequantize_gemm`` bit for bit, ``test_awq.py``)."""
    import jax.numpy as jnp

    from models.quantization.awq import awq_dequantize

    shutil.copytree(AWQ_DIR, out_dir, dirs_exist_ok=True)
    tensors = read_tensors(str(AWQ_DIR))
    reference = {}
    for name, value in tensors.items():
        prefix, suffix = name.rsplit(".", 1)
        if suffix in ("qzeros", "scales"):
            continue
        if suffix == "qweight":
            w = awq_dequantize(
                jnp.asarray(value), jnp.asarray(tensors[f"{prefix}.qzeros"]),
                jnp.asarray(tensors[f"{prefix}.scales"]), dtype=jnp.float32,
            )  # fmt: skip
            reference[f"{prefix}.weight"] = np.asarray(w).T
        else:
            reference[name] = value.astype(np.float32)
    write_checkpoint(ref_dir, str(AWQ_DIR), reference)
    return out_dir, ref_dir
