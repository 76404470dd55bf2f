"""The engine's own parameters as an orbax checkpoint: save once, restore onto the devices.

A converted directory holds

- ``params/``: an orbax-checkpoint (OCDBT + TensorStore, written uncompressed) of the model's
  *physical* parameters, exactly the arrays the step runs on: fused ``qkv_proj`` /
  ``gate_up_proj`` kernels (``[in, out]``, columns laid out shard by shard as in
  ``models.merged_linear``), KV heads repeated and the MLP padded for tensor parallelism
  (``models.sharding``), in the converted dtype. Keys are the NNX state paths joined by ``.``
  (``model.layers.0.self_attn.qkv_proj.kernel``).
- ``jaxpaged_checkpoint.json`` (``MARKER``): format version, ``tensor_parallel_size``, dtype,
  quantization and every parameter's shape and dtype.
- the HF files needed to serve: ``config.json`` (its ``torch_dtype`` set to the converted dtype,
  so ``dtype="auto"`` restores it unchanged), ``generation_config.json`` and the tokenizer files.

Restoring builds the model's abstract state, gives every leaf the sharding the engine runs it
with (``param_partition_spec`` on the ``("tp",)`` mesh, or the first device), and asks orbax for
those arrays: each device reads its own shard from disk (no whole-model host copy, no name
mapping, no concatenation or transposition). The fused column order and the padding depend on
the number of shards, so a checkpoint restores only at the ``tensor_parallel_size`` it was
converted for.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
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
    import orbax.checkpoint as ocp  # 0.6 s to import: only when a checkpoint is written

    # Uncompressed: orbax compresses with zstd by default, and decompressing 15 GB of bf16 kept
    # the H200's restore CPU-bound at 0.69 GiB/s with the files in the page cache (a serving
    # checkpoint is read far more often than written; docs/benchmarks.md, issue 18).
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))
    checkpointer.save(os.path.join(out_dir, PARAMS_DIR), arrays)
    checkpointer.close()

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
            checkpoint's is cast by orbax while reading.
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
            a ``quant_config`` of another method than the recorded one.
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
    import orbax.checkpoint as ocp  # 0.6 s to import: only when a checkpoint is read

    checkpointer = ocp.StandardCheckpointer()
    restored = checkpointer.restore(os.path.join(os.path.abspath(model_dir), PARAMS_DIR), target)
    checkpointer.close()
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
