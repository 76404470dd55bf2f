"""Loading the quantized layers of a model (``models.quantized_linear``): host first, then device.

Both loaders (``models.weights`` on one device, ``models.sharded_weights`` over a ``tp`` mesh)
call these in the same order, so a bad checkpoint never half-loads:

1. :func:`read_quantized_layers` (or :func:`dummy_quantized_layers`) builds every quantized
   layer's tensors on the host: each HF part (``q_proj``, ``k_proj``, ``v_proj`` of
   ``qkv_proj``; ``gate_proj``, ``up_proj`` of ``gate_up_proj``) is read by the suffixes of
   ``method.tensor_specs`` and checked and converted by ``method.load`` (online ``fp8`` and
   ``bitsandbytes`` quantize here), the parts are fused in ``models.merged_linear``'s per-shard
   column order (``merge_column_parts``), and act-order layers that are whole or
   column-parallel are sorted by group (``method.sort_act_order``: GPTQ ``desc_act`` and
   compressed-tensors ``actorder: group``; a row-parallel one keeps ``g_idx`` with replicated
   scales). Any error (a missing tensor, a shape or dtype, a ``g_idx`` value) is raised here,
   naming the tensor, before the loader puts anything on a device.
2. The loader fills the float parameters as usual (they check all their tensors first too).
3. :func:`place_quantized_layers` puts each layer's tensors on the device(s) and attaches them.

Host memory holds the quantized layers (not the float ones) between steps 1 and 3: 0.5 to 1
byte per quantized weight.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from models.lora import LORA_PROJECTIONS
from models.quantization.merge import merge_column_parts
from models.quantized_linear import QuantizedLinear, QuantizedMergedColumnParallelLinear
from models.sharding import parallel_style

# Scale of the dummy float weights quantized at load (as models.weights' _DUMMY_STD).
_DUMMY_STD = 0.02

LayerPath = tuple[str, ...]
HostLayers = dict[LayerPath, dict[str, np.ndarray]]


def quantized_layers(model: nnx.Module) -> list[tuple[LayerPath, QuantizedLinear]]:
    """Every quantized layer of ``model`` (abstract or concrete) with its module path
    (``("model", "layers", "0", "self_attn", "qkv_proj")``), in graph order."""
    return [
        (tuple(str(p) for p in path), node)
        for path, node in nnx.iter_graph(model)
        if isinstance(node, QuantizedLinear)
    ]


def _parts(path: LayerPath, module: QuantizedLinear) -> list[tuple[str, int]]:
    """(HF prefix, output size) of each checkpoint module the layer is fused from."""
    parent = ".".join(path[:-1])
    if isinstance(module, QuantizedMergedColumnParallelLinear):
        names, sizes = LORA_PROJECTIONS[path[-1]], module.output_sizes
    else:
        names, sizes = (path[-1],), (module.out_features,)
    return [(f"{parent}.{name}", size) for name, size in zip(names, sizes, strict=True)]


def _host_layer(
    path: LayerPath,
    module: QuantizedLinear,
    tensors_of: Callable[[str, list[str], int], dict[str, np.ndarray]],
    num_shards: int,
) -> dict[str, np.ndarray]:
    method, in_features = module.method, module.in_features
    parts, sizes = [], []
    for prefix, size in _parts(path, module):
        suffixes = list(method.tensor_specs(in_features, size))
        parts.append(method.load(prefix, tensors_of(prefix, suffixes, size), in_features, size))
        sizes.append(size)
    name = ".".join(path)
    if len(parts) == 1:
        tensors = parts[0]
    else:
        tensors = merge_column_parts(method.method, parts, sizes, num_shards, prefix=name)
    if num_shards == 1 or parallel_style(path[-1]) == "column":
        tensors = method.sort_act_order(tensors, prefix=name)
    return tensors


def read_quantized_layers(
    layers: list[tuple[LayerPath, QuantizedLinear]], reader: Any, num_shards: int
) -> HostLayers:
    """Every layer's tensors on the host, from a checkpoint ``reader``
    (``models.weights._TensorReader``: ``name in reader``, ``reader.read(name)``,
    ``reader.is_view(name)``).

    Raises:
        ValueError: anything ``method.load`` / ``merge_column_parts`` / ``sort_act_order`` raise
            (a missing tensor, a wrong shape or dtype, a bad ``g_idx``; named), or a quantized
            module stored fused in the checkpoint (Phi-3's ``qkv_proj``), whose packed tensors
            cannot be split by rows.
    """

    def tensors_of(prefix: str, suffixes: list[str], size: int) -> dict[str, np.ndarray]:
        del size
        out = {}
        for suffix in suffixes:
            name = f"{prefix}.{suffix}"
            if name not in reader:
                continue  # method.load names it if it is required
            if reader.is_view(name):
                raise ValueError(
                    f"tensor {name} is part of a fused checkpoint tensor; quantized fused "
                    "checkpoint modules (Phi-3's qkv_proj / gate_up_proj) are not supported"
                )
            out[suffix] = np.asarray(reader.read(name))
        return out

    return {path: _host_layer(path, module, tensors_of, num_shards) for path, module in layers}


def dummy_quantized_layers(
    layers: list[tuple[LayerPath, QuantizedLinear]], seed: int, num_shards: int
) -> HostLayers:
    """``load_format="dummy"``: each part's float weight ``[out, in]`` drawn as ``normal * 0.02``
    (numpy, from ``(seed, layer, part)``; the same for every ``num_shards``) and quantized at
    once, so host memory holds one float layer at a time.

    Raises:
        ValueError: a method that does not quantize at load (``awq``, ``gptq``,
            ``compressed-tensors``, pre-quantized ``fp8`` / ``bitsandbytes``).
    """
    return {
        path: _host_layer(path, module, _dummy_weights(module, seed, index), num_shards)
        for index, (path, module) in enumerate(layers)
    }


def _dummy_weights(module: QuantizedLinear, seed: int, index: int):
    """``tensors_of`` for :func:`_host_layer`: part ``p``'s float weight from ``(seed, index, p)``."""
    part_index = itertools.count()

    def tensors_of(prefix: str, suffixes: list[str], size: int) -> dict[str, np.ndarray]:
        del suffixes
        if not module.method.quantizes_at_load:
            raise ValueError(
                f"load_format='dummy' draws float weights and quantizes them at load, which "
                f"only quantization 'fp8' and 'bitsandbytes' do on an unquantized checkpoint; "
                f"got {module.method.method!r} for {prefix}"
            )
        rng = np.random.default_rng((seed, index, next(part_index)))
        weight = rng.standard_normal((size, module.in_features), dtype=np.float32)
        return {"weight": weight * np.float32(_DUMMY_STD)}

    return tensors_of


def place_quantized_layers(
    model: nnx.Module,
    host: HostLayers,
    sharding_of: Callable[[LayerPath, QuantizedLinear, str, tuple[int, ...]], Any] | None = None,
) -> None:
    """Put each layer's host tensors on the device(s) and attach them to ``model``'s layers.

    ``sharding_of(path, module, tensor name, shape)`` gives each tensor's sharding; None: the
    default device.
    """
    for path, module in quantized_layers(model):
        tensors = {}
        for name, array in host[path].items():
            sharding = None if sharding_of is None else sharding_of(path, module, name, array.shape)
            tensors[name] = jax.device_put(array, sharding)
        module.set_tensors(tensors)


def quantized_weight_bytes(model: nnx.Module) -> tuple[int, int]:
    """``(bytes of the quantized layers' tensors, bytes of the same layers' weights in
    float of the model's compute dtype)``, whole model (all shards), biases excluded."""
    stored = unquantized = 0
    for _, module in quantized_layers(model):
        stored += sum(int(t.nbytes) for t in module.tensors().values())
        itemsize = np.dtype(module.dtype).itemsize
        unquantized += module.in_features * module.out_features * itemsize
    return stored, unquantized
