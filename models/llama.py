"""The Llama-style decoder family in Flax NNX, driven by the HF config.

One class serves every member (Llama 2/3, Mistral, Qwen2, Qwen3, Gemma-2, Phi-3, Mixtral); the
Hugging Face config decides the differences (:class:`DecoderOptions` collects those that are
not plain sizes):

- GQA: ``num_key_value_heads`` (defaults to ``num_attention_heads``).
- ``head_dim`` from the config, else ``hidden_size // num_attention_heads``.
- Biases: Qwen2 has q/k/v biases and no o_proj bias; Llama's ``attention_bias`` puts a bias on all
  four projections; ``mlp_bias`` on the MLP projections.
- RoPE (``models.rope``) with ``rope_type`` ``"default"``, ``"linear"`` or ``"llama3"``; others
  (Phi-3's ``"longrope"``/``"su"``, ``"yarn"``) are refused by name.
- Sliding window: Mistral's and Phi-3's ``sliding_window`` applies to every layer (``None`` = full
  attention); configs with ``layer_types`` (Qwen2, Qwen3, Gemma-2) use it only on
  ``"sliding_attention"`` layers (Gemma-2 alternates: even layers slide).
- Qwen3: per-head RMSNorm of q and k (``q_norm``/``k_norm``, over ``D``) before RoPE.
- Gemma-2: every RMSNorm scales by ``1 + weight``; embeddings are multiplied by
  ``sqrt(hidden_size)`` (rounded to the compute dtype, as HF does); norms before *and* after
  attention and MLP (``input_layernorm``, ``post_attention_layernorm``,
  ``pre_feedforward_layernorm``, ``post_feedforward_layernorm``); GeGLU with
  ``gelu_pytorch_tanh``; scores scaled by ``query_pre_attn_scalar ** -0.5`` and soft-capped by
  ``attn_logit_softcapping``; logits soft-capped by ``final_logit_softcapping``
  (``c * tanh(x / c)``; Gemma Team 2024, arXiv:2408.00118).
- Phi-3: the checkpoint stores ``qkv_proj`` and ``gate_up_proj`` fused; ``models.weights``
  reads its row blocks as the parts' tensors, so the model is the plain one.
- Mixtral: the MLP is a top-``k`` sparse mixture of experts (``models.moe``), named
  ``block_sparse_moe`` as in the checkpoint.
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

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

import pallas_kernels
from models.attention import attention, kv_cache_head_dim
from models.attention_backends import check_attention_backend
from models.attention_metadata import AttentionMetadata
from models.kv_scales import FP8KVScales
from models.lora import LORA_PROJECTIONS, LoRABatch, LoRALayer, llama_projection_specs, lora_project
from models.moe import SparseMoeBlock
from models.quantization.config import QuantizationConfig
from models.quantized_linear import make_linear
from models.rope import apply_rope, rope_inv_freq, rope_parameters
from models.sharding import tp_size

# HF ``hidden_act`` / ``hidden_activation`` names -> the function (HF ``ACT2FN``).
_ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
}


@dataclasses.dataclass(frozen=True)
class DecoderOptions:
    """What a family's config says beyond sizes; read once by :meth:`from_hf_config`."""

    hidden_act: str  # a key of _ACTIVATIONS
    qk_norm: bool  # Qwen3: RMSNorm over D of each query and key head before RoPE
    gemma_norms: bool  # Gemma-2: RMSNorm by (1 + w), norms before and after attention and MLP
    embed_scale: float | None  # Gemma-2: sqrt(hidden_size)
    query_pre_attn_scalar: float | None  # Gemma-2: scores scaled by its -1/2 power, not D's
    attn_soft_cap: float | None  # Gemma-2 attn_logit_softcapping
    final_soft_cap: float | None  # Gemma-2 final_logit_softcapping
    num_experts: int  # Mixtral num_local_experts; 0 = dense MLP

    @classmethod
    def from_hf_config(cls, config: Any) -> DecoderOptions:
        """Raises:
        ValueError: an activation other than those of ``_ACTIVATIONS`` (named).
        """
        model_type = getattr(config, "model_type", None)
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        if act not in _ACTIVATIONS:
            raise ValueError(
                f"hidden_act {act!r} is not supported; supported: {sorted(_ACTIVATIONS)}"
            )
        gemma = model_type == "gemma2"
        return cls(
            hidden_act=act,
            qk_norm=model_type == "qwen3",
            gemma_norms=gemma,
            embed_scale=math.sqrt(config.hidden_size) if gemma else None,
            query_pre_attn_scalar=getattr(config, "query_pre_attn_scalar", None) if gemma else None,
            attn_soft_cap=getattr(config, "attn_logit_softcapping", None),
            final_soft_cap=getattr(config, "final_logit_softcapping", None),
            num_experts=int(getattr(config, "num_local_experts", 0) or 0),
        )


# ------------------------------------------------------------------------------------------------
# Layers


def _precision(dtype: jnp.dtype) -> jax.lax.Precision:
    # float32 is the parity/test dtype: ask for true f32 matmuls (GPUs would otherwise use TF32).
    if jnp.dtype(dtype) == jnp.float32:
        return jax.lax.Precision.HIGHEST
    return jax.lax.Precision.DEFAULT


class RMSNorm(nnx.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in float32.

    ``y = weight * x / sqrt(mean(x^2) + eps)`` (Gemma's ``unit_offset``: ``(1 + weight) * ...``);
    input ``[..., dim]`` any float dtype, output in the compute ``dtype``. The parameter is named
    ``weight`` as in HF.
    """

    def __init__(self, dim: int, *, eps: float, dtype: Any, param_dtype: Any, rngs: nnx.Rngs,
                 unit_offset: bool = False):
        del rngs  # ones-initialised; kept for the common module signature
        self.eps = float(eps)
        self.dtype = dtype
        self.unit_offset = unit_offset
        self.weight = nnx.Param(jnp.ones((dim,), dtype=param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        y = x32 * jax.lax.rsqrt(var + self.eps)
        weight = self.weight[...].astype(jnp.float32)
        if self.unit_offset:
            weight = 1.0 + weight
        return (weight * y).astype(self.dtype)


class LlamaMLP(nnx.Module):
    """Gated MLP: ``down(act(gate(x)) * up(x))`` (SwiGLU; GeGLU for Gemma-2);
    ``[T, hidden] -> [T, hidden]``.

    ``gate_up_proj``: kernel ``[hidden, 2 * intermediate]`` (gate then up, per shard of
    ``num_shards``), one matmul; ``down_proj``: ``[intermediate, hidden]``.
    """

    def __init__(self, config: Any, *, num_shards: int, hidden_act: str, dtype: Any,
                 param_dtype: Any, rngs: nnx.Rngs, prefix: str = "mlp",
                 quant_config: QuantizationConfig | None = None):
        hidden, inter = config.hidden_size, config.intermediate_size
        self.hidden_act = hidden_act
        bias = bool(getattr(config, "mlp_bias", False))
        kw = dict(use_bias=bias, dtype=dtype, param_dtype=param_dtype,
                  precision=_precision(dtype), rngs=rngs)
        self.gate_up_proj = make_linear(quant_config, prefix, LORA_PROJECTIONS["gate_up_proj"],
                                        hidden, (inter, inter), num_shards=num_shards, **kw)
        self.down_proj = make_linear(quant_config, prefix, LORA_PROJECTIONS["down_proj"], inter,
                                     (hidden,), **kw)

    def __call__(self, x: jax.Array, lora: LoRALayer | None = None) -> jax.Array:
        gate, up = lora_project(lora, "gate_up_proj", self.gate_up_proj, x)  # [T, inter] each
        h = _ACTIVATIONS[self.hidden_act](gate) * up
        return lora_project(lora, "down_proj", self.down_proj, h)


def _attention_biases(config: Any) -> tuple[bool, bool]:
    """(q/k/v bias, o_proj bias) for the config's family."""
    if getattr(config, "model_type", None) == "qwen2":
        return True, False
    bias = bool(getattr(config, "attention_bias", False))
    return bias, bias


class LlamaAttention(FP8KVScales, nnx.Module):
    """Self-attention over the paged KV cache.

    ``[T, hidden] -> [T, hidden]``: QKV projection (one matmul, ``qkv_proj`` kernel
    ``[hidden, (Hq + 2 * Hkv) * D]``), RoPE, ``pallas_kernels.kv_cache_update`` by
    ``metadata.slot_mapping``, :func:`models.attention.attention`, o_proj. ``attention_backend``,
    ``interpret``, ``sliding_window`` and ``options`` are static Python attributes; ``k_scale``
    and ``v_scale`` are the FP8 KV cache's scales (``models.kv_scales``; None: a float cache).
    """

    def __init__(
        self,
        config: Any,
        *,
        sliding_window: int | None,
        options: DecoderOptions,
        dtype: Any,
        param_dtype: Any,
        attention_backend: str,
        interpret: bool,
        mesh: Mesh | None = None,
        rngs: nnx.Rngs,
        prefix: str = "self_attn",
        quant_config: QuantizationConfig | None = None,
    ):
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        scalar = options.query_pre_attn_scalar
        self.scale = (scalar if scalar is not None else self.head_dim) ** -0.5
        self.soft_cap = options.attn_soft_cap
        self.sliding_window = sliding_window
        # D of the cache and the kernels: padded to a power of two for the Pallas kernels.
        self.cache_head_dim = kv_cache_head_dim(self.head_dim, attention_backend)
        self.attention_backend = attention_backend
        self.interpret = interpret
        self.mesh = mesh  # static: tensor parallelism runs attention per device on its heads
        self.init_kv_scales()
        # A tuple of Python floats: a static attribute (not a parameter), constant under jit.
        inv_freq = rope_inv_freq(self.head_dim, rope_parameters(config))
        self.inv_freq = tuple(float(f) for f in inv_freq)
        qkv_bias, o_bias = _attention_biases(config)
        kw = dict(dtype=dtype, param_dtype=param_dtype, precision=_precision(dtype), rngs=rngs)
        hidden = config.hidden_size
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = make_linear(
            quant_config, prefix, LORA_PROJECTIONS["qkv_proj"], hidden,
            (q_size, kv_size, kv_size), num_shards=tp_size(mesh), use_bias=qkv_bias, **kw,
        )  # fmt: skip
        self.o_proj = make_linear(quant_config, prefix, LORA_PROJECTIONS["o_proj"], q_size,
                                  (hidden,), use_bias=o_bias, **kw)
        self.q_norm = self.k_norm = nnx.data(None)
        if options.qk_norm:  # Qwen3: over each head's D, shared by all heads
            norm_kw = dict(eps=config.rms_norm_eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
            self.q_norm = RMSNorm(self.head_dim, **norm_kw)
            self.k_norm = RMSNorm(self.head_dim, **norm_kw)

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
        q, k, v = lora_project(lora, "qkv_proj", self.qkv_proj, x)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = np.asarray(self.inv_freq, dtype=np.float32)
        q = apply_rope(q, positions, inv_freq)
        k = apply_rope(k, positions, inv_freq)
        if self.cache_head_dim != self.head_dim:
            pad = ((0, 0), (0, 0), (0, self.cache_head_dim - self.head_dim))
            q, k, v = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
        k_scale, v_scale = self.kv_scales()
        k_cache, v_cache = pallas_kernels.kv_cache_update(
            k_cache, v_cache, k, v, metadata.slot_mapping, k_scale=k_scale, v_scale=v_scale
        )
        out = attention(
            q, k_cache, v_cache, metadata,
            k_scale=k_scale,
            v_scale=v_scale,
            backend=self.attention_backend,
            scale=self.scale,
            soft_cap=self.soft_cap,
            sliding_window=self.sliding_window,
            interpret=self.interpret,
            mesh=self.mesh,
        )
        out = out[..., : self.head_dim].astype(x.dtype)  # drop the padding columns, if any
        out = out.reshape(num_tokens, self.num_heads * self.head_dim)
        return lora_project(lora, "o_proj", self.o_proj, out), k_cache, v_cache


def _grouped_matmul_backend(dtype: Any, attention_backend: str, interpret: bool) -> str:
    # The Pallas kernels compiled (not interpreted) mean a GPU; Hopper's grouped GEMM takes
    # bf16/f16 only. Everything else (CPU tests, float32 parity) takes XLA's exact ragged dot.
    compiled = attention_backend == "pallas" and not interpret
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return "mosaic_gpu" if compiled and half else "xla"


class LlamaDecoderLayer(nnx.Module):
    """Pre-norm block: ``x + attn(input_layernorm(x))``, then
    ``x + mlp(post_attention_layernorm(x))``.

    Gemma-2 (``options.gemma_norms``) norms both sides of each sub-block, with HF's names:
    ``x + post_attention_layernorm(attn(input_layernorm(x)))``, then
    ``x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))``. Mixtral's MLP is
    ``block_sparse_moe`` (``models.moe``).
    """

    def __init__(self, config: Any, *, sliding_window: int | None, options: DecoderOptions,
                 dtype: Any, param_dtype: Any, attention_backend: str, interpret: bool,
                 mesh: Mesh | None = None, rngs: nnx.Rngs, prefix: str = "model.layers.0",
                 quant_config: QuantizationConfig | None = None):
        def norm():
            return RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype,
                           param_dtype=param_dtype, rngs=rngs, unit_offset=options.gemma_norms)

        self.input_layernorm = norm()
        self.self_attn = LlamaAttention(
            config, sliding_window=sliding_window, options=options, dtype=dtype,
            param_dtype=param_dtype, attention_backend=attention_backend, interpret=interpret,
            mesh=mesh, rngs=rngs, prefix=f"{prefix}.self_attn", quant_config=quant_config,
        )
        self.post_attention_layernorm = norm()
        self.gemma_norms = options.gemma_norms
        self.pre_feedforward_layernorm = self.post_feedforward_layernorm = nnx.data(None)
        if options.gemma_norms:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        # nnx.data: exactly one of mlp / block_sparse_moe is a sub-module, the other None.
        self.mlp = self.block_sparse_moe = nnx.data(None)
        if options.num_experts:
            self.block_sparse_moe = SparseMoeBlock(
                config, dtype=dtype, param_dtype=param_dtype, precision=_precision(dtype),
                mesh=mesh, backend=_grouped_matmul_backend(dtype, attention_backend, interpret),
                rngs=rngs,
            )
        else:
            self.mlp = LlamaMLP(config, num_shards=tp_size(mesh), hidden_act=options.hidden_act,
                                dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                                prefix=f"{prefix}.mlp", quant_config=quant_config)

    def __call__(self, x, positions, k_cache, v_cache, metadata, lora: LoRALayer | None = None):
        attn_out, k_cache, v_cache = self.self_attn(
            self.input_layernorm(x), positions, k_cache, v_cache, metadata, lora
        )
        if self.block_sparse_moe is None:
            mlp = functools.partial(self.mlp, lora=lora)
        else:  # MoE experts take no LoRA (llama_projection_specs offers attention only)
            mlp = self.block_sparse_moe
        if self.gemma_norms:
            x = x + self.post_attention_layernorm(attn_out)
            x = x + self.post_feedforward_layernorm(mlp(self.pre_feedforward_layernorm(x)))
        else:
            x = x + attn_out
            x = x + mlp(self.post_attention_layernorm(x))
        return x, k_cache, v_cache


def layer_sliding_windows(config: Any) -> list[int | None]:
    """Sliding window per layer (``None`` = full attention).

    Configs with ``layer_types`` (Qwen2, Qwen3, Gemma-2) apply ``sliding_window`` to ``"sliding_attention"``
    layers only; otherwise (Mistral, Phi-3) ``sliding_window`` applies to all layers; Llama has none.
    """
    window = getattr(config, "sliding_window", None)
    num_layers = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return [window if t == "sliding_attention" else None for t in layer_types[:num_layers]]
    return [window] * num_layers


class LlamaModel(nnx.Module):
    """Embedding (times ``options.embed_scale``), decoder layers and final norm:
    ``i32[T] -> [T, hidden]``."""

    def __init__(self, config: Any, *, options: DecoderOptions, dtype: Any, param_dtype: Any,
                 attention_backend: str, interpret: bool, mesh: Mesh | None = None,
                 rngs: nnx.Rngs, quant_config: QuantizationConfig | None = None):
        self.dtype = dtype
        self.embed_scale = options.embed_scale
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype,
                                      param_dtype=param_dtype, rngs=rngs)
        self.layers = nnx.List([
            LlamaDecoderLayer(config, sliding_window=window, options=options, dtype=dtype,
                              param_dtype=param_dtype, attention_backend=attention_backend,
                              interpret=interpret, mesh=mesh, rngs=rngs,
                              prefix=f"model.layers.{i}", quant_config=quant_config)
            for i, window in enumerate(layer_sliding_windows(config))
        ])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype,
                            param_dtype=param_dtype, rngs=rngs, unit_offset=options.gemma_norms)

    def __call__(self, input_ids, positions, kv_caches, metadata, lora: LoRABatch | None = None,
                 aux_hidden_state_layers: tuple[int, ...] = ()):
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            # HF multiplies by sqrt(hidden) rounded to the weights' dtype (bf16: 48.0 for 2304).
            x = x * jnp.asarray(self.embed_scale, dtype=self.dtype)
        captured = {}  # layer index -> the residual stream entering it
        new_caches = []
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            captured[i] = x
            layer_lora = None if lora is None else lora.layer(i)
            x, k_cache, v_cache = layer(x, positions, k_cache, v_cache, metadata, layer_lora)
            new_caches.append((k_cache, v_cache))
        if not aux_hidden_state_layers:
            return self.norm(x), new_caches
        captured[len(self.layers)] = x
        aux = jnp.concatenate([captured[i] for i in aux_hidden_state_layers], axis=-1)
        return self.norm(x), new_caches, aux


class LlamaForCausalLM(nnx.Module):
    """Causal LM of the Llama-style family over a paged KV cache (the module docstring lists
    the members and what their configs switch).

    Multi-LoRA (``models.lora``): ``__call__``'s ``lora`` adds each token's adapter to the
    seven projections (q/k/v/o/gate/up/down) of every member; Mixtral's experts take none
    (``lora_projection_specs`` offers its attention projections only and the adapter loader
    refuses the rest by name).

    Args:
        config: a transformers ``PretrainedConfig`` of the family.
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
        quant_config: the checkpoint's quantization (``models.quantization``); the four layer
            projections that ``get_linear_method`` quantizes become
            ``models.quantized_linear`` layers (their tensors attached by the loaders),
            ``lm_head`` and the embeddings stay float. None: every layer float.

    Raises:
        ValueError: unsupported rope type or activation, heads that don't divide, unknown
            attention backend, ``quant_config`` with Mixtral (its experts are not quantized
            layers yet), fused q/k/v (gate/up) parts with different quantizations.
    """

    def __init__(self, config: Any, *, dtype: Any, param_dtype: Any,
                 attention_backend: str = "reference", interpret: bool = False,
                 mesh: Mesh | None = None, rngs: nnx.Rngs,
                 quant_config: QuantizationConfig | None = None):
        check_attention_backend(attention_backend)
        self.vocab_size = config.vocab_size
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        options = DecoderOptions.from_hf_config(config)
        if quant_config is not None and options.num_experts:
            raise ValueError(
                f"quantization {quant_config.method!r} is not supported for the Mixtral family "
                f"({getattr(config, 'model_type', None)}): its MoE experts have no quantized "
                "layers yet"
            )
        self.final_soft_cap = options.final_soft_cap
        self.model = LlamaModel(config, options=options, dtype=dtype, param_dtype=param_dtype,
                                attention_backend=attention_backend, interpret=interpret,
                                mesh=mesh, rngs=rngs, quant_config=quant_config)
        # nnx.data: lm_head is a sub-module (data) when untied and None when tied.
        self.lm_head = nnx.data(None)
        if not self.tie_word_embeddings:
            self.lm_head = nnx.Linear(config.hidden_size, config.vocab_size, use_bias=False,
                                      dtype=dtype, param_dtype=param_dtype,
                                      precision=_precision(dtype), rngs=rngs)

    # The step may ask for the hidden states of inner layers (EAGLE-3 draft heads read them).
    supports_aux_hidden_states = True

    def __call__(
        self,
        input_ids: jax.Array,
        positions: jax.Array,
        kv_caches: list[tuple[jax.Array, jax.Array]],
        metadata: AttentionMetadata,
        lora: LoRABatch | None = None,
        *,
        aux_hidden_state_layers: tuple[int, ...] = (),
    ) -> tuple:
        """One step over ``T`` packed tokens.

        Args:
            input_ids: ``i32[T]``.
            positions: ``i32[T]``, the position of each token in its sequence.
            kv_caches: per layer ``(k_cache, v_cache)``, each ``[num_blocks, block_size, Hkv, D]``.
            metadata: where the new K/V go and what each query reads.
            lora: per-token LoRA adapters (``models.lora``); None runs the base model alone.
            aux_hidden_state_layers: static layer indices ``i`` in ``[0, num_hidden_layers]``
                whose residual stream entering layer ``i`` is also returned (``i =
                num_hidden_layers``: leaving the last layer, before the final norm); vLLM's
                ``aux_hidden_state_layers``, which EAGLE-3 heads read at ``(2, L // 2, L - 3)``.
                Empty: nothing extra.

        Returns:
            ``(hidden [T, hidden_size] in the compute dtype, updated kv_caches)``, plus
            ``aux [T, len(aux_hidden_state_layers) * hidden_size]`` (the captured streams
            concatenated in the order asked) when ``aux_hidden_state_layers`` is not empty.
        """
        return self.model(input_ids, positions, kv_caches, metadata, lora,
                          aux_hidden_state_layers)

    # The layer projections LoRA adapters may target, by fused projection (``models.lora``).
    lora_projection_specs = staticmethod(llama_projection_specs)

    def lora_linears(self) -> tuple[dict[str, nnx.Module], ...]:
        """Per layer, the layers of the projections ``lora_projection_specs`` offers (name ->
        ``nnx.Linear`` / ``MergedColumnParallelLinear`` or their quantized twins)."""
        layers = []
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = {"qkv_proj": attn.qkv_proj, "o_proj": attn.o_proj}
            if mlp is not None:
                linears.update(gate_up_proj=mlp.gate_up_proj, down_proj=mlp.down_proj)
            layers.append(linears)
        return tuple(layers)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """``hidden [N, hidden_size] -> f32[N, vocab_size]`` (tied: ``hidden @ embed_tokens.T``;
        Gemma-2: then ``c * tanh(logits / c)`` with ``c = final_logit_softcapping``)."""
        if self.lm_head is None:
            weight = self.model.embed_tokens.embedding[...]  # [vocab, hidden]
        else:
            weight = self.lm_head.kernel[...].T  # [vocab, hidden]
        logits = jnp.einsum(
            "nh,vh->nv", hidden, weight.astype(hidden.dtype),
            preferred_element_type=jnp.float32, precision=_precision(hidden.dtype),
        )
        if self.final_soft_cap is not None:
            logits = self.final_soft_cap * jnp.tanh(logits / self.final_soft_cap)
        return logits


# The other members differ from Llama only in what their configs say (DecoderOptions).
MistralForCausalLM = LlamaForCausalLM
Qwen2ForCausalLM = LlamaForCausalLM
Qwen3ForCausalLM = LlamaForCausalLM
Gemma2ForCausalLM = LlamaForCausalLM
Phi3ForCausalLM = LlamaForCausalLM
MixtralForCausalLM = LlamaForCausalLM
