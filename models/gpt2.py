"""The LayerNorm / GELU decoder family in Flax NNX: GPT-2 and BLOOM, driven by the HF config.

Both are pre-LayerNorm decoders with biased projections, a two-matrix GELU MLP, a final
LayerNorm and (usually) an LM head tied to the token embedding. One set of modules serves both;
the config decides the differences:

- Positions. GPT-2 (Radford et al. 2019) adds a learned position embedding (``wpe``) to the
  token embedding. BLOOM (BigScience 2022) has none: attention adds ALiBi biases (Press et al.,
  "Train Short, Test Long", ICLR 2022; slopes as HF's ``build_alibi_tensor``, see
  :func:`alibi_slopes`) inside the attention kernels, and the embedding passes through its own
  LayerNorm (``word_embeddings_layernorm``).
- Activation. GPT-2's ``activation_function`` (``gelu_new``: the tanh approximation, also
  ``gelu_pytorch_tanh``, exact ``gelu``, ``relu``); BLOOM's is the tanh approximation.
- Attention scale: ``D ** -0.5``; GPT-2's ``scale_attn_weights=False`` drops it and
  ``scale_attn_by_inverse_layer_idx`` divides it by ``layer + 1``.
- Residual: BLOOM's ``apply_residual_connection_post_layernorm`` takes the residual after the
  LayerNorm instead of before it (HF ``BloomBlock``).

Parameter paths use the names the rest of jaxpaged knows (``model.embed_tokens``,
``model.layers.N.self_attn.qkv_proj``/``o_proj``, ``mlp.up_proj``/``down_proj``,
``input_layernorm``, ``post_attention_layernorm``, ``model.norm``; plus
``model.embed_positions`` for GPT-2 and ``model.embed_layernorm`` for BLOOM), so the loaders,
the tensor-parallel rules (``models.sharding``) and the fused q/k/v column layout
(``models.merged_linear``) serve these models unchanged. ``models.checkpoint_views`` maps those
names onto the HF tensors: GPT-2's ``Conv1D`` weights stored ``[in, out]``, its fused ``c_attn``
(columns ``[q | k | v]``) and BLOOM's fused ``query_key_value`` (rows interleaved per head:
``[H, 3, D]``). Kernels are stored ``[in, out]``, embeddings ``[vocab, hidden]``. Shape letters
(``T``, ``Hq``, ``Hkv``, ``D``) as in ``pallas_kernels``; ``Hkv == Hq`` in both families.
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
from models.kv_scales import FP8KVScales
from models.merged_linear import MergedColumnParallelLinear
from models.sharding import tp_size

# HF ``ACT2FN`` names -> the function; the tanh approximation is GPT-2's ``gelu_new`` and
# BLOOM's ``bloom_gelu_forward`` (0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))).
_ACTIVATIONS = {
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_fast": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "relu": jax.nn.relu,
}


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi slopes ``f32[Hq]`` (Press et al., ICLR 2022), as HF BLOOM's ``build_alibi_tensor``.

    With ``n`` the largest power of two ``<= Hq``, head ``j < n`` gets ``b ** (j + 1)`` where
    ``b = 2 ** -(8 / n)``; the remaining ``Hq - n`` heads get the odd powers ``c ** 1, c ** 3,
    ...`` of ``c = 2 ** -(8 / (2 n))`` (the slopes of ``2 n`` heads that ``n`` heads skip).
    Computed in float64 and rounded once to float32.
    """
    if num_heads < 1:
        raise ValueError(f"num_heads must be at least 1, got {num_heads}")
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base ** (j + 1) for j in range(closest)]
    if closest != num_heads:
        extra_base = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        remaining = min(closest, num_heads - closest)
        slopes += [extra_base**power for power in range(1, 1 + 2 * remaining, 2)]
    return np.asarray(slopes, dtype=np.float32)


def intermediate_size(config: Any) -> int:
    """MLP width: ``intermediate_size`` when set (``models.sharding.tp_model_config`` pads it),
    else GPT-2's ``n_inner``, else ``4 * hidden_size`` (BLOOM, GPT-2's default)."""
    for name in ("intermediate_size", "n_inner"):
        value = getattr(config, name, None)
        if value:
            return int(value)
    return 4 * int(config.hidden_size)


def _precision(dtype: Any) -> jax.lax.Precision:
    # float32 is the parity/test dtype: ask for true f32 matmuls (GPUs would otherwise use TF32).
    if jnp.dtype(dtype) == jnp.float32:
        return jax.lax.Precision.HIGHEST
    return jax.lax.Precision.DEFAULT


class LayerNorm(nnx.Module):
    """LayerNorm (Ba et al. 2016) computed in float32: ``(x - mean) / sqrt(var + eps) * weight
    + bias`` over the last axis; ``[..., hidden]`` in, compute ``dtype`` out. Parameters are
    named ``weight`` and ``bias`` as in HF's ``nn.LayerNorm``."""

    def __init__(self, dim: int, *, eps: float, dtype: Any, param_dtype: Any, rngs: nnx.Rngs):
        del rngs  # ones / zeros initialised; kept for the common module signature
        self.eps = float(eps)
        self.dtype = dtype
        self.weight = nnx.Param(jnp.ones((dim,), dtype=param_dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype=param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        weight = self.weight[...].astype(jnp.float32)
        return (y * weight + self.bias[...].astype(jnp.float32)).astype(self.dtype)


class GeluMLP(nnx.Module):
    """``down_proj(act(up_proj(x)))`` with biases; ``[T, hidden] -> [T, hidden]``.

    ``up_proj``: kernel ``[hidden, intermediate]`` (GPT-2 ``c_fc``, BLOOM ``dense_h_to_4h``);
    ``down_proj``: ``[intermediate, hidden]`` (``c_proj``, ``dense_4h_to_h``).
    """

    def __init__(
        self, config: Any, *, activation: str, dtype: Any, param_dtype: Any, rngs: nnx.Rngs
    ):
        if activation not in _ACTIVATIONS:
            raise ValueError(
                f"activation_function {activation!r} is not supported; supported: "
                f"{sorted(_ACTIVATIONS)}"
            )
        self.activation = activation
        hidden, inter = config.hidden_size, intermediate_size(config)
        kw = dict(
            use_bias=True,
            dtype=dtype,
            param_dtype=param_dtype,
            precision=_precision(dtype),
            rngs=rngs,
        )
        self.up_proj = nnx.Linear(hidden, inter, **kw)
        self.down_proj = nnx.Linear(inter, hidden, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(_ACTIVATIONS[self.activation](self.up_proj(x)))


class SelfAttention(FP8KVScales, nnx.Module):
    """Multi-head self-attention over the paged KV cache, no rotary embedding.

    ``[T, hidden] -> [T, hidden]``: one biased QKV matmul (``qkv_proj`` kernel
    ``[hidden, 3 * Hq * D]``, columns per ``models.merged_linear``), ``kv_cache_update`` by
    ``metadata.slot_mapping``, :func:`models.attention.attention` (with ALiBi slopes when
    ``alibi``), biased ``o_proj``. ``scale``, ``alibi_slopes`` (a tuple of Python floats, one
    per head of the whole model), the backend and ``mesh`` are static attributes; ``k_scale`` /
    ``v_scale`` are the FP8 KV cache's scales (``models.kv_scales``; None: a float cache).
    """

    def __init__(
        self,
        config: Any,
        *,
        scale: float,
        alibi: bool,
        dtype: Any,
        param_dtype: Any,
        attention_backend: str,
        interpret: bool,
        mesh: Mesh | None,
        rngs: nnx.Rngs,
    ):
        self.num_heads = int(config.num_attention_heads)
        hidden = int(config.hidden_size)
        if hidden % self.num_heads:
            raise ValueError(
                f"hidden_size ({hidden}) must be divisible by num_attention_heads "
                f"({self.num_heads})"
            )
        self.head_dim = hidden // self.num_heads
        self.scale = float(scale)
        self.alibi_slopes = tuple(float(s) for s in alibi_slopes(self.num_heads)) if alibi else None
        self.attention_backend = attention_backend
        self.interpret = interpret
        self.mesh = mesh
        self.init_kv_scales()
        kw = dict(
            use_bias=True,
            dtype=dtype,
            param_dtype=param_dtype,
            precision=_precision(dtype),
            rngs=rngs,
        )
        self.qkv_proj = MergedColumnParallelLinear(
            hidden, (hidden, hidden, hidden), num_shards=tp_size(mesh), **kw
        )
        self.o_proj = nnx.Linear(hidden, hidden, **kw)

    def __call__(self, x, k_cache, v_cache, metadata: AttentionMetadata):
        num_tokens = x.shape[0]
        q, k, v = (
            part.reshape(num_tokens, self.num_heads, self.head_dim) for part in self.qkv_proj(x)
        )
        k_scale, v_scale = self.kv_scales()
        k_cache, v_cache = pallas_kernels.kv_cache_update(
            k_cache, v_cache, k, v, metadata.slot_mapping, k_scale=k_scale, v_scale=v_scale
        )
        out = attention(
            q,
            k_cache,
            v_cache,
            metadata,
            k_scale=k_scale,
            v_scale=v_scale,
            backend=self.attention_backend,
            scale=self.scale,
            alibi_slopes=self.alibi_slopes,
            interpret=self.interpret,
            mesh=self.mesh,
        )
        out = self.o_proj(out.astype(x.dtype).reshape(num_tokens, self.num_heads * self.head_dim))
        return out, k_cache, v_cache


class DecoderLayer(nnx.Module):
    """Pre-LayerNorm block: ``h = r1 + attn(ln1(x))``, ``out = r2 + mlp(ln2(h))`` where the
    residuals are ``r1 = x``, ``r2 = h``, or the LayerNorm outputs ``ln1(x)``, ``ln2(h)`` when
    ``residual_post_layernorm`` (BLOOM's ``apply_residual_connection_post_layernorm``)."""

    def __init__(
        self,
        config: Any,
        *,
        eps: float,
        scale: float,
        alibi: bool,
        activation: str,
        residual_post_layernorm: bool,
        dtype: Any,
        param_dtype: Any,
        attention_backend: str,
        interpret: bool,
        mesh: Mesh | None,
        rngs: nnx.Rngs,
    ):
        hidden = config.hidden_size
        norm = dict(eps=eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.residual_post_layernorm = residual_post_layernorm
        self.input_layernorm = LayerNorm(hidden, **norm)
        self.self_attn = SelfAttention(
            config,
            scale=scale,
            alibi=alibi,
            dtype=dtype,
            param_dtype=param_dtype,
            attention_backend=attention_backend,
            interpret=interpret,
            mesh=mesh,
            rngs=rngs,
        )
        self.post_attention_layernorm = LayerNorm(hidden, **norm)
        self.mlp = GeluMLP(
            config, activation=activation, dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )

    def __call__(self, x, k_cache, v_cache, metadata):
        normed = self.input_layernorm(x)
        attn_out, k_cache, v_cache = self.self_attn(normed, k_cache, v_cache, metadata)
        h = (normed if self.residual_post_layernorm else x) + attn_out
        normed = self.post_attention_layernorm(h)
        out = (normed if self.residual_post_layernorm else h) + self.mlp(normed)
        return out, k_cache, v_cache


class LayerNormDecoderModel(nnx.Module):
    """Embeddings, decoder layers and final LayerNorm: ``i32[T] -> [T, hidden]``.

    ``embed_positions`` (learned, ``[max_position_embeddings, hidden]``) exists when
    ``learned_positions`` and ``embed_layernorm`` when ``embedding_layernorm``; both are None
    otherwise.
    """

    def __init__(
        self,
        config: Any,
        *,
        learned_positions: bool,
        embedding_layernorm: bool,
        alibi: bool,
        activation: str,
        scale_by_layer: bool,
        attention_scale: float,
        residual_post_layernorm: bool,
        dtype: Any,
        param_dtype: Any,
        attention_backend: str,
        interpret: bool,
        mesh: Mesh | None,
        rngs: nnx.Rngs,
    ):
        hidden = config.hidden_size
        eps = float(config.layer_norm_epsilon)
        embed = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.embed_tokens = nnx.Embed(config.vocab_size, hidden, **embed)
        # nnx.data: a sub-module (data) in one family, None in the other.
        self.embed_positions = nnx.data(None)
        if learned_positions:
            self.embed_positions = nnx.Embed(config.max_position_embeddings, hidden, **embed)
        self.embed_layernorm = nnx.data(None)
        if embedding_layernorm:
            self.embed_layernorm = LayerNorm(hidden, eps=eps, **embed)
        self.layers = nnx.List(
            [
                DecoderLayer(
                    config,
                    eps=eps,
                    scale=attention_scale / (i + 1 if scale_by_layer else 1),
                    alibi=alibi,
                    activation=activation,
                    residual_post_layernorm=residual_post_layernorm,
                    dtype=dtype,
                    param_dtype=param_dtype,
                    attention_backend=attention_backend,
                    interpret=interpret,
                    mesh=mesh,
                    rngs=rngs,
                )
                for i in range(config.num_hidden_layers)
            ]
        )
        self.norm = LayerNorm(hidden, eps=eps, **embed)

    def __call__(self, input_ids, positions, kv_caches, metadata):
        x = self.embed_tokens(input_ids)
        if self.embed_positions is not None:
            x = x + self.embed_positions(positions)
        if self.embed_layernorm is not None:
            x = self.embed_layernorm(x)
        new_caches = []
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x, k_cache, v_cache = layer(x, k_cache, v_cache, metadata)
            new_caches.append((k_cache, v_cache))
        return self.norm(x), new_caches


class _LayerNormCausalLM(nnx.Module):
    """The causal LM of both families; subclasses give their family's options
    (``family_options``).

    Args:
        config: a transformers ``GPT2Config`` / ``BloomConfig``.
        dtype: compute dtype; LayerNorms and softmax run in float32.
        param_dtype: dtype the parameters are stored in.
        attention_backend: "reference" or "pallas" (``models.attention``).
        interpret: run Pallas kernels in interpret mode (CPU tests).
        mesh: tensor parallelism (``models.sharding``); None on one device. Build ``config``
            with ``models.sharding.tp_model_config``.
        rngs: parameter initialisation (``models.weights`` replaces the values when loading).

    Raises:
        ValueError: an unknown attention backend or activation, or ``hidden_size`` not
            divisible by the head count.
    """

    def __init__(
        self,
        config: Any,
        *,
        dtype: Any,
        param_dtype: Any,
        attention_backend: str = "reference",
        interpret: bool = False,
        mesh: Mesh | None = None,
        rngs: nnx.Rngs,
    ):
        family = self.family_options(config)
        if attention_backend not in ("reference", "pallas"):
            raise ValueError(
                f"attention_backend must be 'reference' or 'pallas', got {attention_backend!r}"
            )
        self.vocab_size = config.vocab_size
        self.model = LayerNormDecoderModel(
            config,
            **family,
            dtype=dtype,
            param_dtype=param_dtype,
            attention_backend=attention_backend,
            interpret=interpret,
            mesh=mesh,
            rngs=rngs,
        )
        self.lm_head = nnx.data(None)
        if not getattr(config, "tie_word_embeddings", True):
            self.lm_head = nnx.Linear(
                config.hidden_size,
                config.vocab_size,
                use_bias=False,
                dtype=dtype,
                param_dtype=param_dtype,
                precision=_precision(dtype),
                rngs=rngs,
            )

    def __call__(
        self,
        input_ids: jax.Array,
        positions: jax.Array,
        kv_caches: list[tuple[jax.Array, jax.Array]],
        metadata: AttentionMetadata,
    ) -> tuple[jax.Array, list[tuple[jax.Array, jax.Array]]]:
        """One step over ``T`` packed tokens; arguments and result as
        ``models.llama.LlamaForCausalLM.__call__`` (``positions`` feed GPT-2's learned
        position embedding; BLOOM's ALiBi takes positions from the metadata)."""
        return self.model(input_ids, positions, kv_caches, metadata)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """``hidden [N, hidden_size] -> f32[N, vocab_size]`` (tied: ``hidden @ embed_tokens.T``)."""
        if self.lm_head is None:
            weight = self.model.embed_tokens.embedding[...]  # [vocab, hidden]
        else:
            weight = self.lm_head.kernel[...].T
        return jnp.einsum(
            "nh,vh->nv",
            hidden,
            weight.astype(hidden.dtype),
            preferred_element_type=jnp.float32,
            precision=_precision(hidden.dtype),
        )


class GPT2LMHeadModel(_LayerNormCausalLM):
    """GPT-2 (HF ``GPT2LMHeadModel``): learned positions, ``activation_function`` MLP."""

    @staticmethod
    def family_options(config: Any) -> dict:
        head_dim = config.hidden_size // config.num_attention_heads
        return dict(
            learned_positions=True,
            embedding_layernorm=False,
            alibi=False,
            activation=getattr(config, "activation_function", "gelu_new"),
            scale_by_layer=bool(getattr(config, "scale_attn_by_inverse_layer_idx", False)),
            attention_scale=head_dim**-0.5 if getattr(config, "scale_attn_weights", True) else 1.0,
            residual_post_layernorm=False,
        )


class BloomForCausalLM(_LayerNormCausalLM):
    """BLOOM (HF ``BloomForCausalLM``): ALiBi, embedding LayerNorm, tanh-GELU MLP."""

    @staticmethod
    def family_options(config: Any) -> dict:
        head_dim = config.hidden_size // config.num_attention_heads
        return dict(
            learned_positions=False,
            embedding_layernorm=True,
            alibi=True,
            activation="gelu_new",
            scale_by_layer=False,
            attention_scale=head_dim**-0.5,
            residual_post_layernorm=bool(
                getattr(config, "apply_residual_connection_post_layernorm", False)
            ),
        )
