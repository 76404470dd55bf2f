"""The engine's own parameters as an orbax checkpoint: save once, restore onto the devices.

A converted directory holds

- ``params/``: an orbax checkpoint (OCDBT + zarr, uncompressed, in chunks of at most
  ``CHUNK_BYTES``; ``write_arrays``) of the model's *physical* parameters, exactly the arrays
  the step runs on: fused ``qkv_proj`` / ``gate_up_proj`` kernels (``[in, out]``, columns laid out shard by shard as in
  ``models.merged_linear``), KV heads repeated and the MLP padded for tensor parallelism
  (``models.sharding``), in the converted dtype. Keys are the NNX state paths joined by ``.``
  (``model.layers.0.self_attn.qkv_proj.kernel``).
- ``jaxpaged_checkpoint.json`` (``MARKER``): format version, ``tensor_parallel_size``, dtype,
  quantization and every parameter's shape and dtype.
- the HF files needed to serve: ``config.json`` (its ``torch_dtype`` set to the converted dtype,
  so ``dtype="auto"`` restores it unchanged), ``generation_config.json`` and the tokenizer files.

Restoring builds the model's abstract state, gives every leaf the sharding the engine runs it
with (``param_partition_spec`` on the ``("tp",)`` mesh, or the first device), and reads those
arrays (``restore_arrays``): each device's shard comes from disk on its own (no whole-model host
copy, no name mapping, no concatenation or transposition). The fused column order and the padding
depend on the number of shards, so a checkpoint restores only at the ``tensor_parallel_size`` it
was converted for.

Orbax writes the parameters (``write_arrays``), but the restore reads them with TensorStore
directly (``restore_arrays``). Orbax's restore allocates a zeroed host array per shard, has
TensorStore copy into it, then calls ``jax.device_put`` inside its one asyncio thread: one copy
to the device after another, and on a CPU device a second host copy (XLA's CPU client copies an
unaligned buffer). ``restore_arrays`` reads each shard into a 64-byte-aligned host buffer, which
a CPU device adopts without a copy and an accelerator copies once, on a pool of threads, so that
file reads and device copies overlap. Measured on a 2-core CPU (1.6 GiB of bf16, page cache
warm, the restore alone): orbax's restore 860k page faults and 3.0-3.5 CPU s, this reader 400k
and ~2.1 s; with 8 MiB chunks 190k-260k and ~1.8 s (docs/benchmarks.md, "Start-up and checkpoint loading"). Checkpoints
converted earlier (one chunk per shard, some zstd-compressed) and zarr3 arrays restore the same
way: TensorStore reads each array's chunking and codec from its metadata.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from models.orbax_metadata import (  # noqa: F401  (re-exported: the format's names)
    FORMAT,
    FORMAT_VERSION,
    MARKER,
    check_shard_count,
    checkpoint_quantization,
    is_orbax_checkpoint,
    read_metadata,
)
from models.quantization.config import QuantizationConfig
from models.quantized_weights import quantized_layers
from models.registry import get_model_class
from models.sharding import (
    TP_AXIS,
    param_partition_spec,
    quantized_partition_spec,
    tp_model_config,
)
from models.tp_layout import TPLayout
from models.weights import abstract_model, load_config, resolve_dtype

if TYPE_CHECKING:  # transformers imports PyTorch when installed: only when a config is read
    import transformers

PARAMS_DIR = "params"
# Largest chunk of a stored array (bytes): TensorStore reads the chunks of one array in parallel,
# and its read buffers this small are reused by malloc instead of faulted in afresh
# (``write_arrays``).
CHUNK_BYTES = 8 * 2**20
# Start of every host shard buffer (bytes): XLA's CPU client aliases, not copies, a buffer
# aligned to 64 bytes (``restore_arrays``).
_HOST_ALIGNMENT = 64
# HF files copied next to the parameters when present (config.json is rewritten, not copied).
SERVING_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


def param_key(path: tuple) -> str:
    """The checkpoint key of an NNX state path: its parts joined by ``.``."""
    return ".".join(str(p) for p in path)


def save_checkpoint(
    model: nnx.Module,
    hf_dir: str,
    out_dir: str,
    *,
    tensor_parallel_size: int,
    quantization: str | None = None,
    quantization_load_format: str | None = None,
) -> dict:
    """Write ``model``'s parameters with orbax plus the serving files of ``hf_dir``.

    Args:
        model: the loaded model (``models.weights.load_model`` or ``load_sharded_model``); its
            arrays are written as they are, shards by the devices that hold them.
        hf_dir: the source HF directory (config and tokenizer files are taken from it).
        out_dir: the new directory; it must not exist yet or be empty.
        tensor_parallel_size: the shard count ``model`` was built for (recorded).
        quantization: the method ``model`` was loaded with (None: unquantized); recorded with
            ``quantization_load_format`` (the ``load_format`` it was loaded with), from which
            ``models.orbax_metadata.checkpoint_quantization`` gives the config back. The
            quantized layers' tensors (``models.quantized_linear``) are written as they are
            (int8, float8, packed int32 and their scales).

    Returns:
        The metadata written to ``MARKER``.

    Raises:
        ValueError: ``out_dir`` exists and is not empty.
    """
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"output path {out_dir} exists and is not a directory")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise ValueError(f"output directory {out_dir} exists and is not empty")
    os.makedirs(out_dir, exist_ok=True)
    flat = nnx.to_flat_state(nnx.state(model))
    arrays = {param_key(path): variable.get_value() for path, variable in flat}
    layers = {".".join(path): list(m.tensor_names) for path, m in quantized_layers(model)}
    quantized = {f"{layer}.{name}" for layer, names in layers.items() for name in names}
    # The float parameters' dtype (the quantized tensors keep their own).
    dtypes = {str(a.dtype) for k, a in arrays.items() if k not in quantized}
    write_arrays(os.path.join(out_dir, PARAMS_DIR), arrays)

    with open(os.path.join(hf_dir, "config.json")) as f:
        config_json = json.load(f)
    (dtype,) = dtypes if len(dtypes) == 1 else (None,)
    if dtype is not None:
        config_json["torch_dtype"] = dtype
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config_json, f, indent=2)
    for name in SERVING_FILES:
        source = os.path.join(hf_dir, name)
        if os.path.isfile(source):
            shutil.copy2(source, os.path.join(out_dir, name))
    meta = dict(
        format=FORMAT,
        version=FORMAT_VERSION,
        tensor_parallel_size=tensor_parallel_size,
        dtype=dtype,
        quantization=quantization,
        quantization_load_format=quantization_load_format,
        quantized_layers=layers,
        architectures=config_json.get("architectures"),
        params={k: [list(a.shape), str(a.dtype)] for k, a in arrays.items()},
    )
    with open(os.path.join(out_dir, MARKER), "w") as f:
        json.dump(meta, f, indent=1)
    return meta



def write_arrays(
    path: str, arrays: dict[str, jax.Array], *, chunk_bytes: int = CHUNK_BYTES
) -> None:
    """Write ``arrays`` (``{key: jax.Array}``, each sharded as it is) as an orbax checkpoint at
    ``path``: OCDBT, one zarr v2 array per key, uncompressed, each device shard split into chunks
    of at most ``chunk_bytes`` (orbax's ``SaveArgs.chunk_byte_size``).

    Uncompressed: orbax compresses with zstd by default, and decompressing 15 GB of bf16 kept the
    H200's restore CPU-bound at 0.69 GiB/s with the files in the page cache (a serving checkpoint
    is read far more often than written; docs/benchmarks.md, "Start-up and checkpoint loading"). Chunked: on a 2-core CPU
    8 MiB chunks cut ``restore_arrays``' page faults from 400k to 190k-260k and its CPU time
    from ~2.1 to ~1.8 s against one chunk per shard (32 MiB: no fewer faults; 2 MiB: more CPU
    per chunk). Orbax picks the chunk shape, dividing each shard.
    """
    import orbax.checkpoint as ocp  # 0.6 s to import: only when a checkpoint is written

    save_args = {key: ocp.SaveArgs(chunk_byte_size=chunk_bytes) for key in arrays}
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))
    checkpointer.save(path, args=ocp.args.PyTreeSave(arrays, save_args=save_args))
    checkpointer.close()

def load_orbax_model(
    model_dir: str,
    *,
    mesh: Mesh | None = None,
    dtype: str | Any = "auto",
    load_format: str = "auto",
    attention_backend: str = "reference",
    interpret: bool = False,
    seed: int = 0,
    quant_config: QuantizationConfig | None = None,
    hf_config: Any = None,
) -> tuple[nnx.Module, transformers.PretrainedConfig]:
    """``models.weights.load_model`` / ``load_sharded_model`` for a converted directory.

    Args:
        model_dir: a directory written by ``save_checkpoint``.
        mesh: the ``("tp",)`` mesh (None: one device); its size must equal the checkpoint's
            ``tensor_parallel_size``.
        dtype, attention_backend, interpret, seed: as ``load_model``; a dtype other than the
            checkpoint's is cast by TensorStore while reading.
        load_format: "auto" (the only format of a converted directory).
        hf_config: the directory's config when already read (``load_config``); None: read here.
        quant_config: the quantization the directory was converted with (the engine resolves it
            in ``jaxpaged.config``); None: read it from the directory
            (``models.orbax_metadata.checkpoint_quantization``). Quantized tensors restore in
            their stored dtypes, split as ``models.sharding.quantized_partition_spec`` says.

    Returns:
        ``(model, hf_config)`` with every parameter on the devices, sharded as the engine runs it.

    Raises:
        ValueError: not a converted directory, a different shard count, or a parameter the
            checkpoint lacks, holds with another shape, or holds beyond the model's (named);
            a ``quant_config`` of another method than the recorded one; parameters not in the
            OCDBT layout (``restore_arrays``).
    """
    if load_format != "auto":
        raise ValueError(
            f"load_format must be auto for the orbax checkpoint {model_dir}, got {load_format!r}"
        )
    meta = read_metadata(model_dir)
    tp = 1 if mesh is None else mesh.shape[TP_AXIS]
    check_shard_count(model_dir, meta, tp)
    if hf_config is None:
        hf_config = load_config(model_dir)
    with open(os.path.join(model_dir, "config.json")) as f:
        config_json = json.load(f)
    recorded = checkpoint_quantization(model_dir, meta, config_json)
    if quant_config is None:
        quant_config = recorded
    elif recorded is None or quant_config.method != recorded.method:
        raise ValueError(
            f"quantization={quant_config.method!r} does not match the orbax checkpoint "
            f"{model_dir}, converted with quantization={meta.get('quantization')!r}"
        )
    model_class = get_model_class(hf_config)
    resolved = resolve_dtype(dtype, hf_config)
    physical_config = hf_config
    if mesh is not None:
        layout = TPLayout.from_hf_config(hf_config, tp)
        physical_config = tp_model_config(hf_config, layout)
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
    quantized = _quantized_targets(abstract, meta, model_dir, mesh)
    graphdef, abstract_state = nnx.split(abstract)
    flat_state = nnx.to_flat_state(abstract_state)
    target = {}
    for path, variable in flat_state:
        key, shape = param_key(path), tuple(variable.get_value().shape)
        stored = meta["params"].get(key)
        if stored is None or tuple(stored[0]) != shape:
            found = "missing" if stored is None else f"of shape {tuple(stored[0])}"
            raise ValueError(
                f"parameter {key} of shape {shape} is {found} in the checkpoint {model_dir}"
            )
        sharding = (
            SingleDeviceSharding(jax.local_devices()[0])
            if mesh is None
            else NamedSharding(mesh, param_partition_spec(path, layout))
        )
        target[key] = jax.ShapeDtypeStruct(shape, jnp.dtype(resolved), sharding=sharding)
    for tensors in quantized.values():
        target.update(dict(tensors.values()))
    extra = sorted(set(meta["params"]) - set(target))
    if extra:
        raise ValueError(
            f"the checkpoint {model_dir} holds parameter {extra[0]}, which the model built from "
            "its config.json does not have"
        )
    restored = restore_arrays(os.path.join(os.path.abspath(model_dir), PARAMS_DIR), target)
    filled = [(path, variable.replace(restored[param_key(path)])) for path, variable in flat_state]
    model = nnx.merge(graphdef, nnx.from_flat_state(filled))
    for path, module in quantized_layers(model):  # in the order the loader attached them
        module.set_tensors({name: restored[key] for name, (key, _) in quantized[path].items()})
    return model, hf_config


def _quantized_targets(
    abstract: nnx.Module, meta: dict, model_dir: str, mesh: Mesh | None
) -> dict[tuple[str, ...], dict[str, jax.ShapeDtypeStruct]]:
    """``{layer path: {tensor name: (checkpoint key, target)}}`` for every quantized layer of
    ``abstract``, in the recorded order; a target has the stored shape and dtype on the
    tensor's sharding (``quantized_partition_spec``).

    Raises:
        ValueError: a quantized layer the checkpoint has no tensors for (named).
    """
    recorded = meta.get("quantized_layers") or {}
    out = {}
    for path, module in quantized_layers(abstract):
        layer = ".".join(path)
        names = recorded.get(layer)
        if not names:
            raise ValueError(
                f"quantized layer {layer} has no tensors in the checkpoint {model_dir} "
                f"(converted with quantization={meta.get('quantization')!r})"
            )
        tensors = {}
        for name in names:
            key = f"{layer}.{name}"
            shape, dtype = meta["params"][key]
            sharding = (
                SingleDeviceSharding(jax.local_devices()[0])
                if mesh is None
                else NamedSharding(
                    mesh, quantized_partition_spec(path[-1], module.method, name, tuple(shape))
                )
            )
            target = jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding)
            tensors[name] = (key, target)
        out[path] = tensors
    return out


def restore_arrays(
    params_dir: str, targets: dict[str, jax.ShapeDtypeStruct], *, workers: int | None = None
) -> dict[str, jax.Array]:
    """The arrays of an orbax OCDBT checkpoint directory, read with TensorStore onto the devices.

    Every array is stored as a zarr array (v2 ``.zarray`` or v3 ``zarr.json``, compressed or not:
    TensorStore reads its metadata) under its key in the OCDBT database at ``params_dir``, the
    layout orbax's ``PyTreeCheckpointHandler`` writes. Each addressable device's shard
    (``sharding.addressable_devices_indices_map``; a replicated shard is read once) is read as a
    slice of the stored array, cast by TensorStore to the target dtype when it differs, and put
    on its device. ``workers`` threads each read one shard and put it (largest shards first), so
    file reads and host-to-device copies overlap and at most ``workers`` shards wait on the host.

    Args:
        params_dir: the checkpoint directory (holding ``manifest.ocdbt``).
        targets: ``{key: ShapeDtypeStruct with a sharding}``; the stored shape must equal it.
        workers: threads (None: ``min(16, os.cpu_count())``, at least 2).

    Returns:
        ``{key: jax.Array}`` of the targets' shapes, dtypes and shardings.

    Raises:
        ValueError: no ``manifest.ocdbt`` in ``params_dir`` (not written by ``save_checkpoint``);
            a key with no zarr array in it or stored with another shape (named).
    """
    import concurrent.futures

    import tensorstore as ts  # no orbax import: its restore adds copies (module docstring)

    if not os.path.isfile(os.path.join(params_dir, "manifest.ocdbt")):
        raise ValueError(
            f"{params_dir} is not an OCDBT orbax checkpoint (no manifest.ocdbt); convert the "
            "model again with `jaxpaged convert`"
        )
    context = ts.Context()
    kvstore = {"driver": "ocdbt", "base": f"file://{params_dir}/"}
    stored_keys = set(ts.KvStore.open(kvstore, context=context).result().list().result())
    opening = {}
    for key in targets:
        driver = "zarr3" if f"{key}/zarr.json".encode() in stored_keys else "zarr"
        if driver == "zarr" and f"{key}/.zarray".encode() not in stored_keys:
            raise ValueError(f"parameter {key} has no array in the orbax checkpoint {params_dir}")
        spec = {"driver": driver, "kvstore": {**kvstore, "path": f"{key}/"}}
        opening[key] = ts.open(spec, context=context, open=True, read=True)
    stores, jobs = {}, []
    for key, target in targets.items():
        store = opening[key].result()
        if tuple(store.shape) != tuple(target.shape):
            raise ValueError(
                f"parameter {key} is stored with shape {tuple(store.shape)} in {params_dir}, "
                f"expected {tuple(target.shape)}"
            )
        if store.dtype.numpy_dtype != target.dtype:
            store = ts.cast(store, ts.dtype(jnp.dtype(target.dtype).name))
        stores[key] = store
        devices_by_index: dict[tuple, list] = {}
        for device, index in target.sharding.addressable_devices_indices_map(target.shape).items():
            bounds = tuple(s.indices(n)[:2] for s, n in zip(index, target.shape, strict=True))
            devices_by_index.setdefault(bounds, []).append(device)
        for bounds, devices in devices_by_index.items():
            size = math.prod(hi - lo for lo, hi in bounds) * jnp.dtype(target.dtype).itemsize
            jobs.append((size, key, bounds, devices))
    jobs.sort(key=lambda job: -job[0])

    def read_and_put(job) -> list[jax.Array]:
        _, key, bounds, devices = job
        host = _aligned_empty(tuple(hi - lo for lo, hi in bounds), targets[key].dtype)
        ts.array(host).write(stores[key][tuple(slice(lo, hi) for lo, hi in bounds)]).result()
        return jax.block_until_ready([jax.device_put(host, device) for device in devices])

    workers = workers or max(2, min(16, os.cpu_count() or 1))
    shards: dict[str, dict] = {key: {} for key in targets}
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for job, arrays in zip(jobs, pool.map(read_and_put, jobs), strict=True):
            for device, array in zip(job[3], arrays, strict=True):
                shards[job[1]][device] = array
    restored = {}
    for key, target in targets.items():
        sharding = target.sharding
        arrays = [shards[key][d] for d in sharding.addressable_devices_indices_map(target.shape)]
        restored[key] = jax.make_array_from_single_device_arrays(target.shape, sharding, arrays)
    return restored


def _aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised C-order host array whose data starts on a ``_HOST_ALIGNMENT`` boundary.

    TensorStore fills it from the file; a CPU device then takes it without a copy (XLA's CPU
    client aliases an aligned host buffer), and an accelerator copies it to device memory.
    """
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + _HOST_ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % _HOST_ALIGNMENT
    return raw[start : start + nbytes].view(dtype).reshape(shape)
