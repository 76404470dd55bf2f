"""Shared fixtures for the model tests: tiny HF checkpoints and a paged-KV greedy runner.

The runner plays the engine's part by hand: it allocates KV blocks from a shuffled free list
(so block tables are permuted), fills the caches with NaN (stale data must never be read),
pads tokens and sequences to fixed buckets, and jits one pure function of the model state.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pallas_kernels
from models.attention_metadata import AttentionMetadata

STORIES_DIR = os.path.join(
    os.path.dirname(__file__), "..", "..", "jaxpaged", "model_data", "stories260k"
)

# Tiny configs: hidden 64, 2 layers, vocab 128, GQA 4/2, head_dim 16.
_TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.1,
    rms_norm_eps=1e-5,
)

TINY_CONFIGS = {
    # Llama 3.1 rope scaling with original length 32: with head_dim 16 and theta 1e4 the
    # wavelengths (6.3, 20, 63, ...) hit the kept, smoothed and divided bands; untied lm_head.
    "llama3": dict(
        architecture="LlamaForCausalLM",
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        tie_word_embeddings=False,
    ),
    # A sliding window shorter than the prompt, so it matters in prefill and decode.
    "mistral": dict(architecture="MistralForCausalLM", sliding_window=8, tie_word_embeddings=True),
    # Biases on all four attention projections and all three MLP ones.
    "llama_bias": dict(
        architecture="LlamaForCausalLM",
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=False,
    ),
    # q/k/v biases; layer 0 full attention, layer 1 sliding (max_window_layers=1).
    "qwen2": dict(
        architecture="Qwen2ForCausalLM",
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=1,
        tie_word_embeddings=True,
    ),
}


# The families beyond the first Llama-like ones (tests/models/test_families.py builds only these).
FAMILY_CONFIGS = {
    # Per-head q/k RMSNorm; untied lm_head; Qwen3's default head_dim (128) overridden.
    "qwen3": dict(architecture="Qwen3ForCausalLM", head_dim=16, tie_word_embeddings=False),
    # Layer 0 slides (window 6, shorter than the prompts), layer 1 is full; caps small enough
    # that tanh bends the random model's scores and logits; query_pre_attn_scalar != head_dim.
    "gemma2": dict(
        architecture="Gemma2ForCausalLM",
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=6,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    ),
    # Fused qkv_proj / gate_up_proj in the checkpoint; a window on every layer; D = 96 / 4 = 24,
    # not a power of two (like Phi-3-mini's 96), so the Pallas kernels need it padded.
    "phi3": dict(
        architecture="Phi3ForCausalLM",
        hidden_size=96,
        sliding_window=8,
        pad_token_id=0,
        eos_token_id=2,
        tie_word_embeddings=False,
    ),
    # 4 experts, top 2; expert intermediate size 32.
    "mixtral": dict(
        architecture="MixtralForCausalLM",
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=32,
        tie_word_embeddings=False,
    ),
}


def make_hf_config(name: str):
    """The transformers config of ``name`` (``TINY_CONFIGS`` or ``FAMILY_CONFIGS``)."""
    import transformers

    spec = dict({**TINY_CONFIGS, **FAMILY_CONFIGS}[name])
    arch = spec.pop("architecture")
    config_class = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "MistralForCausalLM": transformers.MistralConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "Qwen3ForCausalLM": transformers.Qwen3Config,
        "Gemma2ForCausalLM": transformers.Gemma2Config,
        "Phi3ForCausalLM": transformers.Phi3Config,
        "MixtralForCausalLM": transformers.MixtralConfig,
    }[arch]
    return config_class(**{**_TINY, **spec}, architectures=[arch])


def make_hf_checkpoint(path: str, name: str, *, dtype: str = "float32", seed: int = 0) -> str:
    """Saves a random-weight HF model of config ``name`` (``TINY_CONFIGS`` or
    ``FAMILY_CONFIGS``) to ``path``.

    HF's init leaves biases at zero and norm weights at one; both are randomised so that a
    forgotten bias or norm weight shows in the logits.
    """
    import torch
    import transformers

    config = make_hf_config(name)
    arch = config.architectures[0]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if pname.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif "norm" in pname:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, str]:
    """name -> directory of a saved float32 tiny checkpoint, for every ``TINY_CONFIGS`` entry."""
    pytest.importorskip("torch")
    root = tmp_path_factory.mktemp("ckpt")
    return {name: make_hf_checkpoint(str(root / name), name) for name in TINY_CONFIGS}


def hf_logits(model_dir: str, token_ids: list[int]) -> np.ndarray:
    """HF transformers (PyTorch, float32, eager attention) logits ``f32[len, vocab]``."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        out = model(torch.tensor([token_ids], dtype=torch.long)).logits[0]
    return out.numpy()


def relative_diff(ours: np.ndarray, ref: np.ndarray) -> float:
    """max |ours - ref| / max |ref|."""
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


@dataclasses.dataclass
class Seq:
    tokens: list[int]
    blocks: list[int]
    logits: list[np.ndarray]  # one f32[vocab] per token fed (the prediction for the next one)
    next_token: int = -1  # greedy token after the last one fed


@functools.cache
def _jitted_step(graphdef):
    """As in the engine: split once and jit a pure function of the state, so weights are
    arguments (not constants baked into the HLO) and NNX objects aren't re-traversed. One per
    model structure: models of the same structure (other weights) reuse its compilations."""

    def step(state, input_ids, positions, kv_caches, metadata):
        m = nnx.merge(graphdef, state)
        hidden, kv_caches = m(input_ids, positions, kv_caches, metadata)
        return m.compute_logits(hidden), kv_caches

    return jax.jit(step)


class PagedRunner:
    """Greedy generation through a model over a real paged KV cache.

    Args:
        model: a ``LlamaForCausalLM``.
        num_kv_heads, head_dim: of the model's config.
        token_bucket: ``T`` of prefill steps; ``seq_bucket``: ``B`` of every step (``T`` of
            decode steps).
        cache_dtype: dtype of the KV caches, which start filled with NaN.
    """

    def __init__(
        self,
        model,
        *,
        num_layers,
        num_kv_heads,
        head_dim,
        block_size=4,
        num_blocks=64,
        max_blocks=16,
        token_bucket=32,
        seq_bucket=2,
        seed=0,
        cache_dtype=jnp.float32,
    ):
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.token_bucket = token_bucket
        self.seq_bucket = seq_bucket
        shape = pallas_kernels.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
        nan = jnp.full(shape, jnp.nan, dtype=cache_dtype)
        self.kv_caches = [(nan, nan) for _ in range(num_layers)]
        # Block 0 stays unallocated: padding rows and columns of the block table point at it.
        self.free = list(np.random.default_rng(seed).permutation(np.arange(1, num_blocks)))
        graphdef, self.state = nnx.split(model)
        self._step = _jitted_step(graphdef)

    def _slot(self, seq: Seq, pos: int) -> int:
        while pos // self.block_size >= len(seq.blocks):
            seq.blocks.append(int(self.free.pop()))
        return seq.blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def run_step(self, chunks: list[tuple[Seq, list[int]]], *, decode_only: bool):
        """Feeds ``chunks[b] = (seq, new_tokens)``; appends each token's logits to its seq."""
        num_tokens = self.seq_bucket if decode_only else self.token_bucket
        input_ids = np.zeros(num_tokens, np.int32)
        positions = np.zeros(num_tokens, np.int32)
        slots = np.full(num_tokens, -1, np.int32)
        tables = np.zeros((self.seq_bucket, self.max_blocks), np.int32)
        seq_lens = np.zeros(self.seq_bucket, np.int32)
        cu = np.zeros(self.seq_bucket + 1, np.int32)
        t = 0
        for b, (seq, new) in enumerate(chunks):
            start = len(seq.tokens)
            seq.tokens.extend(new)
            for i, tok in enumerate(new):
                input_ids[t + i] = tok
                positions[t + i] = start + i
                slots[t + i] = self._slot(seq, start + i)
            tables[b, : len(seq.blocks)] = seq.blocks
            seq_lens[b] = len(seq.tokens)
            t += len(new)
            cu[b + 1] = t
        cu[len(chunks) + 1 :] = t
        metadata = AttentionMetadata(
            slot_mapping=jnp.asarray(slots),
            block_tables=jnp.asarray(tables),
            seq_lens=jnp.asarray(seq_lens),
            cu_q_lens=jnp.asarray(cu),
            decode_only=decode_only,
        )
        logits, self.kv_caches = self._step(
            self.state, jnp.asarray(input_ids), jnp.asarray(positions), self.kv_caches, metadata
        )
        logits = np.asarray(logits)
        for b, (seq, new) in enumerate(chunks):
            seq.logits.extend(logits[cu[b] : cu[b] + len(new)])

    def generate(self, prompts: list[list[int]], num_new: int) -> list[Seq]:
        """Prefills all prompts in one ragged step, then ``num_new - 1`` greedy decode steps.

        Each returned seq has fed ``len(prompt) + num_new - 1`` tokens through the model
        (``tokens``), ``logits[i]`` predicting token ``i + 1``; the last greedy token is
        ``next_token``, so the greedy continuation is ``tokens[len(prompt):] + [next_token]``.
        """
        seqs = [Seq(tokens=[], blocks=[], logits=[]) for _ in prompts]
        self.run_step(list(zip(seqs, prompts, strict=True)), decode_only=False)
        for _ in range(num_new - 1):
            chunks = [(s, [int(np.argmax(s.logits[-1]))]) for s in seqs]
            self.run_step(chunks, decode_only=True)
        for s in seqs:
            s.next_token = int(np.argmax(s.logits[-1]))
        return seqs
