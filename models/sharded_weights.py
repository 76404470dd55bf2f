"""Loading a model straight into its tensor-parallel shards (``models.sharding`` has the layout).

No parameter is ever whole on one device. From safetensors, each parameter is built with
``jax.make_array_from_callback``: the callback receives one device's index into the global
array and reads only that slice from the file (``safe_open(...).get_slice(name)[index]``), so
host memory holds one shard at a time. With ``load_format="dummy"`` each parameter is generated
by a jitted function with ``out_shardings``; JAX's partitionable threefry makes every device
draw its own slice, and the values equal the single-device dummies of ``models.weights``
(``normal * 0.02`` from ``fold_in(key(seed), i)`` for parameter ``i`` in flat-state order).

The physical model can differ from the checkpoint along one axis of a few parameters
(``models.sharding``): the k/v columns repeat each KV head ``r`` times when ``Hkv < tp``, and
gate/up columns and down rows are zero-padded to a multiple of ``tp``. Each such axis carries an
index map ``physical index -> checkpoint index`` (``-1``: zero). A fused parameter
(``qkv_proj``, ``gate_up_proj``) is filled from several HF tensors: its checkpoint is their
concatenation along the output axis (``[q | k | v]``, the one-device layout), and its output
axis map composes the per-shard column order of ``models.merged_linear`` with each part's own
map (repeat, pad). A device then reads, from each part's tensor, only the columns it holds.
A stacked expert parameter (``models.moe``, ``[E, in, out]``) is read expert by expert, each
expert's slice mapped like a plain (or fused gate/up) parameter; a fused checkpoint tensor
(Phi-3) is read through ``models.weights.fused_checkpoint_views``.
"""

from __future__ import annotations

import functools
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from models.dummy_init import dummy_normal
from models.merged_linear import merged_column_order
from models.quantization.config import QuantizationConfig
from models.quantized_weights import (
    dummy_quantized_layers,
    place_quantized_layers,
    quantized_layers,
    read_quantized_layers,
)
from models.registry import checkpoint_view, get_model_class
from models.sharding import (
    TP_AXIS,
    param_partition_spec,
    quantized_partition_spec,
    tp_model_config,
)
from models.tp_layout import TPLayout
from models.weights import (
    _LOAD_FORMATS,
    EXPERT_PARAMS,
    FUSED_MODULES,
    abstract_model,
    check_checkpoint_layers,
    check_tensor,
    expert_hf_names,
    hf_names,
    is_expert_param,
    load_config,
    merged_output_sizes,
    model_quantization,
    open_reader,
    resolve_dtype,
)

if TYPE_CHECKING:  # transformers imports PyTorch when installed: only when a config is read
    import transformers

# An axis map: ("repeat", heads, replicas, head_dim), ("pad", checkpoint_size) or
# ("fused", num_shards, ((part_size, part_map), ...)); None: identity.
AxisMap = tuple | None


def load_sharded_model(
    model_dir: str,
    *,
    mesh: Mesh,
    dtype: str | Any = "auto",
    load_format: str = "auto",
    attention_backend: str = "reference",
    interpret: bool = False,
    seed: int = 0,
    quant_config: QuantizationConfig | None = None,
    hf_config: Any = None,
) -> tuple[nnx.Module, transformers.PretrainedConfig]:
    """``models.weights.load_model`` for a ``("tp",)`` mesh: same arguments plus ``mesh``.

    Quantized layers (``models.quantized_weights``) are fused for ``tp`` shards and each tensor
    is split on the axis ``models.sharding.quantized_partition_spec`` gives; the whole layer is
    built on the host first (quantized: 0.5 to 1 byte per weight).

    Returns:
        ``(model, hf_config)``: the model is built from ``tp_model_config`` (repeated KV heads,
        padded intermediate size), its parameters are sharded as ``param_partition_spec`` and
        its attention runs per device; ``hf_config`` is the checkpoint's, unchanged.

    Raises:
        ValueError: everything ``load_model`` raises, plus an impossible layout
            (``models.sharding.TPLayout``); a quantized model whose layout repeats KV heads
            (``Hkv < tp``) or pads the intermediate size (not implemented for packed tensors),
            or a quantized tensor whose split axis does not divide by ``tp`` (named).
    """
    if load_format not in _LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {list(_LOAD_FORMATS)}, got {load_format!r}")
    if hf_config is None:
        hf_config = load_config(model_dir)
    model_class = get_model_class(hf_config)
    resolved = resolve_dtype(dtype, hf_config)
    layout = TPLayout.from_hf_config(hf_config, mesh.shape[TP_AXIS])
    physical_config = tp_model_config(hf_config, layout)
    quant_config = model_quantization(hf_config, quant_config, load_format)
    if load_format != "dummy":  # before the model is built: its size follows the config
        check_checkpoint_layers(model_dir, hf_config)
    if quant_config is not None and (
        layout.kv_head_replicas > 1 or layout.intermediate_size_padded != layout.intermediate_size
    ):
        raise ValueError(
            f"quantization {quant_config.method!r} with tensor_parallel_size "
            f"{layout.tensor_parallel_size} needs num_key_value_heads ({layout.num_kv_heads}) and "
            f"intermediate_size ({layout.intermediate_size}) divisible by it: repeated KV heads "
            "and padded MLP columns are not implemented for quantized layers"
        )

    abstract = abstract_model(
        model_class,
        physical_config,
        resolved,
        attention_backend=attention_backend,
        interpret=interpret,
        seed=seed,
        mesh=mesh,
        quant_config=quant_config,
    )
    graphdef, abstract_state = nnx.split(abstract)
    flat_state = nnx.to_flat_state(abstract_state)
    merged = merged_output_sizes(abstract)
    params = []
    for path, variable in flat_state:
        shape = tuple(variable.get_value().shape)
        sharding = NamedSharding(mesh, param_partition_spec(path, layout))
        params.append((path, variable, shape, sharding, axis_maps(path, shape, layout, merged)))
    tp = layout.tensor_parallel_size
    if load_format == "dummy":
        quantized = dummy_quantized_layers(quantized_layers(abstract), seed, num_shards=tp)
        filled = _dummy_state(params, resolved, seed)
    else:
        with ExitStack() as stack:  # quantized layers read and checked on the host first
            reader = open_reader(model_dir, hf_config, stack, checkpoint_view(hf_config))
            quantized = read_quantized_layers(quantized_layers(abstract), reader, num_shards=tp)
        filled = _load_state(
            params, model_dir, resolved, hf_config, checkpoint_view(hf_config)
        )
    model = nnx.merge(graphdef, nnx.from_flat_state(filled))
    place_quantized_layers(model, quantized, _quantized_sharding(mesh))
    return model, hf_config


def _quantized_sharding(mesh: Mesh):
    """``sharding_of`` for ``place_quantized_layers``: the tensor's spec on ``mesh``, after
    checking that its split axis divides into whole shards (whole words and groups)."""

    def sharding_of(path, module, name, shape):
        spec = quantized_partition_spec(path[-1], module.method, name, shape)
        tp = mesh.shape[TP_AXIS]
        for axis, entry in enumerate(spec):
            if entry == TP_AXIS and shape[axis] % tp:
                raise ValueError(
                    f"tensor {'.'.join(path)}.{name} of shape {tuple(shape)} cannot be split "
                    f"over tensor_parallel_size {tp} along axis {axis}"
                )
        return NamedSharding(mesh, spec)

    return sharding_of


def axis_maps(
    path: tuple,
    shape: tuple[int, ...],
    layout: TPLayout,
    merged: dict[tuple[str, ...], tuple[int, ...]] | None = None,
) -> tuple[AxisMap, ...]:
    """Per axis of the physical parameter ``shape``, how it maps onto the checkpoint's.

    ``merged``: ``models.weights.merged_output_sizes`` of the model; a parameter of a fused
    module there gets a ``"fused"`` map on its last (output) axis, built from its parts' maps.
    """
    module, leaf = str(path[-2]), str(path[-1])
    if is_expert_param(path):  # [E, in, out]: the expert axis maps to itself
        parts = EXPERT_PARAMS[leaf]
        size = shape[-1] // len(parts)
        hf_module = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
        part_maps = [_module_axis_maps(hf_module[p], "kernel", shape[1:-1] + (size,), layout)
                     for p in parts]  # fmt: skip
        if len(parts) == 1:
            return (None, *part_maps[0])
        fused = ("fused", layout.tensor_parallel_size,
                 tuple((size, m[-1]) for m in part_maps))  # fmt: skip
        return (None, *[None] * (len(shape) - 2), fused)
    sizes = (merged or {}).get(tuple(str(p) for p in path[:-1]))
    if sizes is not None:
        parts = tuple(
            (size, _module_axis_maps(part, leaf, (*shape[:-1], size), layout)[-1])
            for part, size in zip(FUSED_MODULES[module], sizes, strict=True)
        )
        return (*[None] * (len(shape) - 1), ("fused", layout.tensor_parallel_size, parts))
    return _module_axis_maps(module, leaf, shape, layout)


def _module_axis_maps(
    module: str, leaf: str, shape: tuple[int, ...], layout: TPLayout
) -> tuple[AxisMap, ...]:
    """:func:`axis_maps` of a parameter of the unfused (HF) module ``module``."""
    maps: list[AxisMap] = [None] * len(shape)
    out_axis = 1 if leaf == "kernel" else 0
    if module in ("k_proj", "v_proj") and layout.kv_head_replicas > 1:
        head_dim = shape[out_axis] // layout.num_kv_heads_physical
        maps[out_axis] = ("repeat", layout.num_kv_heads, layout.kv_head_replicas, head_dim)
    padded = layout.intermediate_size_padded != layout.intermediate_size
    if padded and module in ("gate_proj", "up_proj"):
        maps[out_axis] = ("pad", layout.intermediate_size)
    if padded and module == "down_proj" and leaf == "kernel":
        maps[0] = ("pad", layout.intermediate_size)
    return tuple(maps)


def _checkpoint_size(axis_map: AxisMap, size: int) -> int:
    if axis_map is None:
        return size
    if axis_map[0] == "repeat":
        _, heads, _, head_dim = axis_map
        return heads * head_dim
    if axis_map[0] == "fused":
        return sum(_checkpoint_size(part_map, n) for n, part_map in axis_map[2])
    return axis_map[1]


@functools.cache
def map_indices(axis_map: tuple, size: int) -> np.ndarray:
    """``i64[size]``: the checkpoint index of each physical index, ``-1`` for zero padding.

    ``"fused"``: physical column -> (part, its physical index in the part) by the per-shard
    order of ``models.merged_linear``, then the part's own map, then the part's offset in the
    concatenated checkpoint ``[part_0 | part_1 | ...]``.
    """
    physical = np.arange(size)
    if axis_map[0] == "repeat":
        _, _, replicas, head_dim = axis_map
        return (physical // head_dim // replicas) * head_dim + physical % head_dim
    if axis_map[0] == "fused":
        _, num_shards, parts = axis_map
        sizes = [n for n, _ in parts]
        whole = merged_column_order(sizes, num_shards)  # index in [part_0 | part_1 | ...]
        physical_offsets = np.cumsum([0, *sizes])
        checkpoint_offsets = np.cumsum([0, *(_checkpoint_size(m, n) for n, m in parts)])
        part_of = np.searchsorted(physical_offsets, whole, side="right") - 1
        out = np.empty(size, np.int64)
        for p, (n, part_map) in enumerate(parts):
            selected = part_of == p
            index = whole[selected] - physical_offsets[p]
            if part_map is not None:
                index = map_indices(part_map, n)[index]
            out[selected] = np.where(index >= 0, index + checkpoint_offsets[p], -1)
        return out
    return np.where(physical < axis_map[1], physical, -1)


def _checkpoint_shape(shape: tuple[int, ...], maps: tuple[AxisMap, ...]) -> tuple[int, ...]:
    return tuple(_checkpoint_size(m, n) for m, n in zip(maps, shape, strict=True))


# ------------------------------------------------------------------------------- safetensors


def _checkpoint_parts(
    names: tuple[str, ...], shape: tuple[int, ...], maps: tuple[AxisMap, ...]
) -> list[tuple[str, tuple[int, ...], int]]:
    """``(HF name, its checkpoint shape in [in, out] coordinates, its offset on the last axis of
    the concatenated checkpoint)`` of each tensor a parameter is read from (one unless fused)."""
    checkpoint = _checkpoint_shape(shape, maps)
    if maps[-1] is None or maps[-1][0] != "fused":
        return [(names[0], checkpoint, 0)]
    sizes = [_checkpoint_size(part_map, n) for n, part_map in maps[-1][2]]
    offsets = np.cumsum([0, *sizes])
    return [
        (name, (*checkpoint[:-1], size), int(offset))
        for name, size, offset in zip(names, sizes, offsets[:-1], strict=True)
    ]


def _load_state(
    params: list, model_dir: str, dtype: jnp.dtype, hf_config: Any, view: Any = None
) -> list:
    """Every parameter read slice by slice into its shards (``view``: as in
    ``models.weights._load_state``).

    Raises:
        ValueError: a parameter missing from the checkpoint or of the wrong shape (the first in
            flat-state order, named with its HF name).
    """
    with ExitStack() as stack:
        reader = open_reader(model_dir, hf_config, stack, view)
        # Check everything before reading anything big.
        for path, _, shape, _, maps in params:
            _, transposed = hf_names(path)
            for parts in _expert_grid(path, shape, maps):
                for name, expected, _ in parts:
                    check_tensor(reader, path, name, expected[::-1] if transposed else expected,
                                 model_dir)
        filled = []
        for path, variable, shape, sharding, maps in params:
            names, transposed = hf_names(path)
            if is_expert_param(path):
                read = functools.partial(
                    _read_expert_shard, reader, _expert_grid(path, shape, maps), transposed,
                    shape, maps, np.dtype(dtype),
                )
            else:
                read = functools.partial(
                    _read_shard,
                    reader,
                    _checkpoint_parts(names, shape, maps),
                    transposed,
                    shape,
                    maps,
                    np.dtype(dtype),
                )
            value = jax.make_array_from_callback(shape, sharding, read)
            filled.append((path, variable.replace(value)))
    return filled


def _expert_grid(path: tuple, shape: tuple[int, ...], maps: tuple) -> list[list]:
    """:func:`_checkpoint_parts` per expert of a stacked expert parameter (of its ``shape[1:]``
    slice); one entry for any other parameter."""
    if not is_expert_param(path):
        return [_checkpoint_parts(hf_names(path)[0], shape, maps)]
    return [
        _checkpoint_parts(names, shape[1:], maps[1:])
        for names in expert_hf_names(path, shape[0])
    ]


def _read_expert_shard(reader, grid: list, transposed: bool, shape: tuple[int, ...],
                       maps: tuple, dtype: np.dtype, index: tuple[slice, ...]) -> np.ndarray:
    """One device's block of a stacked expert parameter: its experts' blocks, stacked."""
    experts = np.arange(shape[0])[index[0]]
    return np.stack([
        _read_shard(reader, grid[e], transposed, shape[1:], maps[1:], dtype, index[1:])
        for e in experts
    ])


def _read_shard(
    reader,
    parts: list[tuple[str, tuple[int, ...], int]],
    transposed: bool,
    shape: tuple[int, ...],
    maps: tuple,
    dtype: np.dtype,
    index: tuple[slice, ...],
) -> np.ndarray:
    """One device's block ``param[index]`` (physical ``[in, out]`` coordinates) as numpy."""
    sources = []  # per axis: checkpoint index of each element of the block, -1 = zero
    for axis_map, size, sl in zip(maps, shape, index, strict=True):
        physical = np.arange(size)[sl]
        sources.append(physical if axis_map is None else map_indices(axis_map, size)[physical])
    if all(m is None for m in maps):  # one tensor, one contiguous box: read it as it is
        (name, _, _), = parts
        box = tuple(slice(int(src[0]), int(src[-1]) + 1) for src in sources)
        block = reader.read_slice(name, box[::-1] if transposed else box)
        return np.asarray(block.T if transposed else block).astype(dtype, copy=False)
    out = np.zeros(tuple(len(s) for s in sources), dtype)
    for name, checkpoint_shape, offset in parts:
        last = sources[-1] - offset  # this tensor's columns on the concatenated last axis
        inside = (last >= 0) & (last < checkpoint_shape[-1])  # a zero (-1) is never inside
        part_sources = [*sources[:-1], np.where(inside, last, -1)]
        _read_into(out, reader, name, transposed, part_sources)
    return out


def _read_into(out: np.ndarray, reader, name: str, transposed: bool, sources: list) -> None:
    """``out[i, j, ...] = tensor[sources[0][i], sources[1][j], ...]`` (``[in, out]``
    coordinates) where every source index is ``>= 0``; reads the smallest box of ``name`` that
    covers them (contiguous per axis)."""
    kept = [np.nonzero(src >= 0)[0] for src in sources]
    if any(k.size == 0 for k in kept):
        return
    taken = [src[k] for src, k in zip(sources, kept, strict=True)]
    lows = [int(t.min()) for t in taken]
    box = tuple(slice(lo, int(t.max()) + 1) for lo, t in zip(lows, taken, strict=True))
    block = reader.read_slice(name, box[::-1] if transposed else box)
    block = np.asarray(block.T if transposed else block).astype(out.dtype, copy=False)
    out[np.ix_(*kept)] = block[np.ix_(*(t - lo for t, lo in zip(taken, lows, strict=True)))]


# ------------------------------------------------------------------------------------ dummy


def _dummy_state(params: list, dtype: jnp.dtype, seed: int) -> list:
    """``models.weights``' dummy values (norm weights ones, biases zeros, the rest
    ``normal * 0.02``), generated on their shards; one compile per distinct parameter kind."""
    key = jax.random.key(seed)
    initializers: dict[tuple, Any] = {}
    filled = []
    for i, (path, variable, shape, sharding, maps) in enumerate(params):
        leaf = str(path[-1])
        kind = {"weight": "ones", "bias": "zeros"}.get(leaf, "normal")
        cache_key = (kind, shape, maps, sharding)
        if cache_key not in initializers:
            initializers[cache_key] = _make_initializer(
                kind, shape, maps, jnp.dtype(dtype), sharding
            )
        filled.append((path, variable.replace(initializers[cache_key](key, i))))
    return filled


def _make_initializer(
    kind: str, shape: tuple[int, ...], maps: tuple, dtype: jnp.dtype, sharding: NamedSharding
):
    checkpoint_shape = _checkpoint_shape(shape, maps)

    def init(key: jax.Array, index: int) -> jax.Array:
        if kind == "ones":
            value = jnp.ones(checkpoint_shape, dtype)
        elif kind == "zeros":
            value = jnp.zeros(checkpoint_shape, dtype)
        else:  # the draw of models.weights, so the values are bit-identical
            value = dummy_normal(key, index, shape=checkpoint_shape, dtype=jnp.dtype(dtype))
        for axis, axis_map in enumerate(maps):
            if axis_map is None:
                continue
            indices = map_indices(axis_map, shape[axis])
            value = jnp.take(value, np.maximum(indices, 0), axis=axis)
            keep = np.expand_dims(indices >= 0, [a for a in range(len(shape)) if a != axis])
            value = jnp.where(keep, value, jnp.zeros((), dtype))
        return value

    return jax.jit(init, out_shardings=sharding)
