"""The EAGLE-3 draft head (Li et al. 2025, "EAGLE-3", arXiv:2503.01840) over the paged KV cache.

As published (SafeAILab/EAGLE ``eagle/traineagle3/cnets.py``; the checkpoints on the Hub such as
``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``) and served by vLLM 0.34
(``vllm/model_executor/models/llama_eagle3.py``), for a token at position ``t``:

1. Features: the target's residual streams entering three of its layers (``models.llama``'s
   ``aux_hidden_state_layers``, by default ``(2, L // 2, L - 3)``) concatenated,
   ``[T, 3 * target_hidden_size]``, go through ``fc`` (no bias) to ``[T, hidden_size]``. Later
   draft steps feed the head's own previous output instead (:meth:`Eagle3DraftModel.__call__`'s
   ``hidden``).
2. ``midlayer``, one Llama decoder layer whose attention reads ``[input_layernorm(embedding of
   the next token) | hidden_norm(feature)]`` (``2 * hidden_size`` inputs to q/k/v), with RoPE
   and its own K/V in the paged cache; the residual is the feature before ``hidden_norm`` (or
   after it, with the config's ``norm_before_residual``); then ``post_attention_layernorm``,
   the SwiGLU MLP and the second residual.
3. ``norm`` then ``lm_head`` give logits over a reduced draft vocabulary (``draft_vocab_size``,
   32000 for the Llama-3.1-8B head); ``d2t[i]`` maps draft id ``i`` to target id ``i + d2t[i]``
   (``t2d``, the inverse mask, is not needed). The pre-norm output is the next step's feature.

Checkpoint tensors (HF ``[out, in]``), read by their own names: ``fc.weight``,
``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
``midlayer.self_attn.{q,k,v,o}_proj.weight``, ``midlayer.mlp.{gate,up,down}_proj.weight``,
``norm.weight``, ``lm_head.weight``, ``d2t`` (int64), ``t2d`` (bool, ignored), and
``embed_tokens.weight`` only if the head trained its own (published heads do not: they use the
target's embeddings, passed in at call time). Parameter paths mirror those names
(``models.hf_names`` maps them, fusing q/k/v and gate/up as for the target).

Config keys read (``config.json``): hidden_size, intermediate_size, num_attention_heads,
num_key_value_heads, head_dim, rms_norm_eps, hidden_act, rope (``models.rope``), vocab_size,
draft_vocab_size (default vocab_size), target_hidden_size (default hidden_size),
num_aux_hidden_states / eagle_aux_hidden_state_layer_ids (default 3 features),
norm_before_residual, attention_bias. vLLM's variants ``norm_before_fc``, ``fc_norm``,
``norm_output`` and a ``logit_scale`` other than 1 are refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
from contextlib import ExitStack
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.attention_metadata import AttentionMetadata
from models.dummy_init import dummy_normal
from models.hf_names import merged_output_sizes
from models.llama import DecoderOptions, LlamaAttention, LlamaMLP, RMSNorm
from models.merged_linear import MergedColumnParallelLinear
from models.weights import open_reader, plan_params, read_param, resolve_dtype

# vLLM's optional EAGLE-3 variants that this head does not implement.
_REFUSED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")


def _precision(dtype: Any) -> jax.lax.Precision:
    # float32 is the parity/test dtype: true f32 matmuls (GPUs would otherwise use TF32).
    if jnp.dtype(dtype) == jnp.float32:
        return jax.lax.Precision.HIGHEST
    return jax.lax.Precision.DEFAULT


class VocabMap(nnx.Variable):
    """A fixed integer table (not trained, not a linear's weight)."""


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """The head's ``config.json``, with vLLM's defaults filled in (module docstring)."""

    hf: Any  # a namespace of config.json's keys (read by LlamaAttention / LlamaMLP / rope)
    hidden_size: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    num_aux_hidden_states: int
    norm_before_residual: bool

    @classmethod
    def from_dict(cls, config: dict) -> Eagle3Config:
        """Raises:
        ValueError: a vLLM variant this head does not implement, or a config without the
            sizes it needs (named).
        """
        eagle = config.get("eagle_config") or {}
        for flag in _REFUSED_FLAGS:
            if eagle.get(flag, config.get(flag, False)):
                raise ValueError(f"EAGLE-3 config: {flag} = true is not supported")
        if config.get("logit_scale", 1.0) != 1.0:
            raise ValueError(
                f"EAGLE-3 config: logit_scale {config['logit_scale']} is not supported"
            )
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
            if not isinstance(config.get(key), int):
                raise ValueError(f"EAGLE-3 config needs an integer {key}, got {config.get(key)!r}")
        hf = dict(config)
        hf.setdefault("model_type", "llama")
        hf.setdefault("num_key_value_heads", config["num_attention_heads"])
        hf.setdefault("rms_norm_eps", 1e-6)
        hf.setdefault("hidden_act", "silu")
        layer_ids = config.get("eagle_aux_hidden_state_layer_ids") or eagle.get(
            "eagle_aux_hidden_state_layer_ids"
        )
        num_aux = config.get("num_aux_hidden_states") or (len(layer_ids) if layer_ids else 3)
        return cls(
            hf=types.SimpleNamespace(**hf),
            hidden_size=config["hidden_size"],
            vocab_size=config["vocab_size"],
            draft_vocab_size=config.get("draft_vocab_size") or config["vocab_size"],
            target_hidden_size=config.get("target_hidden_size") or config["hidden_size"],
            num_aux_hidden_states=int(num_aux),
            norm_before_residual=bool(config.get("norm_before_residual", False)),
        )

    @classmethod
    def from_dir(cls, model_dir: str) -> Eagle3Config:
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"EAGLE-3 head directory {model_dir!r} has no config.json")
        with open(path) as f:
            return cls.from_dict(json.load(f))


class Eagle3DecoderLayer(nnx.Module):
    """The head's one layer (``midlayer``): ``([T, H] embeddings, [T, H] features) -> [T, H]``
    pre-norm output, attending over its own paged K/V."""

    def __init__(self, config: Eagle3Config, *, dtype: Any, param_dtype: Any,
                 attention_backend: str, interpret: bool, rngs: nnx.Rngs):  # fmt: skip
        hf, hidden = config.hf, config.hidden_size
        options = DecoderOptions.from_hf_config(hf)
        norm = dict(eps=hf.rms_norm_eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.input_layernorm = RMSNorm(hidden, **norm)
        self.hidden_norm = RMSNorm(hidden, **norm)
        self.post_attention_layernorm = RMSNorm(hidden, **norm)
        self.self_attn = LlamaAttention(
            hf, sliding_window=None, options=options, dtype=dtype, param_dtype=param_dtype,
            attention_backend=attention_backend, interpret=interpret, rngs=rngs,
            prefix="midlayer.self_attn",
        )  # fmt: skip
        # q/k/v read the concatenated [embedding | feature], 2 * hidden inputs (vLLM's override).
        attn = self.self_attn
        self.self_attn.qkv_proj = MergedColumnParallelLinear(
            2 * hidden,
            (attn.num_heads * attn.head_dim, *(2 * (attn.num_kv_heads * attn.head_dim,))),
            num_shards=1, use_bias=bool(getattr(hf, "attention_bias", False)), dtype=dtype,
            param_dtype=param_dtype, precision=_precision(dtype), rngs=rngs,
        )  # fmt: skip
        self.mlp = LlamaMLP(hf, num_shards=1, hidden_act=options.hidden_act, dtype=dtype,
                            param_dtype=param_dtype, rngs=rngs, prefix="midlayer.mlp")  # fmt: skip
        self.norm_before_residual = config.norm_before_residual

    def __call__(self, embeds, hidden, positions, k_cache, v_cache, metadata):
        if self.norm_before_residual:
            hidden = self.hidden_norm(hidden)
            residual = hidden
        else:
            residual = hidden
            hidden = self.hidden_norm(hidden)
        x = jnp.concatenate([self.input_layernorm(embeds), hidden], axis=-1)
        attn_out, k_cache, v_cache = self.self_attn(x, positions, k_cache, v_cache, metadata)
        residual = residual + attn_out
        out = residual + self.mlp(self.post_attention_layernorm(residual))
        return out, k_cache, v_cache


class Eagle3DraftModel(nnx.Module):
    """The EAGLE-3 head (module docstring).

    Args:
        config: the head's :class:`Eagle3Config`.
        dtype / param_dtype: compute and parameter dtypes; norms, RoPE and softmax in float32.
        attention_backend, interpret: as ``models.llama.LlamaForCausalLM``.
        own_embeddings: the checkpoint has ``embed_tokens.weight`` (else the target's are
            passed to :meth:`__call__`).
        rngs: parameter initialisation (the loader replaces the values).
    """

    def __init__(self, config: Eagle3Config, *, dtype: Any, param_dtype: Any,
                 attention_backend: str = "reference", interpret: bool = False,
                 own_embeddings: bool = False, rngs: nnx.Rngs):  # fmt: skip
        h = config.hidden_size
        self.config = config
        linear = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype,
                      precision=_precision(dtype), rngs=rngs)  # fmt: skip
        self.fc = nnx.Linear(config.num_aux_hidden_states * config.target_hidden_size, h, **linear)
        self.midlayer = Eagle3DecoderLayer(config, dtype=dtype, param_dtype=param_dtype,
                                           attention_backend=attention_backend,
                                           interpret=interpret, rngs=rngs)  # fmt: skip
        self.norm = RMSNorm(h, eps=config.hf.rms_norm_eps, dtype=dtype, param_dtype=param_dtype,
                            rngs=rngs)  # fmt: skip
        self.lm_head = nnx.Linear(h, config.draft_vocab_size, **linear)
        self.embed_tokens = nnx.data(None)
        if own_embeddings:
            self.embed_tokens = nnx.Embed(config.vocab_size, h, dtype=dtype,
                                          param_dtype=param_dtype, rngs=rngs)  # fmt: skip
        # i32[draft_vocab_size]: draft id -> target id (i + d2t[i]).
        self.draft_to_target = VocabMap(jnp.arange(config.draft_vocab_size, dtype=jnp.int32))

    def combine_hidden_states(self, aux: jax.Array) -> jax.Array:
        """``aux [T, num_aux * target_hidden_size]`` (the target's streams, concatenated) ->
        the first draft step's features ``[T, hidden_size]``."""
        return self.fc(aux)

    def __call__(
        self,
        input_ids: jax.Array,
        hidden: jax.Array,
        positions: jax.Array,
        kv_cache: tuple[jax.Array, jax.Array],
        metadata: AttentionMetadata,
        *,
        embed_tokens: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array, tuple[jax.Array, jax.Array]]:
        """One draft pass over ``T`` packed tokens.

        Args:
            input_ids: i32[T], for each position the token that follows it (the target's
                input shifted left by one, the newly sampled or drafted token last).
            hidden: [T, hidden_size] features: :meth:`combine_hidden_states` of the target's
                streams (first pass), or the previous pass's ``prenorm`` output.
            positions: i32[T] positions (the target's).
            kv_cache: the head's ``(k_cache, v_cache)``, each ``[num_blocks, block_size, Hkv,
                D]``, addressed by ``metadata`` like the target's layers.
            metadata: the target's attention metadata for these tokens.
            embed_tokens: ``[vocab_size, hidden_size]`` the target's embedding table, for a
                head without its own.

        Returns:
            ``(normed [T, hidden_size] for :meth:`compute_logits`, prenorm [T, hidden_size] the
            next pass's features, (k_cache, v_cache))``.

        Raises:
            ValueError: neither the head nor the call gives an embedding table.
        """
        if self.embed_tokens is not None:
            embeds = self.embed_tokens(input_ids)
        elif embed_tokens is not None:
            embeds = embed_tokens[input_ids].astype(hidden.dtype)
        else:
            raise ValueError("this EAGLE-3 head has no embed_tokens: pass the target's")
        out, k_cache, v_cache = self.midlayer(embeds, hidden, positions, *kv_cache, metadata)
        return self.norm(out), out, (k_cache, v_cache)

    def compute_logits(self, normed: jax.Array) -> jax.Array:
        """``normed [N, hidden_size] -> f32[N, vocab_size]``: the draft vocabulary's logits at
        their target ids, -inf elsewhere (vLLM's scatter), so the argmax is a target id."""
        draft = self.compute_draft_logits(normed)
        full = jnp.full((normed.shape[0], self.config.vocab_size), -jnp.inf, jnp.float32)
        return full.at[:, self.draft_to_target[...]].set(draft)

    def compute_draft_logits(self, normed: jax.Array) -> jax.Array:
        """``normed [N, hidden_size] -> f32[N, draft_vocab_size]`` (the lm_head alone)."""
        kernel = self.lm_head.kernel[...].astype(normed.dtype)
        return jnp.einsum("nh,hv->nv", normed, kernel, preferred_element_type=jnp.float32,
                          precision=_precision(normed.dtype))  # fmt: skip

    def draft_token_ids(self, normed: jax.Array) -> jax.Array:
        """i32[N] greedy draft tokens as target ids (argmax over the draft vocabulary, mapped:
        cheaper than :meth:`compute_logits`' full-vocabulary scatter, same result)."""
        best = jnp.argmax(self.compute_draft_logits(normed), axis=-1)
        return self.draft_to_target[...][best]


def load_eagle3(
    model_dir: str,
    *,
    target_vocab_size: int,
    dtype: str | Any = "auto",
    load_format: str = "auto",
    attention_backend: str = "reference",
    interpret: bool = False,
    seed: int = 0,
) -> Eagle3DraftModel:
    """Build the head of ``model_dir`` and fill it from its safetensors, or with dummy weights.

    Args:
        model_dir: a directory with the head's ``config.json`` and (unless dummy) weights.
        target_vocab_size: the target's vocabulary; the head's ``vocab_size`` and every
            ``d2t`` target id must fit it.
        dtype: "auto" (the config's ``torch_dtype``) or a dtype name (``models.dtypes``).
        load_format: "auto"/"safetensors" or "dummy" (``normal * 0.02``, norms ones, and a
            vocabulary map of ``draft_vocab_size`` evenly spaced target ids).

    Raises:
        ValueError: a bad config, a head for another vocabulary, a tensor missing or of the
            wrong shape (named with its HF name), or a ``d2t`` that leaves the vocabulary.
    """
    config = Eagle3Config.from_dir(model_dir)
    if config.vocab_size != target_vocab_size:
        raise ValueError(
            f"EAGLE-3 head {model_dir!r} has vocab_size {config.vocab_size}, the target "
            f"{target_vocab_size}"
        )
    resolved = resolve_dtype(dtype, config.hf)
    with ExitStack() as stack:
        reader = None if load_format == "dummy" else open_reader(model_dir, config.hf, stack)
        own = reader is not None and "embed_tokens.weight" in reader
        abstract = nnx.eval_shape(lambda: Eagle3DraftModel(
            config, dtype=resolved, param_dtype=resolved, attention_backend=attention_backend,
            interpret=interpret, own_embeddings=own, rngs=nnx.Rngs(seed),
        ))  # fmt: skip
        graphdef, state = nnx.split(abstract)
        flat = nnx.to_flat_state(state)
        params = [(path, v) for path, v in flat if isinstance(v, nnx.Param)]
        if reader is None:
            values = _dummy_params(params, resolved, seed)
            vocab_map = np.round(np.linspace(0, target_vocab_size - 1, config.draft_vocab_size))
        else:
            plans = plan_params(params, merged_output_sizes(abstract), reader, model_dir)
            values = [(p.path, v.replace(read_param(reader, p, resolved)))
                      for p, (_, v) in zip(plans, params, strict=True)]  # fmt: skip
            vocab_map = _read_vocab_map(reader, config, model_dir)
    if vocab_map.min() < 0 or vocab_map.max() >= target_vocab_size:
        raise ValueError(
            f"EAGLE-3 head {model_dir!r}: d2t maps draft ids outside the target vocabulary "
            f"[0, {target_vocab_size})"
        )
    table = [(path, v.replace(jnp.asarray(vocab_map, jnp.int32)))
             for path, v in flat if isinstance(v, VocabMap)]  # fmt: skip
    return nnx.merge(graphdef, nnx.from_flat_state(values + table))


def _dummy_params(params: list, dtype: Any, seed: int) -> list:
    key = jax.random.key(seed)
    filled = []
    for i, (path, variable) in enumerate(params):
        shape = tuple(variable.get_value().shape)
        if str(path[-1]) == "weight":  # RMSNorm
            value = jnp.ones(shape, dtype)
        else:
            value = dummy_normal(key, i, shape=shape, dtype=jnp.dtype(dtype))
        filled.append((path, variable.replace(value)))
    return filled


def _read_vocab_map(reader: Any, config: Eagle3Config, model_dir: str) -> np.ndarray:
    """Target id of each draft id, ``i + d2t[i]``; the identity without ``d2t`` (a head over
    the whole vocabulary)."""
    n = config.draft_vocab_size
    if "d2t" not in reader:
        if n != config.vocab_size:
            raise ValueError(
                f"EAGLE-3 head {model_dir!r} has draft_vocab_size {n} < vocab_size "
                f"{config.vocab_size} but no d2t tensor"
            )
        return np.arange(n)
    if reader.shape("d2t") != (n,):
        raise ValueError(
            f"EAGLE-3 head {model_dir!r}: d2t has shape {reader.shape('d2t')}, expected ({n},)"
        )
    return np.arange(n) + np.asarray(reader.read("d2t"), np.int64)
