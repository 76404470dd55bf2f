"""An out-of-tree model for jaxpaged: a small Llama written from scratch against the public
model protocol (``docs/model_protocol.md``), importing nothing of jaxpaged but
``jaxpaged.model_api``.

Use it from Python::

    import my_llama  # registers "MyLlamaForCausalLM"
    from jaxpaged import LLM
    llm = LLM("path/to/checkpoint")  # config.json: "architectures": ["MyLlamaForCausalLM"]

or serve it (the engine-core process imports the module before it builds the model)::

    PYTHONPATH=examples jaxpaged serve path/to/checkpoint --model-impl-module my_llama

The checkpoint is an ordinary HF Llama directory (``config.json`` with ``model_type: llama``
and this architecture name, ``model.safetensors`` with HF's tensor names). Parameters are named
by their HF tensor: the module path ``model.layers.0.self_attn.q_proj`` with leaf ``kernel``
(``[in, out]``, HF's ``weight`` transposed), ``embedding`` (``nnx.Embed``) or ``weight`` (norms).

``MyLlamaForCausalLM.dense_logits`` runs the same weights without the paged cache (plain causal
softmax attention over one sequence): the reference the engine's outputs are checked against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpaged.model_api import AttentionMetadata, ModelRegistry, paged_attention


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, HF Llama's "rotate half" form: ``x [T, H, D]``, ``positions i32[T]``."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype, param_dtype):
        self.eps, self.dtype = eps, dtype
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + self.eps)
        return (self.weight[...].astype(jnp.float32) * y).astype(self.dtype)


class Attention(nnx.Module):
    def __init__(self, config, *, dtype, param_dtype, attention_backend, interpret, rngs):
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        # transformers >= 5 keeps rope_theta in rope_parameters
        rope_parameters = getattr(config, "rope_parameters", None) or {}
        self.theta = float(getattr(config, "rope_theta", None) or rope_parameters["rope_theta"])
        self.attention_backend, self.interpret = attention_backend, interpret

        def linear(n_in, n_out):
            return nnx.Linear(n_in, n_out, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                              precision=jax.lax.Precision.HIGHEST, rngs=rngs)  # fmt: skip

        hidden, d = config.hidden_size, self.head_dim
        self.q_proj = linear(hidden, self.num_heads * d)
        self.k_proj = linear(hidden, self.num_kv_heads * d)
        self.v_proj = linear(hidden, self.num_kv_heads * d)
        self.o_proj = linear(self.num_heads * d, hidden)

    def qkv(self, x, positions):
        t, d = x.shape[0], self.head_dim
        q = rope(self.q_proj(x).reshape(t, self.num_heads, d), positions, self.theta)
        k = rope(self.k_proj(x).reshape(t, self.num_kv_heads, d), positions, self.theta)
        return q, k, self.v_proj(x).reshape(t, self.num_kv_heads, d)

    def __call__(self, x, positions, k_cache, v_cache, metadata: AttentionMetadata):
        q, k, v = self.qkv(x, positions)
        out, k_cache, v_cache = paged_attention(
            q, k, v, k_cache, v_cache, metadata,
            scale=self.head_dim**-0.5,
            attention_backend=self.attention_backend,
            interpret=self.interpret,
        )  # fmt: skip
        return self.o_proj(out.reshape(x.shape[0], -1)), k_cache, v_cache

    def dense(self, x, positions):
        """One whole sequence with causal softmax attention (no cache): the reference."""
        q, k, v = self.qkv(x, positions)
        group = self.num_heads // self.num_kv_heads
        k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
        scores = jnp.einsum("thd,shd->hts", q.astype(jnp.float32), k.astype(jnp.float32))
        scores = scores * self.head_dim**-0.5
        t = x.shape[0]
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -jnp.inf)
        out = jnp.einsum("hts,shd->thd", jax.nn.softmax(scores, -1), v.astype(jnp.float32))
        return self.o_proj(out.reshape(t, -1).astype(x.dtype))


class MLP(nnx.Module):
    def __init__(self, config, *, dtype, param_dtype, rngs):
        kw = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype,
                  precision=jax.lax.Precision.HIGHEST, rngs=rngs)  # fmt: skip
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_proj = nnx.Linear(hidden, inter, **kw)
        self.up_proj = nnx.Linear(hidden, inter, **kw)
        self.down_proj = nnx.Linear(inter, hidden, **kw)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, config, *, dtype, param_dtype, attention_backend, interpret, rngs):
        norm = dict(dim=config.hidden_size, eps=config.rms_norm_eps, dtype=dtype,
                    param_dtype=param_dtype)  # fmt: skip
        self.input_layernorm = RMSNorm(**norm)
        self.self_attn = Attention(config, dtype=dtype, param_dtype=param_dtype,
                                   attention_backend=attention_backend, interpret=interpret,
                                   rngs=rngs)  # fmt: skip
        self.post_attention_layernorm = RMSNorm(**norm)
        self.mlp = MLP(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, positions, k_cache, v_cache, metadata):
        h, k_cache, v_cache = self.self_attn(
            self.input_layernorm(x), positions, k_cache, v_cache, metadata
        )
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), k_cache, v_cache

    def dense(self, x, positions):
        x = x + self.self_attn.dense(self.input_layernorm(x), positions)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nnx.Module):  # HF's "model." prefix
    def __init__(self, config, **kw):
        dtype, param_dtype, rngs = kw["dtype"], kw["param_dtype"], kw["rngs"]
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype,
                                      param_dtype=param_dtype, rngs=rngs)  # fmt: skip
        self.layers = nnx.List(
            [DecoderLayer(config, **kw) for _ in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype,
                            param_dtype=param_dtype)  # fmt: skip


class MyLlamaForCausalLM(nnx.Module):
    """The protocol: built as ``cls(hf_config, dtype=, param_dtype=, attention_backend=,
    interpret=, rngs=)``; ``__call__(input_ids i32[T], positions i32[T], kv_caches, metadata)
    -> (hidden [T, hidden_size], kv_caches)``; ``compute_logits(hidden [N, hidden_size]) ->
    f32[N, vocab_size]``."""

    def __init__(self, config, *, dtype, param_dtype, attention_backend, interpret, rngs):
        self.model = Body(config, dtype=dtype, param_dtype=param_dtype,
                          attention_backend=attention_backend, interpret=interpret, rngs=rngs)  # fmt: skip
        self.lm_head = nnx.data(None)  # tied: logits from the embedding matrix
        if not getattr(config, "tie_word_embeddings", False):
            self.lm_head = nnx.Linear(config.hidden_size, config.vocab_size, use_bias=False,
                                      dtype=dtype, param_dtype=param_dtype, rngs=rngs)  # fmt: skip

    def __call__(self, input_ids, positions, kv_caches, metadata):
        x = self.model.embed_tokens(input_ids)
        new_caches = []
        for layer, (k_cache, v_cache) in zip(self.model.layers, kv_caches, strict=True):
            x, k_cache, v_cache = layer(x, positions, k_cache, v_cache, metadata)
            new_caches.append((k_cache, v_cache))
        return self.model.norm(x), new_caches

    def compute_logits(self, hidden):
        if self.lm_head is None:
            weight = self.model.embed_tokens.embedding[...]  # [vocab, hidden]
        else:
            weight = self.lm_head.kernel[...].T
        return jnp.einsum("nh,vh->nv", hidden, weight.astype(hidden.dtype),
                          preferred_element_type=jnp.float32,
                          precision=jax.lax.Precision.HIGHEST)  # fmt: skip

    def dense_logits(self, input_ids):
        """``i32[T] -> f32[T, vocab_size]``: one sequence without the paged cache."""
        positions = jnp.arange(input_ids.shape[0], dtype=jnp.int32)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer.dense(x, positions)
        return self.compute_logits(self.model.norm(x))


ModelRegistry.register_model("MyLlamaForCausalLM", MyLlamaForCausalLM)
