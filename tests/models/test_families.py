"""Qwen3, Gemma-2, Phi-3 and Mixtral against HF transformers (PyTorch, float32).

Per family, one tiny random checkpoint saved by transformers (``FAMILY_CONFIGS``):

- logits: two prompts prefilled in one ragged step over a NaN-filled, permuted paged cache, then
  batched decode steps, against HF's full-sequence logits at every position;
- greedy ids through the engine with chunked prefill (8-token budget), prefix caching and
  preemption (6 blocks of 8 tokens for 3 prompts that need 11), batched and one at a time,
  against HF greedy decoding of each prompt alone. The prompts (up to 21 tokens plus 8 new)
  are longer than Gemma-2's window (6) and Phi-3's (8).
"""

from __future__ import annotations

import json
import os
import types

import jax
import numpy as np
import pytest

import models.moe
from jaxpaged import LLM, SamplingParams
from models.attention import kv_cache_head_dim
from models.llama import DecoderOptions
from models.moe import DECODE_MAX_ROWS, experts_backend, grouped_swiglu, route
from models.registry import get_model_class, supported_architectures
from models.weights import fused_checkpoint_views, load_config, load_model
from tests.models.conftest import (
    FAMILY_CONFIGS,
    PagedRunner,
    hf_logits,
    make_hf_checkpoint,
    relative_diff,
)

pytest.importorskip("torch")

FAMILIES = list(FAMILY_CONFIGS)
ON_GPU = jax.devices()[0].platform == "gpu"
# float32 on both sides; the differences are summation order only (measured <= 1.2e-6).
RTOL = 1e-4
MAX_TOKENS = 8
_RNG = np.random.default_rng(7)
_SHARED = [int(x) for x in _RNG.integers(3, 128, size=16)]  # two full blocks of 8
# Two prompts share 16 tokens (two full blocks: a prefix-cache hit for the later one).
PROMPTS = [
    _SHARED + [int(x) for x in _RNG.integers(3, 128, size=5)],
    [int(x) for x in _RNG.integers(3, 128, size=11)],
    _SHARED + [int(x) for x in _RNG.integers(3, 128, size=3)],
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    return {name: make_hf_checkpoint(str(root / name), name) for name in FAMILIES}


def _hf_greedy(model_dir: str, prompt: list[int], max_tokens: int) -> list[int]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            ids.append(int(torch.argmax(model(torch.tensor([ids])).logits[0, -1])))
    return ids[len(prompt) :]


def _paged_logits_match_hf(model_dir, backend="reference", interpret=False):
    model, config = load_model(model_dir, attention_backend=backend, interpret=interpret)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    runner = PagedRunner(
        model,
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=kv_cache_head_dim(head_dim, backend),
    )
    seqs = runner.generate([PROMPTS[0], PROMPTS[1]], 6)
    for seq in seqs:
        ours = np.stack(seq.logits)
        ref = hf_logits(model_dir, seq.tokens)
        assert ours.shape == ref.shape
        assert relative_diff(ours, ref) < RTOL


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_hf_over_paged_cache(checkpoints, name):
    _paged_logits_match_hf(checkpoints[name])


@pytest.mark.skipif(
    not ON_GPU, reason="compiled Pallas kernels: GPU only (CPU runs interpret mode)"
)
@pytest.mark.parametrize("name", FAMILIES)
def test_compiled_pallas_kernels_match_hf_on_gpu(checkpoints, name):
    """On a GPU: Gemma-2's soft cap and windows, Phi-3's padded D in the Triton kernels."""
    _paged_logits_match_hf(checkpoints[name], "pallas")


def test_mixtral_logits_through_the_decode_experts_path_match_hf(checkpoints, monkeypatch):
    """Every MoE layer forced onto ``"gemv"`` (the GPU's decode path, interpreted on CPU):
    prefill and decode logits still equal HF's."""
    monkeypatch.setattr(models.moe, "experts_backend", lambda backend, num_rows: "gemv")
    gemv = models.moe.expert_gemv
    monkeypatch.setattr(models.moe, "expert_gemv",
                        lambda *a, **kw: gemv(*a, **{**kw, "interpret": True}))  # fmt: skip
    _paged_logits_match_hf(checkpoints["mixtral"])


def test_experts_backend_reads_only_the_chosen_experts_at_decode_sizes():
    assert experts_backend("mosaic_gpu", DECODE_MAX_ROWS) == "gemv"
    assert experts_backend("mosaic_gpu", DECODE_MAX_ROWS + 1) == "mosaic_gpu"
    assert experts_backend("xla", 2) == "xla"  # CPU and float32: XLA's exact ragged dot


def test_pallas_kernels_pad_a_head_dim_that_is_not_a_power_of_two(checkpoints):
    """Phi-3's D (24 here, 96 in Phi-3-mini) is zero-padded to 32 for the Pallas kernels (in
    interpret mode on CPU); the cache holds D = 32 and the logits still equal HF's."""
    assert kv_cache_head_dim(24, "pallas") == 32 and kv_cache_head_dim(24, "reference") == 24
    assert kv_cache_head_dim(128, "pallas") == 128
    _paged_logits_match_hf(checkpoints["phi3"], "pallas", interpret=True)


@pytest.mark.parametrize("name", FAMILIES)
def test_engine_greedy_matches_hf_with_chunked_prefill_prefix_caching_and_preemption(
    checkpoints, stories_dir, name
):
    path = checkpoints[name]
    expected = [_hf_greedy(path, p, MAX_TOKENS) for p in PROMPTS]
    llm = LLM(
        model=path,
        tokenizer=stories_dir,  # any tokenizer: prompts and outputs are token ids
        dtype="float32",
        block_size=8,
        num_gpu_blocks_override=6,
        enable_prefix_caching=True,
        max_model_len=32,
        max_num_seqs=4,
        max_num_batched_tokens=8,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def generate(prompts):
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    batched = generate(PROMPTS)
    assert [o.outputs[0].token_ids for o in batched] == expected
    assert llm.llm_engine.scheduler.num_preemptions > 0
    one_at_a_time = [generate([p])[0] for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in one_at_a_time] == expected
    # PROMPTS[2] runs after PROMPTS[0] alone: its two shared blocks come from the cache.
    assert one_at_a_time[2].num_cached_tokens == 16


# ------------------------------------------------------------------------ parts, no engine


def test_registry_lists_the_new_architectures():
    for arch in ("Qwen3ForCausalLM", "Gemma2ForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM"):
        assert arch in supported_architectures()
        assert get_model_class(types.SimpleNamespace(architectures=[arch])) is not None
    with pytest.raises(ValueError, match="'GemmaForCausalLM' is not supported.*Gemma2"):
        get_model_class(types.SimpleNamespace(architectures=["GemmaForCausalLM"]))


def test_unsupported_activation_and_longrope_are_refused_by_name(checkpoints, tmp_path):
    config = load_config(checkpoints["phi3"])
    config.hidden_act = "relu2"
    with pytest.raises(ValueError, match=r"hidden_act 'relu2' is not supported"):
        DecoderOptions.from_hf_config(config)
    # Phi-3 128k's rope: refused when the model is built, before any weight is read.
    with open(os.path.join(checkpoints["phi3"], "config.json")) as f:
        raw = json.load(f)
    raw.pop("rope_parameters", None)
    half = raw["hidden_size"] // raw["num_attention_heads"] // 2  # one factor per frequency
    raw["rope_scaling"] = {"type": "longrope", "short_factor": [1.0] * half,
                           "long_factor": [2.0] * half}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="rope_type 'longrope' is not supported"):
        load_model(str(tmp_path), load_format="dummy")


def test_fused_checkpoint_views_split_rows_by_the_configs_sizes():
    config = types.SimpleNamespace(
        num_attention_heads=4, num_key_value_heads=2, hidden_size=64, intermediate_size=96
    )
    names = {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"}
    views = fused_checkpoint_views(names, config)
    qkv, gate_up = sorted(names, reverse=True)
    assert views == {
        "model.layers.0.self_attn.q_proj.weight": (qkv, 0, 64),
        "model.layers.0.self_attn.k_proj.weight": (qkv, 64, 96),
        "model.layers.0.self_attn.v_proj.weight": (qkv, 96, 128),
        "model.layers.0.mlp.gate_proj.weight": (gate_up, 0, 96),
        "model.layers.0.mlp.up_proj.weight": (gate_up, 96, 192),
    }
    # A checkpoint holding the parts themselves is read as it is.
    assert fused_checkpoint_views({*names, "model.layers.0.self_attn.q_proj.weight"}, config)[
        "model.layers.0.self_attn.k_proj.weight"
    ] == (qkv, 64, 96)
    assert "model.layers.0.self_attn.q_proj.weight" not in fused_checkpoint_views(
        {*names, "model.layers.0.self_attn.q_proj.weight"}, config
    )


@pytest.mark.parametrize("backend", ["xla", "gemv"])
def test_grouped_experts_equal_a_dense_loop_over_experts(backend):
    """Routing and the expert matmuls (XLA's ragged dot over rows sorted by expert; the decode
    path's per-row expert GEMV, interpreted) against a per-token numpy loop; tokens pile onto a
    few experts and one expert gets none (empty group)."""
    rng = np.random.default_rng(0)
    num_tokens, hidden, inter, num_experts, top_k = 9, 8, 6, 5, 2
    x = rng.normal(size=(num_tokens, hidden)).astype(np.float32)
    logits = rng.normal(size=(num_tokens, num_experts)).astype(np.float32)
    logits[:, 4] = -1e9  # never chosen
    gate_up = rng.normal(size=(num_experts, hidden, 2 * inter)).astype(np.float32)
    down = rng.normal(size=(num_experts, inter, hidden)).astype(np.float32)
    weights, ids = route(logits, top_k)
    out = np.asarray(grouped_swiglu(x, weights, ids, gate_up, down, precision=None,
                                    backend=backend, interpret=True))  # fmt: skip

    expected = np.zeros_like(x)
    for t in range(num_tokens):
        chosen = np.argsort(-logits[t])[:top_k]
        p = np.exp(logits[t, chosen] - logits[t, chosen].max())
        p /= p.sum()
        for w, e in zip(p, chosen, strict=True):
            h = x[t] @ gate_up[e]
            g, u = h[:inter], h[inter:]
            expected[t] += w * ((g / (1 + np.exp(-g)) * u) @ down[e])
    np.testing.assert_array_equal(np.asarray(ids), np.argsort(-logits, axis=1)[:, :top_k])
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_missing_expert_tensor_is_named(checkpoints, tmp_path):
    """Mixtral's stacked experts are read from one tensor per expert; a missing one is named
    with the stacked parameter it belongs to."""
    import safetensors.numpy

    source = checkpoints["mixtral"]
    tensors = safetensors.numpy.load_file(os.path.join(source, "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    safetensors.numpy.save_file(tensors, str(tmp_path / "model.safetensors"))
    with open(os.path.join(source, "config.json")) as f:
        (tmp_path / "config.json").write_text(f.read())
    with pytest.raises(
        ValueError,
        match=r"block_sparse_moe\.experts\.down_proj .*'model\.layers\.1\.block_sparse_moe"
        r"\.experts\.3\.w2\.weight'\) is missing",
    ):
        load_model(str(tmp_path))
