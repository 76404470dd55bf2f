"""Logits parity of models.llama with HF transformers (PyTorch, float32) over a paged KV cache."""

from __future__ import annotations

import json
import os
import types

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from models.attention import attention
from models.attention_metadata import AttentionMetadata
from models.llama import LlamaForCausalLM, layer_sliding_windows, rope_inv_freq, rope_parameters
from models.weights import load_model
from tests.models.conftest import STORIES_DIR, PagedRunner, Seq, hf_logits, relative_diff

# float32 on both sides; the differences are summation order only (measured ~1e-6).
RTOL = 1e-4
PROMPT_LEN = 13
NUM_DECODE = 20


def _runner(model, config, **kw) -> PagedRunner:
    return PagedRunner(
        model,
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=getattr(config, "head_dim", None)
        or config.hidden_size // config.num_attention_heads,
        **kw,
    )


def _check_parity(model_dir: str, backend: str, *, interpret: bool = False) -> float:
    """Two prompts (13 and 7 tokens) prefilled in one ragged step, then 20 batched greedy decode
    steps, against HF full-sequence logits at every position; returns the worst relative diff."""
    model, config = load_model(model_dir, attention_backend=backend, interpret=interpret)
    rng = np.random.default_rng(1)
    prompts = [
        [int(x) for x in rng.integers(3, config.vocab_size, size=n)] for n in (PROMPT_LEN, 7)
    ]
    seqs = _runner(model, config).generate(prompts, NUM_DECODE + 1)
    worst = 0.0
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert len(seq.tokens) == len(prompt) + NUM_DECODE
        ref = hf_logits(model_dir, seq.tokens)
        ours = np.stack(seq.logits)
        assert ours.shape == ref.shape
        worst = max(worst, relative_diff(ours, ref))
    name = os.path.basename(model_dir)
    print(f"\n{name} backend={backend}: max relative logits diff {worst:.2e}")
    return worst


@pytest.mark.parametrize("name", ["llama3", "llama_bias", "mistral", "qwen2"])
def test_tiny_config_logits_match_hf(tiny_checkpoints, name):
    assert _check_parity(tiny_checkpoints[name], "reference") < RTOL


def test_stories260k_logits_match_hf():
    pytest.importorskip("torch")
    assert _check_parity(STORIES_DIR, "reference") < RTOL


def test_pallas_backend_in_interpret_mode_matches_hf(tiny_checkpoints):
    pytest.importorskip("torch")
    assert _check_parity(tiny_checkpoints["llama3"], "pallas", interpret=True) < RTOL


def test_stories260k_batched_greedy_matches_golden():
    """All five golden prompts in one batch: ragged prefill of 5 sequences, 31 decode steps."""
    with open(
        os.path.join(os.path.dirname(__file__), "..", "data", "stories260k", "golden.json")
    ) as f:
        golden = json.load(f)
    model, config = load_model(STORIES_DIR)
    cases = golden["cases"]
    runner = _runner(model, config, token_bucket=64, seq_bucket=8, max_blocks=16, num_blocks=128)
    seqs = runner.generate([c["prompt_ids"] for c in cases], golden["max_new_tokens"])
    for seq, case in zip(seqs, cases, strict=True):
        n = len(case["prompt_ids"])
        assert seq.tokens[n:] + [seq.next_token] == case["greedy_new_ids"], case["prompt"]
        top5 = case["prompt_last_logits_top5"]
        np.testing.assert_allclose(seq.logits[n - 1][top5["ids"]], top5["logits"], atol=1e-3)


def test_chunked_prefill_over_cached_prefix_matches_hf():
    """A prompt prefilled in two chunks (the second attends to the cached first) while another
    sequence prefills in the same step."""
    pytest.importorskip("torch")
    model, config = load_model(STORIES_DIR)
    runner = _runner(model, config, token_bucket=16, seq_bucket=2)
    prompt_a = [1, 317, 269, 274, 287, 263, 377, 267, 265, 282, 295, 433, 426]
    prompt_b = [1, 403, 407, 261, 378]
    seq_a, seq_b = Seq([], [], []), Seq([], [], [])
    runner.run_step([(seq_a, prompt_a[:8])], decode_only=False)
    runner.run_step([(seq_a, prompt_a[8:]), (seq_b, prompt_b)], decode_only=False)
    for seq in (seq_a, seq_b):
        diff = relative_diff(np.stack(seq.logits), hf_logits(STORIES_DIR, seq.tokens))
        assert diff < RTOL


def test_bfloat16_model_runs_with_bfloat16_cache_and_float32_logits():
    pytest.importorskip("torch")
    model, config = load_model(STORIES_DIR, dtype="bfloat16")
    runner = _runner(model, config, cache_dtype=jnp.bfloat16)
    prompt = [1, 317, 269, 274, 287, 263, 377, 267, 265, 282, 295, 433, 426]
    (seq,) = runner.generate([prompt], 4)
    assert runner.kv_caches[0][0].dtype == jnp.bfloat16
    assert all(row.dtype == np.float32 for row in seq.logits)
    # bf16 keeps ~3 significant digits; 5 layers of rounding stay within a few percent.
    assert relative_diff(np.stack(seq.logits), hf_logits(STORIES_DIR, seq.tokens)) < 5e-2


def test_rope_parameters_reads_legacy_and_v5_configs():
    legacy = types.SimpleNamespace(
        rope_theta=500000.0,
        rope_scaling={"type": "linear", "factor": 2.0},
        max_position_embeddings=64,
    )
    assert rope_parameters(legacy) == {
        "type": "linear",
        "factor": 2.0,
        "rope_theta": 500000.0,
        "rope_type": "linear",
    }
    none = types.SimpleNamespace(rope_theta=10000.0, rope_scaling=None, max_position_embeddings=8)
    assert rope_parameters(none)["rope_type"] == "default"
    v5 = types.SimpleNamespace(
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 1e4,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
        max_position_embeddings=32,
    )
    assert rope_parameters(v5)["original_max_position_embeddings"] == 32


def test_unsupported_rope_type_raises():
    config = types.SimpleNamespace(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4})
    with pytest.raises(ValueError, match="yarn"):
        rope_parameters(config)


@pytest.mark.parametrize("rope_type", ["default", "linear", "llama3"])
def test_rope_inv_freq_matches_hf(rope_type):
    pytest.importorskip("torch")
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {
        "default": None,
        "linear": {"rope_type": "linear", "factor": 4.0},
        "llama3": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    }[rope_type]
    config = transformers.LlamaConfig(
        hidden_size=128,
        num_attention_heads=2,
        head_dim=64,
        rope_scaling=scaling,
        max_position_embeddings=64,
    )
    if rope_type == "default":
        ref = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config).inv_freq
    else:
        ref, _ = ROPE_INIT_FUNCTIONS[rope_type](config, None)
    ours = rope_inv_freq(64, rope_parameters(config))
    np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-6)


def test_sliding_windows_follow_layer_types():
    qwen = types.SimpleNamespace(
        sliding_window=6,
        num_hidden_layers=3,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
    )
    assert layer_sliding_windows(qwen) == [None, 6, 6]
    mistral = types.SimpleNamespace(sliding_window=None, num_hidden_layers=2)
    assert layer_sliding_windows(mistral) == [None, None]


def test_unknown_attention_backend_raises():
    metadata = AttentionMetadata(
        slot_mapping=jnp.zeros(1, jnp.int32),
        block_tables=jnp.zeros((1, 1), jnp.int32),
        seq_lens=jnp.ones(1, jnp.int32),
        cu_q_lens=jnp.array([0, 1], jnp.int32),
        decode_only=True,
    )
    cache = jnp.zeros((1, 4, 1, 8))
    with pytest.raises(ValueError, match="flash"):
        attention(jnp.zeros((1, 2, 8)), cache, cache, metadata, backend="flash", scale=1.0)
    with pytest.raises(ValueError, match="flash"):
        LlamaForCausalLM(
            types.SimpleNamespace(),
            dtype=jnp.float32,
            param_dtype=jnp.float32,
            attention_backend="flash",
            rngs=None,
        )


def _one_sequence_prefill(n: int, block_size: int = 4) -> AttentionMetadata:
    """Metadata of one sequence prefilling ``n`` tokens into blocks 0, 1, ... in order."""
    blocks = -(-n // block_size)
    return AttentionMetadata(
        slot_mapping=jnp.arange(n, dtype=jnp.int32),
        block_tables=jnp.arange(blocks, dtype=jnp.int32)[None, :],
        seq_lens=jnp.asarray([n], jnp.int32),
        cu_q_lens=jnp.asarray([0, n], jnp.int32),
        decode_only=False,
    )


def test_aux_hidden_states_are_the_residual_stream_entering_each_layer():
    """EAGLE-3's hook: index i < L is HF's ``hidden_states[i]`` (the input of layer i); index L
    is the last layer's output before the final norm (HF reports it after the norm)."""
    torch = pytest.importorskip("torch")
    import transformers

    model, config = load_model(STORIES_DIR)
    tokens = [1, 317, 269, 274, 287, 263, 377, 267, 265, 282, 295]
    n, num_layers = len(tokens), config.num_hidden_layers
    shape = pallas_kernels.kv_cache_shape(4, 4, config.num_key_value_heads, config.head_dim)
    caches = [(jnp.zeros(shape), jnp.zeros(shape)) for _ in range(num_layers)]
    layers = (num_layers, 2, 0, 2)  # any order, repeats allowed, L included
    hidden, _, aux = model(
        jnp.asarray(tokens, jnp.int32), jnp.arange(n, dtype=jnp.int32), caches,
        _one_sequence_prefill(n), aux_hidden_state_layers=layers,
    )  # fmt: skip
    plain, _ = model(
        jnp.asarray(tokens, jnp.int32), jnp.arange(n, dtype=jnp.int32), caches,
        _one_sequence_prefill(n),
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(hidden), np.asarray(plain))
    hf = transformers.AutoModelForCausalLM.from_pretrained(STORIES_DIR, dtype=torch.float32)
    with torch.no_grad():
        states = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    aux = np.asarray(aux).reshape(n, len(layers), config.hidden_size)
    for j, layer in enumerate(layers[1:], start=1):
        assert relative_diff(aux[:, j], states[layer][0].numpy()) < RTOL, layer
    # Index L: the final norm of it is the model's output hidden state.
    np.testing.assert_allclose(
        np.asarray(model.model.norm(jnp.asarray(aux[:, 0]))), np.asarray(hidden), rtol=1e-5,
        atol=1e-6,
    )  # fmt: skip
    assert relative_diff(np.asarray(hidden), states[num_layers][0].numpy()) < RTOL
