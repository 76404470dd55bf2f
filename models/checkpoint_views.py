"""GPT-2 and BLOOM checkpoints seen through the standard tensor layout the loaders read.

``models.weights`` and ``models.sharded_weights`` fill each parameter from HF tensors named by
``models.weights.hf_names``: linear weights ``[out, in]`` (``nn.Linear``), a fused
``qkv_proj`` from separate ``q_proj``/``k_proj``/``v_proj`` tensors. ``models.gpt2`` uses those
parameter names, and a view here presents its family's checkpoint under them, so both loaders
(including the per-device slice reads of tensor parallelism) work unchanged:

- GPT-2 (HF ``Conv1D``): every ``attn``/``mlp`` weight is stored ``[in, out]``; the view
  transposes it. ``attn.c_attn`` holds ``[q | k | v]`` along its output axis; ``q_proj`` is
  columns ``0:hidden`` of it, and so on.
- BLOOM: ``self_attention.query_key_value`` is an ``nn.Linear`` whose output rows are
  ``[Hq, 3, D]`` (HF ``BloomAttention._reshape``: each head's q, k, v side by side); ``q_proj``
  is rows ``h * 3 D + d`` for every head ``h``, ``k_proj`` rows ``h * 3 D + D + d``, ...

Hub checkpoints saved before the ``transformer.`` prefix (``gpt2``, ``bigscience/bloom-560m``)
name tensors ``h.0.attn...``; a name missing with the prefix is looked up without it, as vLLM's
loaders do.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

_Q_K_V = ("q_proj", "k_proj", "v_proj")


@dataclasses.dataclass(frozen=True)
class _Source:
    """Where a standard-layout tensor comes from: HF tensor ``name``, transposed first when
    ``transpose`` (``Conv1D``), then only its output rows ``rows`` (None: all)."""

    name: str
    transpose: bool = False
    rows: np.ndarray | None = None


class CheckpointView:
    """A tensor reader (``models.weights._TensorReader``'s interface: ``in``, ``shape``,
    ``read``, ``read_slice``) over another reader, under standard names.

    Args:
        reader: the checkpoint's own reader.
        sources: standard HF-style name -> :class:`_Source`; names not listed pass through.
    """

    def __init__(self, reader: Any, sources: dict[str, _Source]):
        self._reader = reader
        self._sources = sources

    def _source(self, name: str) -> _Source:
        source = self._sources.get(name, _Source(name))
        if source.name not in self._reader:
            unprefixed = source.name.removeprefix("transformer.")
            if unprefixed in self._reader:
                return dataclasses.replace(source, name=unprefixed)
        return source

    def __contains__(self, name: str) -> bool:
        return self._source(name).name in self._reader

    def shape(self, name: str) -> tuple[int, ...]:
        source = self._source(name)
        shape = self._reader.shape(source.name)
        if source.transpose:
            shape = shape[::-1]
        if source.rows is not None:
            shape = (len(source.rows), *shape[1:])
        return tuple(shape)

    def dtype(self, name: str):
        """The stored dtype of the tensor behind ``name`` (None where the reader tells none)."""
        dtype = getattr(self._reader, "dtype", None)
        return None if dtype is None else dtype(self._source(name).name)

    def read(self, name: str):
        source = self._source(name)
        tensor = self._reader.read(source.name)  # numpy, or jax for bfloat16
        if source.transpose:
            tensor = tensor.T
        return tensor if source.rows is None else tensor[source.rows]

    def read_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """``tensor[index]`` in the standard layout, reading only the smallest box of the HF
        tensor that covers it."""
        source = self._source(name)
        num_rows = self.shape(name)[0]
        rows = np.arange(num_rows) if source.rows is None else source.rows
        rows = rows[index[0]]
        lo, hi = int(rows.min()), int(rows.max()) + 1
        if len(index) == 1:
            block = np.asarray(self._reader.read_slice(source.name, (slice(lo, hi),)))
            return block[rows - lo]
        columns = index[1]
        if source.transpose:  # stored [in, out]: the standard [out, in] is its transpose
            block = np.asarray(self._reader.read_slice(source.name, (columns, slice(lo, hi)))).T
        else:
            block = np.asarray(self._reader.read_slice(source.name, (slice(lo, hi), columns)))
        return block[rows - lo]


def _layernorm(sources: dict, ours: str, theirs: str) -> None:
    for leaf in ("weight", "bias"):
        sources[f"{ours}.{leaf}"] = _Source(f"{theirs}.{leaf}")


def _linear(sources: dict, ours: str, theirs: str, *, conv1d: bool, rows=None) -> None:
    sources[f"{ours}.weight"] = _Source(f"{theirs}.weight", transpose=conv1d, rows=rows)
    sources[f"{ours}.bias"] = _Source(f"{theirs}.bias", rows=rows)


def gpt2_view(reader: Any, config: Any) -> CheckpointView:
    """The standard-layout view of a ``GPT2LMHeadModel`` checkpoint (see the module docstring)."""
    hidden = int(config.hidden_size)
    sources = {
        "model.embed_tokens.weight": _Source("transformer.wte.weight"),
        "model.embed_positions.weight": _Source("transformer.wpe.weight"),
    }
    _layernorm(sources, "model.norm", "transformer.ln_f")
    for i in range(int(config.num_hidden_layers)):
        ours, theirs = f"model.layers.{i}", f"transformer.h.{i}"
        _layernorm(sources, f"{ours}.input_layernorm", f"{theirs}.ln_1")
        _layernorm(sources, f"{ours}.post_attention_layernorm", f"{theirs}.ln_2")
        for part, proj in enumerate(_Q_K_V):
            rows = part * hidden + np.arange(hidden)
            _linear(
                sources, f"{ours}.self_attn.{proj}", f"{theirs}.attn.c_attn", conv1d=True, rows=rows
            )
        _linear(sources, f"{ours}.self_attn.o_proj", f"{theirs}.attn.c_proj", conv1d=True)
        _linear(sources, f"{ours}.mlp.up_proj", f"{theirs}.mlp.c_fc", conv1d=True)
        _linear(sources, f"{ours}.mlp.down_proj", f"{theirs}.mlp.c_proj", conv1d=True)
    return CheckpointView(reader, sources)


def bloom_view(reader: Any, config: Any) -> CheckpointView:
    """The standard-layout view of a ``BloomForCausalLM`` checkpoint (see the module docstring)."""
    num_heads = int(config.num_attention_heads)
    head_dim = int(config.hidden_size) // num_heads
    sources = {"model.embed_tokens.weight": _Source("transformer.word_embeddings.weight")}
    _layernorm(sources, "model.embed_layernorm", "transformer.word_embeddings_layernorm")
    _layernorm(sources, "model.norm", "transformer.ln_f")
    head = np.arange(num_heads)[:, None] * 3 * head_dim  # [Hq, 1]: each head's first row
    for i in range(int(config.num_hidden_layers)):
        ours, theirs = f"model.layers.{i}", f"transformer.h.{i}"
        _layernorm(sources, f"{ours}.input_layernorm", f"{theirs}.input_layernorm")
        _layernorm(
            sources, f"{ours}.post_attention_layernorm", f"{theirs}.post_attention_layernorm"
        )
        for part, proj in enumerate(_Q_K_V):
            rows = (head + part * head_dim + np.arange(head_dim)[None, :]).reshape(-1)
            _linear(
                sources,
                f"{ours}.self_attn.{proj}",
                f"{theirs}.self_attention.query_key_value",
                conv1d=False,
                rows=rows,
            )
        _linear(sources, f"{ours}.self_attn.o_proj", f"{theirs}.self_attention.dense", conv1d=False)
        _linear(sources, f"{ours}.mlp.up_proj", f"{theirs}.mlp.dense_h_to_4h", conv1d=False)
        _linear(sources, f"{ours}.mlp.down_proj", f"{theirs}.mlp.dense_4h_to_h", conv1d=False)
    return CheckpointView(reader, sources)
