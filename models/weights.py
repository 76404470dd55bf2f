"""Build a model from a Hugging Face checkpoint directory: config, safetensors weights or dummies.

The model is first built abstractly (``nnx.eval_shape``: shapes and dtypes only, no random init),
then its state is filled either from safetensors files (one ``model.safetensors`` or a sharded
``model.safetensors.index.json``) by HF name, or with deterministic random values
(``load_format="dummy"``, for benchmarks: no weight file is read, a config-only directory works).
A fused parameter (``qkv_proj``, ``gate_up_proj``; ``models.merged_linear``) is filled from the
tensors of its parts (``models.hf_names``: :data:`FUSED_MODULES`, :func:`hf_names`). A checkpoint that stores such a
module fused (Phi-3) is read through row-block views that stand in for the parts' tensors
(:func:`fused_checkpoint_views`). Stacked expert parameters (``models.moe``, ``[E, ...]``) are
filled from one checkpoint tensor (or fused pair) per expert (:func:`expert_hf_names`).
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import json
import os
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import safetensors
from flax import nnx

from models.config_cache import read_cached_config, write_cached_config
from models.config_checks import check_config_shapes, check_layer_count
from models.dtypes import DTYPES as _DTYPES
from models.dummy_init import dummy_normal
from models.hf_names import EXPERT_PARAMS as EXPERT_PARAMS  # re-exported: the name map
from models.hf_names import FUSED_MODULES as FUSED_MODULES
from models.hf_names import check_tensor as check_tensor
from models.hf_names import expert_hf_names as expert_hf_names
from models.hf_names import hf_names as hf_names
from models.hf_names import is_expert_param as is_expert_param
from models.hf_names import merged_output_sizes as merged_output_sizes
from models.quantization.config import QuantizationConfig, resolve_quantization
from models.quantized_weights import (
    dummy_quantized_layers,
    place_quantized_layers,
    quantized_layers,
    read_quantized_layers,
)
from models.registry import checkpoint_view, get_model_class

if TYPE_CHECKING:  # transformers imports PyTorch when installed: only when a config is read
    import transformers

# bitsandbytes: the safetensors read with quantization="bitsandbytes" (8-bit at load).
_LOAD_FORMATS = ("auto", "safetensors", "dummy", "bitsandbytes")
_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"


def resolve_dtype(dtype: str | Any, hf_config: Any) -> jnp.dtype:
    """The parameter/compute dtype for ``dtype``.

    ``"auto"`` takes the checkpoint's dtype from the config (``dtype``, else the older
    ``torch_dtype``; float32 when neither is set). Also accepted: "float32"/"float",
    "bfloat16", "float16"/"half", or a jnp dtype among those.

    Raises:
        ValueError: any other value (also an unsupported dtype in the config under "auto").
    """
    if isinstance(dtype, str) and dtype == "auto":
        config_dtype = getattr(hf_config, "dtype", None)
        if config_dtype is None and "torch_dtype" in getattr(hf_config, "__dict__", {}):
            config_dtype = hf_config.__dict__["torch_dtype"]
        if config_dtype is None:
            return jnp.dtype(jnp.float32)
        name = str(config_dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise ValueError(
                f"dtype 'auto': the config's dtype {name!r} is not supported; "
                f"supported: {sorted(_DTYPES)}"
            )
        return jnp.dtype(_DTYPES[name])
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
        return jnp.dtype(_DTYPES[dtype])
    try:
        resolved = jnp.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}") from e
    if resolved not in {jnp.dtype(d) for d in _DTYPES.values()}:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return resolved


def safe_open(file: str, framework: str):
    """``safetensors.safe_open``, with a file it cannot read (truncated: its header names
    bytes past the end; a corrupt header) refused by name.

    Raises:
        ValueError: naming the file and safetensors' reason.
    """
    try:
        return safetensors.safe_open(file, framework=framework)
    except (safetensors.SafetensorError, OSError) as error:
        raise ValueError(
            f"weight file {file} is not a readable safetensors file (truncated or corrupt?): "
            f"{error}"
        ) from None


def _weight_files(model_dir: str) -> dict[str, str]:
    """HF tensor name -> safetensors file path, from the index or the single file."""
    index_path = os.path.join(model_dir, _INDEX_FILE)
    single_path = os.path.join(model_dir, _SINGLE_FILE)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            try:
                weight_map = json.load(f).get("weight_map")
            except (ValueError, AttributeError) as error:
                raise ValueError(f"{index_path} is not a JSON object: {error}") from None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_path} has no 'weight_map' object")
        return {name: os.path.join(model_dir, file) for name, file in weight_map.items()}
    if os.path.isfile(single_path):
        with safe_open(single_path, "numpy") as f:
            return {name: single_path for name in f.keys()}
    raise ValueError(
        f"no weights in {model_dir}: expected {_SINGLE_FILE} or {_INDEX_FILE} "
        "(or use load_format='dummy')"
    )


def check_checkpoint_layers(model_dir: str, hf_config: Any) -> None:
    """``models.config_checks.check_layer_count`` over the checkpoint's tensor names (its
    index, or its single file's header: nothing big is read).

    Raises:
        ValueError: no weight files, or more layers in the config than in the checkpoint.
    """
    check_layer_count(_weight_files(model_dir), hf_config, model_dir)


def _fused_part_sizes(fused: str, hf_config: Any) -> tuple[int, ...]:
    """Output sizes of the parts of a fused checkpoint module, from the checkpoint's config."""
    if fused == "qkv_proj":
        num_heads = hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        return (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)
    return (hf_config.intermediate_size, hf_config.intermediate_size)


def fused_checkpoint_views(names: Any, hf_config: Any) -> dict[str, tuple[str, int, int]]:
    """Views that let a checkpoint storing fused modules (Phi-3's ``qkv_proj``, ``gate_up_proj``)
    be read as the parts' tensors the loaders ask for.

    For each tensor ``<prefix>.<fused>.<leaf>`` in ``names`` (``<fused>`` a key of
    :data:`FUSED_MODULES`), its row blocks (HF ``[out, ...]``: q rows, then k, then v; gate, then
    up, as HF ``Phi3Attention``/``Phi3MLP`` split them) become ``<prefix>.<part>.<leaf>`` ->
    ``(fused name, first row, end row)``. Part sizes come from the checkpoint's config
    (``Hq * D, Hkv * D, Hkv * D``; ``intermediate_size`` twice). Names the checkpoint holds
    itself are never shadowed.
    """
    views: dict[str, tuple[str, int, int]] = {}
    for name in names:
        for fused, parts in FUSED_MODULES.items():
            marker = f".{fused}."
            if marker not in name:
                continue
            prefix, leaf = name.split(marker, 1)
            bounds = [0, *itertools.accumulate(_fused_part_sizes(fused, hf_config))]
            for part, lo, hi in zip(parts, bounds[:-1], bounds[1:], strict=True):
                view = f"{prefix}.{part}.{leaf}"
                if view not in names:
                    views[view] = (name, lo, hi)
    return views


class _TensorReader:
    """Reads tensors by name from a set of safetensors files, opening each file once.

    numpy handles serve every dtype numpy knows; bfloat16 (which ``safetensors.numpy`` can't
    represent) is read through a flax handle instead. ``views`` (:func:`fused_checkpoint_views`)
    add names that read a block of rows of another tensor.
    """

    def __init__(
        self,
        files: dict[str, str],
        stack: ExitStack,
        views: dict[str, tuple[str, int, int]] | None = None,
    ):
        self._files = files
        self._stack = stack
        self._views = views or {}
        self._handles: dict[tuple[str, str], Any] = {}

    def _handle(self, file: str, framework: str):
        key = (file, framework)
        if key not in self._handles:
            if not os.path.isfile(file):
                raise ValueError(f"weight file {file} named by the index does not exist")
            self._handles[key] = self._stack.enter_context(safe_open(file, framework))
        return self._handles[key]

    def __contains__(self, name: str) -> bool:
        return name in self._files or name in self._views

    def is_view(self, name: str) -> bool:
        """Whether ``name`` reads rows of a fused checkpoint tensor (:func:`fused_checkpoint_views`)."""
        return name in self._views

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._views:
            source, lo, hi = self._views[name]
            return (hi - lo, *self.shape(source)[1:])
        return tuple(self._handle(self._files[name], "numpy").get_slice(name).get_shape())

    def dtype(self, name: str) -> Any:
        """The stored dtype of ``name`` (a jnp dtype), from its file's header; None for a
        dtype this reader does not know."""
        if name in self._views:
            return self.dtype(self._views[name][0])
        stored = self._handle(self._files[name], "numpy").get_slice(name).get_dtype()
        return _SAFETENSORS_DTYPES.get(stored)

    def read_slice(self, name: str, index: tuple[slice, ...]):
        """``tensor[index]`` without reading the rest of the tensor (bfloat16 via ml_dtypes)."""
        if name in self._views:
            source, lo, hi = self._views[name]
            start, stop, step = index[0].indices(hi - lo)
            return self.read_slice(source, (slice(lo + start, lo + stop, step), *index[1:]))
        return self._handle(self._files[name], "numpy").get_slice(name)[index]

    def read(self, name: str):
        if name in self._views:
            return self.read_slice(name, tuple(slice(None) for _ in self.shape(name)))
        handle = self._handle(self._files[name], "numpy")
        stored = handle.get_slice(name).get_dtype()
        if stored == "BF16":
            return self._handle(self._files[name], "flax").get_tensor(name)
        if stored in _RAW_DTYPES:  # safetensors' numpy reader has no float8
            return _read_raw(self._files[name], name, _RAW_DTYPES[stored])
        return handle.get_tensor(name)


# safetensors dtypes numpy reads only through ml_dtypes (quantized FP8 checkpoints).
_RAW_DTYPES = {"F8_E4M3": jnp.float8_e4m3fn, "F8_E5M2": jnp.float8_e5m2}
# safetensors' dtype names (its header's "dtype") -> jnp dtypes.
_SAFETENSORS_DTYPES = {
    **{name: jnp.dtype(dtype) for name, dtype in _RAW_DTYPES.items()},
    "F64": jnp.dtype(jnp.float64), "F32": jnp.dtype(jnp.float32),
    "F16": jnp.dtype(jnp.float16), "BF16": jnp.dtype(jnp.bfloat16),
    "I64": jnp.dtype(jnp.int64), "I32": jnp.dtype(jnp.int32), "I16": jnp.dtype(jnp.int16),
    "I8": jnp.dtype(jnp.int8), "U64": jnp.dtype(jnp.uint64), "U32": jnp.dtype(jnp.uint32),
    "U16": jnp.dtype(jnp.uint16), "U8": jnp.dtype(jnp.uint8), "BOOL": jnp.dtype(jnp.bool_),
}  # fmt: skip


def _read_raw(file: str, name: str, dtype: Any) -> Any:
    """Tensor ``name`` of a safetensors ``file`` as a numpy array of ``dtype``, read from the
    format's own layout (an 8-byte little-endian header size, a JSON header giving each
    tensor's ``shape`` and ``data_offsets`` into the data that follows)."""
    with open(file, "rb") as f:
        header_size = int.from_bytes(f.read(8), "little")
        entry = json.loads(f.read(header_size))[name]
        start, end = entry["data_offsets"]
        f.seek(8 + header_size + start)
        data = f.read(end - start)
    return np.frombuffer(data, dtype=dtype).reshape(entry["shape"])


def _hf_parts(
    path: tuple, shape: tuple[int, ...], merged: dict[tuple[str, ...], tuple[int, ...]]
) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The HF tensors that fill the parameter ``path`` of ``shape``, each with the shape of its
    block in the parameter's coordinates (``[in, out]``, before any transpose); one list per
    expert of a stacked expert parameter (blocks of ``shape[1:]``), else one list.

    One tensor covers the whole parameter, except in a fused module: its parts (``merged``,
    from :func:`merged_output_sizes`) split the last axis, ``output_sizes[p]`` columns each
    (an expert's gate/up: two equal halves).
    """
    if is_expert_param(path):
        names = expert_hf_names(path, shape[0])
        *rest, out = shape[1:]
        return [[(name, (*rest, out // len(parts))) for name in parts] for parts in names]
    names, _ = hf_names(path)
    sizes = merged.get(tuple(str(p) for p in path[:-1]))
    if sizes is None:
        return [[(names[0], shape)]]
    return [[(name, (*shape[:-1], size)) for name, size in zip(names, sizes, strict=True)]]


@dataclasses.dataclass(frozen=True)
class ParamPlan:
    """How one parameter is filled: its flat-state ``path``, its ``shape`` (our layout), the HF
    tensors of each block (:func:`_hf_parts`: one list, or one per expert) and whether they are
    stored transposed (``[out, in]``)."""

    path: tuple
    shape: tuple[int, ...]
    grid: list
    transposed: bool

    @property
    def names(self) -> list[str]:
        """Every HF tensor the parameter reads, in order."""
        return [name for parts in self.grid for name, _ in parts]


def plan_params(flat_state: Any, merged: dict, reader: Any, source: str) -> list[ParamPlan]:
    """The fill plan of every parameter of ``flat_state`` (abstract or concrete), checked
    against ``reader`` before anything is read: each HF tensor must be there with its shape.
    ``source`` names the checkpoint in messages (a directory, or ``update_weights``' params).

    Raises:
        ValueError: a parameter missing or of a different shape (``check_tensor``); the first
            such parameter path in flat-state (sorted) order is named, with its HF name.
    """
    plans = []
    for path, variable in flat_state:
        _, transposed = hf_names(path)
        shape = tuple(variable.get_value().shape)
        plans.append(ParamPlan(path, shape, _hf_parts(path, shape, merged), transposed))
    for plan in plans:
        for name, expected in itertools.chain.from_iterable(plan.grid):
            check_tensor(
                reader, plan.path, name, expected[::-1] if plan.transposed else expected, source
            )
    return plans


def read_param(reader: Any, plan: ParamPlan, dtype: jnp.dtype, assemble: Any = None) -> jax.Array:
    """The value of ``plan``'s parameter in ``dtype``, from its HF tensors
    (:func:`assemble_param`; ``assemble``: a jitted twin of it, so that the transposes and
    concatenation of a fused parameter make no intermediate copies). Tensors already on a
    device stay there."""
    tensors = [[reader.read(name) for name, _ in parts] for parts in plan.grid]
    assemble = assemble_param if assemble is None else assemble
    return assemble(
        tensors,
        transposed=plan.transposed,
        expert=is_expert_param(plan.path),
        dtype=jnp.dtype(dtype),
    )


def assemble_param(tensors: list, *, transposed: bool, expert: bool, dtype: Any) -> jax.Array:
    """One parameter from its HF tensors (``tensors``: per block, its parts): each transposed
    back to ``[in, out]`` where stored ``[out, in]`` and cast to ``dtype``; a fused parameter's
    parts concatenated along the last axis (one device: one shard, so the per-shard column
    order of ``models.merged_linear`` is the plain concatenation); a stacked expert parameter's
    experts stacked on a new first axis."""
    blocks = []
    for parts in tensors:
        parts = [jnp.asarray(t.T if transposed else t, dtype=dtype) for t in parts]
        blocks.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts, -1))
    return jnp.stack(blocks) if expert else blocks[0]


def _load_state(
    flat_state: Any,
    merged: dict,
    model_dir: str,
    dtype: jnp.dtype,
    hf_config: Any,
    view: Any = None,
) -> list:
    """Fills every parameter of the abstract ``flat_state`` from the checkpoint
    (:func:`plan_params`, then :func:`read_param` per parameter). ``view``
    (``models.registry.checkpoint_view``) wraps the reader for families whose tensors differ
    from the standard layout.

    Raises:
        ValueError: a parameter missing from the checkpoint or with a different shape; the message
            names the first such parameter path (in sorted order) and its HF name.
    """
    with ExitStack() as stack:
        reader = open_reader(model_dir, hf_config, stack, view)
        # Check everything before reading anything big.
        plans = plan_params(flat_state, merged, reader, model_dir)
        variables = [variable for _, variable in flat_state]
        return [
            (plan.path, variable.replace(read_param(reader, plan, dtype)))
            for plan, variable in zip(plans, variables, strict=True)
        ]


def _dummy_state(flat_state: Any, dtype: jnp.dtype, seed: int) -> list:
    """Deterministic random parameters: ``normal * 0.02``; norm weights are ones, biases zeros.

    Parameter ``i`` (in flat-state order) draws from ``fold_in(key(seed), i)``.
    """
    key = jax.random.key(seed)
    filled = []
    for i, (path, variable) in enumerate(flat_state):
        shape = tuple(variable.get_value().shape)
        leaf = str(path[-1])
        if leaf == "weight":  # RMSNorm
            value = jnp.ones(shape, dtype=dtype)
        elif leaf == "bias":
            value = jnp.zeros(shape, dtype=dtype)
        else:
            value = dummy_normal(key, i, shape=shape, dtype=jnp.dtype(dtype))
        filled.append((path, variable.replace(value)))
    return filled


def load_config(model_dir: str, cache_dir: str | None = None) -> Any:
    """The HF config of a local model directory (no network): ``AutoConfig``'s, or with
    ``cache_dir`` the one stored there by an earlier call for the same ``config.json``
    (``models.config_cache.CachedConfig``, read without importing transformers); a config read
    with transformers is then stored for the next start.

    Raises:
        ValueError: the directory or its ``config.json`` does not exist, or the config cannot be
            read or holds impossible shapes (``check_config_shapes``); the message names the
            file and the field.
    """
    if not os.path.isdir(model_dir):
        raise ValueError(f"model directory {model_dir} does not exist")
    config_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"model directory {model_dir} has no config.json ({config_path})")
    if cache_dir is not None:
        cached = read_cached_config(model_dir, cache_dir)
        if cached is not None:
            check_config_shapes(cached, config_path)
            return cached
    import transformers  # seconds (it imports PyTorch when installed): only when needed

    try:
        config = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except Exception as error:  # transformers' own checks: one line naming the file
        raise ValueError(f"{config_path}: {' '.join(str(error).split())}") from None
    check_config_shapes(config, config_path)
    if cache_dir is not None:
        write_cached_config(model_dir, cache_dir, config)
    return config


def abstract_model(
    model_class: type,
    hf_config: Any,
    dtype: Any,
    *,
    attention_backend: str,
    interpret: bool,
    seed: int,
    mesh: Any = None,
    quant_config: QuantizationConfig | None = None,
):
    """``model_class`` built with shapes and dtypes only (``nnx.eval_shape``): a big model's
    random initialisation is never materialised. ``dtype`` is both the compute and the parameter
    dtype; with ``mesh`` (tensor parallelism) ``hf_config`` is the physical config
    (``models.sharding.tp_model_config``); ``quant_config``: its quantized layers
    (``models.quantized_linear``) are built without tensors, which the loaders attach.

    Raises:
        ValueError: ``quant_config`` for a family without quantized layers (GPT-2, BLOOM).
    """
    kwargs = {} if mesh is None else {"mesh": mesh}
    if quant_config is not None:
        if "quant_config" not in inspect.signature(model_class.__init__).parameters:
            raise ValueError(
                f"quantization {quant_config.method!r} is not supported for the "
                f"{model_class.__name__} family; quantized checkpoints load into the Llama "
                "family (Llama, Mistral, Qwen2, Qwen3, Gemma-2, Phi-3)"
            )
        kwargs["quant_config"] = quant_config
    return nnx.eval_shape(
        lambda: model_class(
            hf_config,
            dtype=dtype,
            param_dtype=dtype,
            attention_backend=attention_backend,
            interpret=interpret,
            rngs=nnx.Rngs(seed),
            **kwargs,
        )
    )


def model_quantization(
    hf_config: Any, quant_config: QuantizationConfig | None, load_format: str
) -> QuantizationConfig | None:
    """``quant_config`` when given (the engine resolves ``quantization=`` once, in
    ``jaxpaged.config``), else what the checkpoint's ``quantization_config`` says
    (``resolve_quantization``'s auto-detection; None for an unquantized checkpoint)."""
    if quant_config is not None:
        return quant_config
    stored = getattr(hf_config, "quantization_config", None)
    if stored is not None and not isinstance(stored, dict):
        stored = stored.to_dict()
    return resolve_quantization(None, stored, load_format)


def open_reader(model_dir: str, hf_config: Any, stack: ExitStack, view: Any = None) -> Any:
    """The checkpoint's tensors by HF name (``_TensorReader`` over every weight file, with the
    fused-module views and the family's ``view``), closed with ``stack``."""
    files = _weight_files(model_dir)
    reader = _TensorReader(files, stack, fused_checkpoint_views(files, hf_config))
    return reader if view is None else view(reader)


def load_model(
    model_dir: str,
    *,
    dtype: str | Any = "auto",
    load_format: str = "auto",
    attention_backend: str = "reference",
    interpret: bool = False,
    seed: int = 0,
    quant_config: QuantizationConfig | None = None,
    hf_config: Any = None,
) -> tuple[nnx.Module, transformers.PretrainedConfig]:
    """Builds the model for ``model_dir`` and fills its weights.

    Args:
        model_dir: local directory with ``config.json`` and, unless ``load_format="dummy"``,
            ``model.safetensors`` or ``model.safetensors.index.json`` plus its shards.
        dtype: parameter and compute dtype: "auto" (the config's), "float32"/"float",
            "bfloat16", "float16"/"half".
        load_format: "auto"/"safetensors" read the checkpoint; "dummy" fills the real shapes with
            ``normal * 0.02`` (deterministic from ``seed``) and reads no weight file.
        attention_backend: "reference" or "pallas" (see ``models.attention``).
        interpret: run Pallas kernels in interpret mode.
        seed: seed of the dummy weights.
        quant_config: the resolved quantization (``models.quantization.resolve_quantization``);
            None: the checkpoint's own (auto-detected), or none. Quantized layers keep their
            tensors quantized on the device (``models.quantized_weights``); with
            ``load_format="dummy"`` online methods quantize random float weights and
            pre-quantized formats get random stored tensors of the checkpoint's shapes.
        hf_config: the directory's config when the caller already read it (``load_config``,
            possibly a ``models.config_cache.CachedConfig``); None: read here.

    Returns:
        ``(model, hf_config)``; the model is an ``nnx.Module`` whose parameters are jax arrays
        of ``dtype`` (quantized layers: their stored dtypes).

    Raises:
        ValueError: missing directory or config.json, unsupported architecture, dtype or
            load_format, no weight files, a parameter missing / of the wrong shape (named), a
            bad quantization config or quantized tensor (named; raised before any weight is
            placed on the device).
    """
    if load_format not in _LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {list(_LOAD_FORMATS)}, got {load_format!r}")
    if hf_config is None:
        hf_config = load_config(model_dir)
    model_class = get_model_class(hf_config)
    resolved = resolve_dtype(dtype, hf_config)
    quant_config = model_quantization(hf_config, quant_config, load_format)
    if load_format != "dummy":  # before the model is built: its size follows the config
        check_checkpoint_layers(model_dir, hf_config)

    abstract = abstract_model(
        model_class, hf_config, resolved,
        attention_backend=attention_backend, interpret=interpret, seed=seed,
        quant_config=quant_config,
    )  # fmt: skip
    graphdef, abstract_state = nnx.split(abstract)
    flat_state = nnx.to_flat_state(abstract_state)
    if load_format == "dummy":
        quantized = dummy_quantized_layers(quantized_layers(abstract), seed, num_shards=1)
        filled = _dummy_state(flat_state, resolved, seed)
    else:
        with ExitStack() as stack:  # quantized layers read and checked on the host first
            reader = open_reader(model_dir, hf_config, stack, checkpoint_view(hf_config))
            quantized = read_quantized_layers(quantized_layers(abstract), reader, num_shards=1)
        filled = _load_state(
            flat_state,
            merged_output_sizes(abstract),
            model_dir,
            resolved,
            hf_config,
            checkpoint_view(hf_config),
        )
    model = nnx.merge(graphdef, nnx.from_flat_state(filled))
    place_quantized_layers(model, quantized)
    return model, hf_config


def float_weights_checksum(model: nnx.Module | Any, *extra: Any) -> tuple[float, int]:
    """``(sum of |x|, count of non-zero elements)`` over every floating-point array of
    ``model``'s state (or of ``model`` itself when it is a pytree of arrays, such as
    ``Worker.get_weights()``) and of the pytrees ``extra`` (float32 accumulation per array,
    float64 across arrays).

    Two engines built from the same checkpoint (or the same ``load_format="dummy"`` seed) give
    the same pair up to summation order, whatever layout their weights were moved or repacked
    to (a sum is permutation-invariant, zero padding counts for nothing; packed integer words
    are left out), e.g. the LoRA fold layout, which moves each kernel into the LoRA slots
    (passed as ``extra``). ``jaxpaged bench matrix`` checks with it that an engine and its
    reference hold the same weights.
    """
    total, count = 0.0, 0
    tree = nnx.state(model) if isinstance(model, nnx.Module) else model
    for leaf in jax.tree.leaves((tree, extra)):
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating):
            total += float(jnp.sum(jnp.abs(leaf.astype(jnp.float32))))
            count += int(jnp.count_nonzero(leaf))
    return total, count
