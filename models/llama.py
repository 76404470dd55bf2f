"""The Llama model family in Flax NNX: Llama 2/3, Mistral and Qwen2, driven by the HF config.

One class serves every member; the Hugging Face config decides the differences:

- GQA: ``num_key_value_heads`` (defaults to ``num_attention_heads``).
- ``head_dim`` from the config, else ``hidden_size // num_attention_heads``.
- Biases: Qwen2 has q/k/v biases and no o_proj bias; Llama's ``attention_bias`` puts a bias on all
  four projections; ``mlp_bias`` on the MLP projections.
- RoPE (Su et al. 2021, "RoFormer", arXiv:2104.09864) in the Hugging Face *rotate-half* layout,
  with ``rope_type`` ``"default"``, ``"linear"`` or ``"llama3"`` (Meta's Llama 3.1 reference
  ``apply_scaling``; the same numbers as HF ``_compute_llama3_parameters``).
- Sliding window: Mistral's ``sliding_window`` applies to every layer (``None`` = full attention);
  configs with ``layer_types`` (Qwen2) use it only on ``"sliding_attention"`` layers.
- Tied (``tie_word_embeddings``) or separate ``lm_head``.

Each layer runs two projections of its normed input where HF runs five: ``self_attn.qkv_proj``
fuses ``q_proj``/``k_proj``/``v_proj`` and ``mlp.gate_up_proj`` fuses ``gate_proj``/``up_proj``
(vLLM's ``QKVParallelLinear`` / ``MergedColumnParallelLinear``; ``models.merged_linear`` gives
the column order, shard by shard under tensor parallelism). Every other parameter path mirrors
the HF name (``model.layers.0.self_attn.o_proj`` etc.), and ``models.weights.hf_names`` maps
each fused parameter to its parts' HF tensors. Kernels are stored ``[in, out]`` (HF
``[out, in]``), embeddings ``[vocab, hidden]``. Shape letters (``T``, ``Hq``, ``Hkv``, ``D``) as
in ``pallas_kernels``.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

import pallas_kernels
from models.attention import attention
from models.attention_metadata import AttentionMetadata
from models.lora import LoRABatch, LoRALayer, llama_projection_specs, with_lora
from models.merged_linear import MergedColumnParallelLinear
from models.sharding import tp_size

_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


# ------------------------------------------------------------------------------------------------
# RoPE


def rope_parameters(config: Any) -> dict[str, Any]:
    """The RoPE parameters of an HF config as one dict with ``rope_type`` and ``rope_theta``.

    transformers 5 keeps them in ``config.rope_parameters``; older configs carry ``rope_theta``
    plus an optional ``rope_scaling`` dict whose type key is ``rope_type`` or the legacy ``type``.
    Both are read; ``rope_parameters`` wins when present.

    Raises:
        ValueError: a rope type other than "default", "linear" or "llama3", or a
            ``partial_rotary_factor`` other than 1.
    """
    params = getattr(config, "rope_parameters", None)
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
    else:
        params = dict(params)
    if "rope_theta" not in params or params["rope_theta"] is None:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported; supported: {list(_SUPPORTED_ROPE_TYPES)}"
        )
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if partial is not None and partial != 1.0:
        raise ValueError(f"partial_rotary_factor must be 1.0, got {partial}")
    if rope_type == "llama3" and "original_max_position_embeddings" not in params:
        params["original_max_position_embeddings"] = config.max_position_embeddings
    return params


def rope_inv_freq(head_dim: int, params: dict[str, Any]) -> np.ndarray:
    """Inverse frequencies ``f32[D // 2]`` of RoPE, after the configured scaling.

    ``inv_freq[i] = theta ** (-2i / D)`` (Su et al. 2021). ``"linear"`` divides all of them by
    ``factor``. ``"llama3"`` (Meta's Llama 3.1 reference, HF ``_compute_llama3_parameters``)
    keeps wavelengths shorter than ``original_max_position_embeddings / high_freq_factor``,
    divides those longer than ``original_max_position_embeddings / low_freq_factor`` by
    ``factor`` and interpolates smoothly in between. Computed in float32 like HF.

    Args:
        head_dim: ``D``, even.
        params: the output of :func:`rope_parameters`.
    """
    theta = np.float32(params["rope_theta"])
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / theta**exponent).astype(np.float32)
    rope_type = params["rope_type"]
    if rope_type == "linear":
        inv_freq = inv_freq / np.float32(params["factor"])
    elif rope_type == "llama3":
        factor = params["factor"]
        low_freq_factor = params["low_freq_factor"]
        high_freq_factor = params["high_freq_factor"]
        old_context_len = params["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = np.float32(2 * math.pi) / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / np.float32(factor), inv_freq)
        band = high_freq_factor - low_freq_factor
        smooth = (old_context_len / wavelen - low_freq_factor) / band
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = np.where(is_medium, smoothed, scaled)
    return np.asarray(inv_freq, dtype=np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotates ``x[T, H, D]`` by the angles ``positions[T] * inv_freq`` (rotate-half layout).

    Dimension ``i < D/2`` pairs with ``i + D/2`` (HF convention, not GPT-J's adjacent pairs).
    Angles, cos and sin are computed in float32 from the integer positions; the result has
    ``x``'s dtype.
    """
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, None, :]  # [T, 1, D]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


# ------------------------------------------------------------------------------------------------
# Layers


def _precision(dtype: jnp.dtype) -> jax.lax.Precision:
    # float32 is the parity/test dtype: ask for true f32 matmuls (GPUs would otherwise use TF32).
    if jnp.dtype(dtype) == jnp.float32:
        return jax.lax.Precision.HIGHEST
    return jax.lax.Precision.DEFAULT


class RMSNorm(nnx.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in float32.

    ``y = weight * x / sqrt(mean(x^2) + eps)``; input ``[..., hidden]`` any float dtype, output in
    the compute ``dtype``. The parameter is named ``weight`` as in HF.
    """

    def __init__(self, dim: int, *, eps: float, dtype: Any, param_dtype: Any, rngs: nnx.Rngs):
        del rngs  # ones-initialised; kept for the common module signature
        self.eps = float(eps)
        self.dtype = dtype
        self.weight = nnx.Param(jnp.ones((dim,), dtype=param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        y = x32 * jax.lax.rsqrt(var + self.eps)
        return (self.weight[...].astype(jnp.float32) * y).astype(self.dtype)


class LlamaMLP(nnx.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))``; ``[T, hidden] -> [T, hidden]``.

    ``gate_up_proj``: kernel ``[hidden, 2 * intermediate]`` (gate then up, per shard of
    ``num_shards``), one matmul; ``down_proj``: ``[intermediate, hidden]``.
    """

    def __init__(self, config: Any, *, num_shards: int, dtype: Any, param_dtype: Any,
                 rngs: nnx.Rngs):
        hidden, inter = config.hidden_size, config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        kw = dict(use_bias=bias, dtype=dtype, param_dtype=param_dtype,
                  precision=_precision(dtype), rngs=rngs)
        self.gate_up_proj = MergedColumnParallelLinear(hidden, (inter, inter),
                                                       num_shards=num_shards, **kw)
        self.down_proj = nnx.Linear(inter, hidden, **kw)

    def __call__(self, x: jax.Array, lora: LoRALayer | None = None) -> jax.Array:
        delta = None if lora is None else lora.delta("gate_up_proj", x)
        gate, up = self.gate_up_proj(x, delta)  # each [T, intermediate]
        h = jax.nn.silu(gate) * up
        return with_lora(lora, "down_proj", h, self.down_proj(h))


def _attention_biases(config: Any) -> tuple[bool, bool]:
    """(q/k/v bias, o_proj bias) for the config's family."""
    if getattr(config, "model_type", None) == "qwen2":
        return True, False
    bias = bool(getattr(config, "attention_bias", False))
    return bias, bias


class LlamaAttention(nnx.Module):
    """Self-attention over the paged KV cache.

    ``[T, hidden] -> [T, hidden]``: QKV projection (one matmul, ``qkv_proj`` kernel
    ``[hidden, (Hq + 2 * Hkv) * D]``), RoPE, ``pallas_kernels.kv_cache_update`` by
    ``metadata.slot_mapping``, :func:`models.attention.attention`, o_proj. ``attention_backend``,
    ``interpret`` and ``sliding_window`` are static Python attributes.
    """

    def __init__(
        self,
        config: Any,
        *,
        sliding_window: int | None,
        dtype: Any,
        param_dtype: Any,
        attention_backend: str,
        interpret: bool,
        mesh: Mesh | None = None,
        rngs: nnx.Rngs,
    ):
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        self.scale = self.head_dim**-0.5
        self.sliding_window = sliding_window
        self.attention_backend = attention_backend
        self.interpret = interpret
        self.mesh = mesh  # static: tensor parallelism runs attention per device on its heads
        # A tuple of Python floats: a static attribute (not a parameter), constant under jit.
        inv_freq = rope_inv_freq(self.head_dim, rope_parameters(config))
        self.inv_freq = tuple(float(f) for f in inv_freq)
        qkv_bias, o_bias = _attention_biases(config)
        kw = dict(dtype=dtype, param_dtype=param_dtype, precision=_precision(dtype), rngs=rngs)
        hidden = config.hidden_size
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedColumnParallelLinear(
            hidden, (q_size, kv_size, kv_size), num_shards=tp_size(mesh), use_bias=qkv_bias, **kw
        )
        self.o_proj = nnx.Linear(self.num_heads * self.head_dim, hidden, use_bias=o_bias, **kw)

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        k_cache: jax.Array,
        v_cache: jax.Array,
        metadata: AttentionMetadata,
        lora: LoRALayer | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x, None if lora is None else lora.delta("qkv_proj", x))
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        inv_freq = np.asarray(self.inv_freq, dtype=np.float32)
        q = apply_rope(q, positions, inv_freq)
        k = apply_rope(k, positions, inv_freq)
        k_cache, v_cache = pallas_kernels.kv_cache_update(
            k_cache, v_cache, k.astype(k_cache.dtype), v.astype(v_cache.dtype),
            metadata.slot_mapping,
        )
        out = attention(
            q, k_cache, v_cache, metadata,
            backend=self.attention_backend,
            scale=self.scale,
            sliding_window=self.sliding_window,
            interpret=self.interpret,
            mesh=self.mesh,
        )
        out = out.astype(x.dtype).reshape(num_tokens, self.num_heads * self.head_dim)
        return with_lora(lora, "o_proj", out, self.o_proj(out)), k_cache, v_cache


class LlamaDecoderLayer(nnx.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: Any, *, sliding_window: int | None, dtype: Any, param_dtype: Any,
                 attention_backend: str, interpret: bool, mesh: Mesh | None = None,
                 rngs: nnx.Rngs):
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps, dtype=dtype,
                                       param_dtype=param_dtype, rngs=rngs)
        self.self_attn = LlamaAttention(
            config, sliding_window=sliding_window, dtype=dtype, param_dtype=param_dtype,
            attention_backend=attention_backend, interpret=interpret, mesh=mesh, rngs=rngs,
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=eps, dtype=dtype,
                                                param_dtype=param_dtype, rngs=rngs)
        self.mlp = LlamaMLP(config, num_shards=tp_size(mesh), dtype=dtype,
                            param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, positions, k_cache, v_cache, metadata, lora: LoRALayer | None = None):
        attn_out, k_cache, v_cache = self.self_attn(
            self.input_layernorm(x), positions, k_cache, v_cache, metadata, lora
        )
        x = x + attn_out
        x = x + self.mlp(self.post_attention_layernorm(x), lora)
        return x, k_cache, v_cache


def layer_sliding_windows(config: Any) -> list[int | None]:
    """Sliding window per layer (``None`` = full attention).

    Configs with ``layer_types`` (Qwen2) apply ``sliding_window`` to ``"sliding_attention"``
    layers only; otherwise (Mistral) ``sliding_window`` applies to all layers; Llama has none.
    """
    window = getattr(config, "sliding_window", None)
    num_layers = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return [window if t == "sliding_attention" else None for t in layer_types[:num_layers]]
    return [window] * num_layers


class LlamaModel(nnx.Module):
    """Embedding, decoder layers and final norm: ``i32[T] -> [T, hidden]``."""

    def __init__(self, config: Any, *, dtype: Any, param_dtype: Any, attention_backend: str,
                 interpret: bool, mesh: Mesh | None = None, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype,
                                      param_dtype=param_dtype, rngs=rngs)
        self.layers = nnx.List([
            LlamaDecoderLayer(config, sliding_window=window, dtype=dtype, param_dtype=param_dtype,
                              attention_backend=attention_backend, interpret=interpret, mesh=mesh,
                              rngs=rngs)
            for window in layer_sliding_windows(config)
        ])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype,
                            param_dtype=param_dtype, rngs=rngs)

    def __call__(self, input_ids, positions, kv_caches, metadata, lora: LoRABatch | None = None):
        x = self.embed_tokens(input_ids)
        new_caches = []
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            layer_lora = None if lora is None else lora.layer(i)
            x, k_cache, v_cache = layer(x, positions, k_cache, v_cache, metadata, layer_lora)
            new_caches.append((k_cache, v_cache))
        return self.norm(x), new_caches


class LlamaForCausalLM(nnx.Module):
    """Llama / Mistral / Qwen2 causal LM over a paged KV cache.

    Multi-LoRA (``models.lora``): ``__call__``'s ``lora`` adds each token's adapter to the
    seven projections (q/k/v/o/gate/up/down); ``lora_projection_specs`` gives their sizes.

    Args:
        config: a transformers ``PretrainedConfig`` of the Llama family.
        dtype: compute dtype (activations, matmuls); norms, RoPE and softmax run in float32.
        param_dtype: dtype the parameters are stored in.
        attention_backend: "reference" (gather + plain-JAX references) or "pallas" (kernels);
            a static attribute, fixed for the life of the module.
        interpret: run Pallas kernels in interpret mode (CPU tests).
        mesh: tensor parallelism (``models.sharding``): attention runs per device on its heads
            and the fused projections lay their columns out per shard of the ``tp`` axis
            (``models.merged_linear``); None on one device. Build ``config`` with
            ``models.sharding.tp_model_config``.
        rngs: parameter initialisation (``models.weights`` replaces the values when loading).

    Raises:
        ValueError: unsupported rope type, heads that don't divide, unknown attention backend.
    """

    def __init__(self, config: Any, *, dtype: Any, param_dtype: Any,
                 attention_backend: str = "reference", interpret: bool = False,
                 mesh: Mesh | None = None, rngs: nnx.Rngs):
        if attention_backend not in ("reference", "pallas"):
            raise ValueError(
                f"attention_backend must be 'reference' or 'pallas', got {attention_backend!r}"
            )
        self.vocab_size = config.vocab_size
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.model = LlamaModel(config, dtype=dtype, param_dtype=param_dtype,
                                attention_backend=attention_backend, interpret=interpret,
                                mesh=mesh, rngs=rngs)
        # nnx.data: lm_head is a sub-module (data) when untied and None when tied.
        self.lm_head = nnx.data(None)
        if not self.tie_word_embeddings:
            self.lm_head = nnx.Linear(config.hidden_size, config.vocab_size, use_bias=False,
                                      dtype=dtype, param_dtype=param_dtype,
                                      precision=_precision(dtype), rngs=rngs)

    def __call__(
        self,
        input_ids: jax.Array,
        positions: jax.Array,
        kv_caches: list[tuple[jax.Array, jax.Array]],
        metadata: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> tuple[jax.Array, list[tuple[jax.Array, jax.Array]]]:
        """One step over ``T`` packed tokens.

        Args:
            input_ids: ``i32[T]``.
            positions: ``i32[T]``, the position of each token in its sequence.
            kv_caches: per layer ``(k_cache, v_cache)``, each ``[num_blocks, block_size, Hkv, D]``.
            metadata: where the new K/V go and what each query reads.
            lora: per-token LoRA adapters (``models.lora``); None runs the base model alone.

        Returns:
            ``(hidden [T, hidden_size] in the compute dtype, updated kv_caches)``.
        """
        return self.model(input_ids, positions, kv_caches, metadata, lora)

    # The layer projections LoRA adapters may target, by fused projection (``models.lora``).
    lora_projection_specs = staticmethod(llama_projection_specs)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """``hidden [N, hidden_size] -> f32[N, vocab_size]`` (tied: ``hidden @ embed_tokens.T``)."""
        if self.lm_head is None:
            weight = self.model.embed_tokens.embedding[...]  # [vocab, hidden]
        else:
            weight = self.lm_head.kernel[...].T  # [vocab, hidden]
        return jnp.einsum(
            "nh,vh->nv", hidden, weight.astype(hidden.dtype),
            preferred_element_type=jnp.float32, precision=_precision(hidden.dtype),
        )


# Mistral and Qwen2 differ from Llama only in what their configs say.
MistralForCausalLM = LlamaForCausalLM
Qwen2ForCausalLM = LlamaForCausalLM
