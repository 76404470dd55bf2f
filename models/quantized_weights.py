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
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from models.dummy_init import DUMMY_STD, dummy_normal
from models.lora import LORA_PROJECTIONS
from models.quantization.merge import merge_column_parts
from models.quantization.stored import TensorSpec
from models.quantized_linear import QuantizedLinear, QuantizedMergedColumnParallelLinear
from models.sharding import parallel_style

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
    """``load_format="dummy"``: every layer's tensors drawn from ``(seed, layer, part)`` (the
    same for every ``num_shards``), then checked, fused and sorted as a checkpoint's, and held on
    the host.

    - Methods that quantize at load (online ``fp8``, ``bitsandbytes``): each part's float weight
      ``[out, in]`` drawn on the default device in the layer's compute dtype
      (``models.dummy_init.dummy_normal``, key ``fold_in(key(seed), layer)``, index ``part``) and
      quantized there (one float weight at a time); only the quantized tensors reach the host.
    - Pre-quantized methods (``awq``, ``gptq``, ``compressed-tensors``, serialized ``fp8``,
      pre-quantized ``bitsandbytes``): the stored tensors of ``method.tensor_specs``, of exactly
      the checkpoint's shapes and dtypes, drawn directly (:func:`dummy_stored_tensors`): random packed
      int32 words and int8 / FP8 values, small positive scales, blocked ``g_idx``. No float
      weight is made, so an 8B model draws in seconds.
    """
    return {
        path: _host_layer(path, module, _dummy_weights(module, seed, index), num_shards)
        for index, (path, module) in enumerate(layers)
    }


def _dummy_weights(module: QuantizedLinear, seed: int, index: int):
    """``tensors_of`` for :func:`_host_layer`: part ``p``'s tensors from ``(seed, index, p)``."""
    part_index = itertools.count()

    def tensors_of(prefix: str, suffixes: list[str], size: int) -> dict[str, np.ndarray]:
        del prefix, suffixes
        part = next(part_index)
        if module.method.quantizes_at_load:  # drawn and quantized on the device
            key = jax.random.fold_in(jax.random.key(seed), index)
            shape = (size, module.in_features)
            return {"weight": dummy_normal(key, part, shape=shape, dtype=jnp.dtype(module.dtype))}
        rng = np.random.default_rng((seed, index, part))
        specs = module.method.tensor_specs(module.in_features, size)
        # llm-compressor saves scales in the model's dtype; AutoAWQ / GPTQ tools in float16.
        scale_dtype = module.dtype if module.method.method == "compressed-tensors" else None
        return dummy_stored_tensors(rng, specs, module.in_features, size, scale_dtype)

    return tensors_of


# Std of the stored values' contribution to a dequantized weight: 4-bit offsets ``q - z`` with
# random zeros (about 6.5), int8 values (about 74), the FP8 values drawn below (about 0.6). The
# dummy scales are ``DUMMY_STD`` over it, so every format dequantizes to weights of about 0.02.
_VALUE_STD = {"int32": 6.5, "int8": 74.0, "float8_e4m3fn": 0.6}
_STATIC_INPUT_SCALE = 0.01  # a static activation scale (W8A8 input_scale)
_ML_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float8_e4m3fn": ml_dtypes.float8_e4m3fn}


def dummy_stored_tensors(
    rng: np.random.Generator, specs: Mapping[str, TensorSpec], in_features: int,
    out_features: int, scale_dtype: Any = None,
) -> dict[str, np.ndarray]:
    """One layer part's stored tensors (suffix -> array) for ``specs`` (``method.tensor_specs(
    in_features, out_features)``), each of its spec's shape and first dtype; optional tensors
    (GPTQ's ``g_idx`` without ``desc_act``) are left out.

    - packed ``i32`` words and ``i8`` values: uniformly random bits;
    - FP8 values: random bytes with the top exponent bit cleared (``|v| < 2``, never NaN);
    - float scales: ``0.02 / value std`` spread by ±50% (``SCB``, an absmax: times 127), in
      ``scale_dtype`` if given and allowed by the spec;
    - ``weight_shape``: the unpacked ``(out, in)``; ``g_idx`` / ``weight_g_idx`` (required
      with act-order): the blocked ``i // group_size``, a valid act-order that sorts to itself.
    """
    values = next(s for n, s in specs.items() if n in ("qweight", "weight_packed", "weight"))
    value_dtype = values.dtypes[0]
    out = {}
    for name, spec in specs.items():
        if spec.optional:
            continue
        stored = spec.dtypes[0]
        if scale_dtype is not None and np.dtype(scale_dtype).name in spec.dtypes:
            stored = np.dtype(scale_dtype).name
        dtype = np.dtype(_ML_DTYPES.get(stored, stored))
        if name == "weight_shape":
            out[name] = np.asarray([out_features, in_features], dtype=dtype)
        elif name.endswith("g_idx"):
            groups = (specs["scales"].shape[0] if "scales" in specs
                      else specs["weight_scale"].shape[1])  # fmt: skip
            out[name] = (np.arange(in_features) // (in_features // groups)).astype(dtype)
        elif str(dtype) in ("int32", "int8"):
            out[name] = _random_bits(rng, spec.shape, dtype)
        elif str(dtype) == "float8_e4m3fn":
            bits = _random_bits(rng, spec.shape, np.dtype(np.uint8)) & np.uint8(0xBF)
            out[name] = bits.view(dtype)
        elif name == "input_scale":
            out[name] = np.full(spec.shape, _STATIC_INPUT_SCALE, dtype=dtype)
        else:
            scale = DUMMY_STD / _VALUE_STD[value_dtype] * (127.0 if name == "SCB" else 1.0)
            out[name] = (scale * rng.uniform(0.5, 1.5, spec.shape)).astype(dtype)
    return out


def _random_bits(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Uniformly random bits of ``shape`` and ``dtype`` from the bit generator's raw 64-bit
    words (about 1 GB/s on one core, a few times ``rng.integers``)."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    words = rng.bit_generator.random_raw(-(-nbytes // 8))
    return words.view(np.uint8)[:nbytes].view(dtype).reshape(shape)


def place_quantized_layers(
    model: nnx.Module,
    host: HostLayers,
    sharding_of: Callable[[LayerPath, QuantizedLinear, str, tuple[int, ...]], Any] | None = None,
) -> None:
    """Put each layer's host tensors on the device(s), in the layout of the layer's linear
    backend (``method.repack``), and attach them to ``model``'s layers.

    ``sharding_of(path, module, tensor name, shape)`` gives each tensor's sharding; None: the
    default device.
    """
    for path, module in quantized_layers(model):
        tensors = {}
        for name, array in host[path].items():
            sharding = None if sharding_of is None else sharding_of(path, module, name, array.shape)
            tensors[name] = jax.device_put(array, sharding)
        module.set_tensors(module.method.repack(tensors, module.in_features, module.out_features))


def quantized_weight_bytes(model: nnx.Module) -> tuple[int, int]:
    """``(bytes of the quantized layers' tensors, bytes of the same layers' weights in
    float of the model's compute dtype)``, whole model (all shards), biases excluded."""
    stored = unquantized = 0
    for _, module in quantized_layers(model):
        stored += sum(int(t.nbytes) for t in module.tensors().values())
        itemsize = np.dtype(module.dtype).itemsize
        unquantized += module.in_features * module.out_features * itemsize
    return stored, unquantized
