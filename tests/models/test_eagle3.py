"""The EAGLE-3 head against an independent PyTorch forward written from the published
architecture (HF transformers' Llama RoPE; everything else plain torch), on a tiny checkpoint
in the published tensor layout, over a NaN-poisoned paged KV cache."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pallas_kernels
from models.attention_metadata import AttentionMetadata
from models.eagle3 import Eagle3Config, Eagle3DraftModel, load_eagle3

# float32 on both sides; summation order only.
RTOL = 1e-4
V, VD = 96, 40  # target vocabulary, draft vocabulary
TINY = dict(
    architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=64,
    intermediate_size=80, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
    vocab_size=V, draft_vocab_size=VD, target_hidden_size=48, rms_norm_eps=1e-5,
    max_position_embeddings=128, rope_theta=500000.0, tie_word_embeddings=False,
    torch_dtype="float32",
    # Llama 3.1 scaling with a short original length, so all three bands are exercised.
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
)  # fmt: skip


def _tensors(config: dict, seed: int = 0, *, embed: bool = False) -> dict:
    """Random tensors with the published names and HF ``[out, in]`` layouts."""
    rng = np.random.default_rng(seed)
    h, inter = config["hidden_size"], config["intermediate_size"]
    hq, hkv = config["num_attention_heads"], config["num_key_value_heads"]
    d = h // hq

    def w(*shape, scale=0.2):
        return (rng.normal(size=shape) * scale).astype(np.float32)

    def norm():
        return (1.0 + 0.1 * rng.normal(size=h)).astype(np.float32)

    tensors = {
        "fc.weight": w(h, 3 * config["target_hidden_size"], scale=0.1),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": w(hq * d, 2 * h, scale=0.1),
        "midlayer.self_attn.k_proj.weight": w(hkv * d, 2 * h, scale=0.1),
        "midlayer.self_attn.v_proj.weight": w(hkv * d, 2 * h, scale=0.1),
        "midlayer.self_attn.o_proj.weight": w(h, hq * d, scale=0.1),
        "midlayer.mlp.gate_proj.weight": w(inter, h, scale=0.1),
        "midlayer.mlp.up_proj.weight": w(inter, h, scale=0.1),
        "midlayer.mlp.down_proj.weight": w(h, inter, scale=0.1),
        "norm.weight": norm(),
        "lm_head.weight": w(config["draft_vocab_size"], h),
    }
    target_ids = np.sort(rng.choice(V, config["draft_vocab_size"], replace=False))
    tensors["d2t"] = (target_ids - np.arange(config["draft_vocab_size"])).astype(np.int64)
    t2d = np.zeros(V, bool)
    t2d[target_ids] = True
    tensors["t2d"] = t2d
    if embed:
        tensors["embed_tokens.weight"] = w(V, h, scale=1.0)
    return tensors


def _write_head(path, config: dict, tensors: dict) -> str:
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return str(path)


def torch_eagle3(t: dict, config: dict, input_ids, aux, positions, embed):
    """The published EAGLE-3 forward over one contiguous sequence (causal attention), in
    float64: returns (full-vocabulary logits with -inf outside the draft vocabulary, the
    pre-norm output)."""
    torch = pytest.importorskip("torch")
    import transformers
    from transformers.models.llama import modeling_llama

    g = {k: torch.tensor(np.asarray(v, np.float64)) for k, v in t.items() if k != "t2d"}
    h, hq, hkv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    d, eps, n = h // hq, config["rms_norm_eps"], len(input_ids)

    def rms(x, weight):
        return weight * x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)

    feature = torch.tensor(np.asarray(aux, np.float64)) @ g["fc.weight"].T
    emb = torch.tensor(np.asarray(embed, np.float64))[torch.tensor(input_ids)]
    normed_feature = rms(feature, g["midlayer.hidden_norm.weight"])
    x = torch.cat([rms(emb, g["midlayer.input_layernorm.weight"]), normed_feature], -1)
    if config.get("norm_before_residual"):
        feature = normed_feature
    q = (x @ g["midlayer.self_attn.q_proj.weight"].T).view(n, hq, d).transpose(0, 1)
    k = (x @ g["midlayer.self_attn.k_proj.weight"].T).view(n, hkv, d).transpose(0, 1)
    v = (x @ g["midlayer.self_attn.v_proj.weight"].T).view(n, hkv, d).transpose(0, 1)
    rope = modeling_llama.LlamaRotaryEmbedding(transformers.LlamaConfig(**{
        key: config[key] for key in ("hidden_size", "num_attention_heads", "rope_theta",
                                     "rope_scaling", "max_position_embeddings")
    }))  # fmt: skip
    cos, sin = rope(q.float(), torch.tensor([positions]))
    q, k = modeling_llama.apply_rotary_pos_emb(q[None], k[None], cos.double(), sin.double())
    k, v = k[0].repeat_interleave(hq // hkv, 0), v.repeat_interleave(hq // hkv, 0)
    scores = q[0] @ k.transpose(-1, -2) / d**0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attn = (torch.softmax(scores, -1) @ v).transpose(0, 1).reshape(n, h)
    residual = feature + attn @ g["midlayer.self_attn.o_proj.weight"].T
    y = rms(residual, g["midlayer.post_attention_layernorm.weight"])
    gate = torch.nn.functional.silu(y @ g["midlayer.mlp.gate_proj.weight"].T)
    out = (
        residual
        + (gate * (y @ g["midlayer.mlp.up_proj.weight"].T)) @ g["midlayer.mlp.down_proj.weight"].T
    )
    draft_logits = rms(out, g["norm.weight"]) @ g["lm_head.weight"].T
    full = torch.full((n, V), float("-inf"), dtype=torch.float64)
    full[:, torch.arange(VD) + g["d2t"].long()] = draft_logits
    return full.numpy(), out.numpy()


class _Cache:
    """One sequence's paged K/V for the head: blocks from a shuffled list, NaN elsewhere."""

    def __init__(self, config, block_size=4, num_blocks=16, seed=0):
        hkv, d = (
            config["num_key_value_heads"],
            config["hidden_size"] // config["num_attention_heads"],
        )
        shape = pallas_kernels.kv_cache_shape(num_blocks, block_size, hkv, d)
        self.kv = (jnp.full(shape, jnp.nan), jnp.full(shape, jnp.nan))
        self.blocks = [int(b) for b in np.random.default_rng(seed).permutation(num_blocks)]
        self.block_size = block_size

    def metadata(self, start: int, count: int) -> tuple[AttentionMetadata, jax.Array]:
        """Positions ``start .. start + count - 1`` of the sequence, written and read."""
        pos = np.arange(start, start + count)
        slots = [self.blocks[p // self.block_size] * self.block_size + p % self.block_size
                 for p in pos]  # fmt: skip
        metadata = AttentionMetadata(
            slot_mapping=jnp.asarray(slots, jnp.int32),
            block_tables=jnp.asarray([self.blocks[:8]], jnp.int32),
            seq_lens=jnp.asarray([start + count], jnp.int32),
            cu_q_lens=jnp.asarray([0, count], jnp.int32),
            decode_only=False,
        )
        return metadata, jnp.asarray(pos, jnp.int32)


def _relative(ours, ref):
    finite = np.isfinite(ref)
    assert (np.isfinite(ours) == finite).all()
    return float(np.max(np.abs(ours[finite] - ref[finite])) / np.max(np.abs(ref[finite])))


@pytest.mark.parametrize(
    ("own_embeddings", "norm_before_residual"), [(False, False), (True, False), (False, True)],
    ids=["target_embeddings", "own_embeddings", "norm_before_residual"],
)  # fmt: skip
def test_head_matches_the_reference_over_a_prefill_then_a_draft_step(
    tmp_path, own_embeddings, norm_before_residual
):
    """Pass 1 over 9 tokens from the target's features; pass 2, one token at position 9 fed
    pass 1's last pre-norm output (the head's own KV from pass 1 read back): both equal the
    reference over the whole sequence."""
    config = TINY | {"norm_before_residual": norm_before_residual}
    tensors = _tensors(config, embed=own_embeddings)
    head = load_eagle3(_write_head(tmp_path / "head", config, tensors), target_vocab_size=V)
    rng = np.random.default_rng(1)
    target_embed = rng.normal(size=(V, TINY["hidden_size"])).astype(np.float32)
    embed = tensors.get("embed_tokens.weight", target_embed)
    ids = [int(x) for x in rng.integers(0, V, 10)]
    aux = rng.normal(size=(9, 3 * TINY["target_hidden_size"])).astype(np.float32)
    cache = _Cache(TINY)
    kwargs = {} if own_embeddings else {"embed_tokens": jnp.asarray(target_embed)}

    metadata, pos = cache.metadata(0, 9)
    features = head.combine_hidden_states(jnp.asarray(aux))
    normed, prenorm, kv = head(jnp.asarray(ids[:9]), features, pos, cache.kv, metadata, **kwargs)
    logits = np.asarray(head.compute_logits(normed))
    ref_logits, ref_out = torch_eagle3(tensors, config, ids[:9], aux, list(range(9)), embed)
    assert _relative(logits, ref_logits) < RTOL
    assert _relative(np.asarray(prenorm), ref_out) < RTOL
    draft = np.asarray(head.draft_token_ids(normed))
    np.testing.assert_array_equal(draft, ref_logits.argmax(-1))

    # Pass 2: the feature at position 9 is pass 1's last output (the reference takes it as
    # "aux" through an identity fc, so both compute the same thing).
    metadata, pos = cache.metadata(9, 1)
    normed2, _, _ = head(jnp.asarray(ids[9:]), prenorm[-1:], pos, kv, metadata, **kwargs)
    ref_tensors = dict(tensors)
    feats = np.concatenate([np.asarray(features), np.asarray(prenorm[-1:])])
    ref_tensors["fc.weight"] = np.eye(TINY["hidden_size"], dtype=np.float32)
    ref_logits2, _ = torch_eagle3(ref_tensors, config, ids, feats, list(range(10)), embed)
    assert _relative(np.asarray(head.compute_logits(normed2)), ref_logits2[-1:]) < RTOL


def test_missing_or_misshapen_tensors_are_named(tmp_path):
    tensors = _tensors(TINY)
    del tensors["midlayer.hidden_norm.weight"]
    head = _write_head(tmp_path / "missing", TINY, tensors)
    with pytest.raises(ValueError, match="midlayer.hidden_norm.weight"):
        load_eagle3(head, target_vocab_size=V)
    tensors = _tensors(TINY)
    tensors["fc.weight"] = tensors["fc.weight"][:, :100]
    head = _write_head(tmp_path / "shape", TINY, tensors)
    with pytest.raises(ValueError, match=r"'fc.weight'\) has shape \(64, 100\)"):
        load_eagle3(head, target_vocab_size=V)
    tensors = _tensors(TINY)
    tensors["d2t"][-1] += 1000
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        load_eagle3(_write_head(tmp_path / "d2t", TINY, tensors), target_vocab_size=V)
    with pytest.raises(ValueError, match="vocab_size 96, the target 128"):
        load_eagle3(_write_head(tmp_path / "ok", TINY, _tensors(TINY)), target_vocab_size=128)


@pytest.mark.parametrize("flag", ["norm_before_fc", "fc_norm", "norm_output"])
def test_unimplemented_variants_are_refused_by_name(flag):
    with pytest.raises(ValueError, match=f"{flag} = true is not supported"):
        Eagle3Config.from_dict(TINY | {flag: True})


def test_dummy_weights_fill_every_parameter_and_a_valid_vocabulary_map(tmp_path):
    os.makedirs(tmp_path / "dummy")
    with open(tmp_path / "dummy" / "config.json", "w") as f:
        json.dump(TINY, f)
    head = load_eagle3(str(tmp_path / "dummy"), target_vocab_size=V, load_format="dummy")
    table = np.asarray(head.draft_to_target[...])
    assert table.shape == (VD,) and (np.diff(table) > 0).all() and table[-1] == V - 1
    assert float(jnp.abs(head.fc.kernel[...]).mean()) > 0
    assert (np.asarray(head.norm.weight[...]) == 1).all()


# The published Llama-3.1-8B head (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): config and tensor shapes.
LLAMA31_8B_HEAD = dict(
    architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=4096,
    intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
    num_hidden_layers=1, vocab_size=128256, draft_vocab_size=32000, rms_norm_eps=1e-5,
    max_position_embeddings=2048, rope_theta=500000.0, tie_word_embeddings=False,
    torch_dtype="float16",
)  # fmt: skip
PUBLISHED_SHAPES = {
    "fc.weight": (4096, 12288),
    "midlayer.self_attn.q_proj.weight": (4096, 8192),
    "midlayer.self_attn.k_proj.weight": (1024, 8192),
    "midlayer.self_attn.v_proj.weight": (1024, 8192),
    "midlayer.self_attn.o_proj.weight": (4096, 4096),
    "midlayer.mlp.gate_proj.weight": (14336, 4096),
    "midlayer.mlp.up_proj.weight": (14336, 4096),
    "midlayer.mlp.down_proj.weight": (4096, 14336),
    "midlayer.input_layernorm.weight": (4096,),
    "midlayer.hidden_norm.weight": (4096,),
    "midlayer.post_attention_layernorm.weight": (4096,),
    "norm.weight": (4096,),
    "lm_head.weight": (32000, 4096),
}


def test_the_published_8b_head_builds_with_its_tensor_shapes():
    """Abstractly (no 1.7 GB of values): every parameter reads exactly the published tensors
    with their shapes, which is what a real or dummy load of that head fills."""
    from models.hf_names import hf_names, merged_output_sizes

    config = Eagle3Config.from_dict(LLAMA31_8B_HEAD)
    abstract = nnx.eval_shape(lambda: Eagle3DraftModel(
        config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)
    ))  # fmt: skip
    merged = merged_output_sizes(abstract)
    seen = {}
    for path, variable in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        names, transposed = hf_names(path)
        shape = variable.get_value().shape
        sizes = merged.get(tuple(str(p) for p in path[:-1]), (shape[-1],))
        for name, size in zip(names, sizes, strict=True):
            part = (*shape[:-1], size)
            seen[name] = part[::-1] if transposed else part
    assert seen == PUBLISHED_SHAPES
    params = sum(int(np.prod(s)) for s in PUBLISHED_SHAPES.values())
    assert 0.41e9 < params < 0.43e9  # ~0.42 B without embeddings
