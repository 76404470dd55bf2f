"""Per-layer FP8 KV-cache scales (``kv_cache_dtype="fp8"``): where they live and where they come from.

Each attention layer of a model served with an FP8 KV cache has two ``f32[]`` scales,
``k_scale`` and ``v_scale`` (vLLM's ``Attention._k_scale`` / ``_v_scale``): the cache stores
``fp8(k / k_scale)`` and the kernels read ``float(k_fp8) * k_scale``
(``pallas_kernels.fp8_kv_cache``). They are :class:`KVScale` variables of the attention module,
so they travel with the weights into the jitted step as traced leaves (one compiled step serves
every layer) and are replicated under tensor parallelism. The weight loaders never see them: the
model is built and loaded without scales (a float cache), and the worker attaches them afterwards
with :func:`attach_kv_scales`.

Their values come from the checkpoint (:func:`read_kv_scales`: ``<layer>.self_attn.k_scale`` /
``v_scale``, as llm-compressor writes them for a compressed-tensors ``kv_cache_scheme``, and as
vLLM's ``BaseKVCacheMethod`` reads them), else vLLM's default of 1.0.
"""

from __future__ import annotations

import glob
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import safetensors
from flax import nnx

# "model.layers.3.self_attn.k_scale" (Llama family), "transformer.h.3.attn.v_scale" (GPT-2).
_SCALE_NAME = re.compile(
    r"(?:^|\.)(?:layers|h)\.(\d+)\.(?:self_attn|attn|self_attention)\.([kv])_scale$"
)


class KVScale(nnx.Variable):
    """An FP8 KV-cache scale, ``f32[]``: model state, but not a trainable ``nnx.Param`` and not
    a checkpoint weight the loaders fill."""


class FP8KVScales:
    """Mixin of an attention module that can read an FP8 KV cache: ``k_scale`` / ``v_scale``
    are None (a float cache) until :meth:`set_kv_scales`. The module's ``__init__`` must call
    :meth:`init_kv_scales`."""

    def init_kv_scales(self) -> None:
        self.k_scale = self.v_scale = nnx.data(None)

    def set_kv_scales(self, k_scale: jax.Array, v_scale: jax.Array) -> None:
        """Attach the layer's scales (``f32[]`` arrays, already placed on the device(s))."""
        self.k_scale, self.v_scale = KVScale(k_scale), KVScale(v_scale)

    def kv_scales(self) -> tuple[jax.Array | None, jax.Array | None]:
        """``(k_scale, v_scale)`` as arrays, or ``(None, None)`` without an FP8 cache."""
        if self.k_scale is None:
            return None, None
        return self.k_scale[...], self.v_scale[...]


def read_kv_scales(model_dir: str, num_layers: int) -> list[tuple[float, float]] | None:
    """The checkpoint's per-layer ``(k_scale, v_scale)``, or None if it stores none.

    Reads every ``*.safetensors`` file of ``model_dir`` for tensors named
    ``<prefix>.layers.<i>.self_attn.{k,v}_scale`` (or ``h.<i>.attn``), each one element.

    Raises:
        ValueError: a checkpoint with some scales but not both of every layer (naming the first
            missing tensor), a scale with more than one element, or one that is not finite and
            positive (naming the tensor and the value).
    """
    found: dict[tuple[int, str], tuple[str, float]] = {}
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safetensors.safe_open(path, framework="flax") as f:
            for name in f.keys():
                match = _SCALE_NAME.search(name)
                if match is None:
                    continue
                tensor = np.asarray(f.get_tensor(name), np.float32)
                if tensor.size != 1:
                    raise ValueError(
                        f"KV cache scale {name} must hold one value, got shape {tensor.shape}"
                    )
                value = float(tensor.reshape(()))
                if not (math.isfinite(value) and value > 0):
                    raise ValueError(f"KV cache scale {name} must be finite and > 0, got {value}")
                found[(int(match.group(1)), match.group(2))] = (name, value)
    if not found:
        return None
    scales = []
    for layer in range(num_layers):
        pair = []
        for kind in ("k", "v"):
            if (layer, kind) not in found:
                example = next(iter(found.values()))[0]
                missing = _SCALE_NAME.sub(f".layers.{layer}.self_attn.{kind}_scale", example)
                raise ValueError(
                    f"checkpoint {model_dir} has KV cache scales but not {missing.lstrip('.')} "
                    f"(every layer needs k_scale and v_scale)"
                )
            pair.append(found[(layer, kind)][1])
        scales.append((pair[0], pair[1]))
    return scales


def attach_kv_scales(
    model: nnx.Module, scales: list[tuple[float, float]], *, sharding=None
) -> None:
    """Give the ``len(scales)`` attention modules of ``model`` (in layer order) their scales.

    Args:
        model: a loaded model whose attention modules are :class:`FP8KVScales`.
        scales: per layer ``(k_scale, v_scale)``.
        sharding: where the ``f32[]`` scales go (tensor parallelism: replicated over the mesh);
            None: the default device.

    Raises:
        ValueError: a model whose number of FP8-capable attention modules is not
            ``len(scales)``.
    """
    modules = [m for _, m in nnx.iter_graph(model) if isinstance(m, FP8KVScales)]
    if len(modules) != len(scales):
        raise ValueError(
            f"the model has {len(modules)} attention layers that can read an FP8 KV cache, "
            f"got scales for {len(scales)} layers"
        )
    for module, (k_scale, v_scale) in zip(modules, scales, strict=True):
        k, v = (jax.device_put(jnp.float32(s), sharding) for s in (k_scale, v_scale))
        module.set_kv_scales(k, v)
