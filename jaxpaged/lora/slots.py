"""The ``max_loras`` adapter slots on the device, and the writes that fill them.

Every layer holds, per projection, one ``models.lora.LoRAWeights`` with all slots stacked
(``models.lora`` documents the layout). The arrays are allocated once at start-up at their
final shapes; loading an adapter into slot ``s`` writes its columns/rows with one jitted
``dynamic_update_slice`` per array, whose slot index is a traced argument, so no slot write
and no step ever compiles again because an adapter came or went. In the fold layout
(``models.lora``) each ``a`` is ``[W | slots]``, built from the base kernels the slots take over
from the model, and a write touches only the slot columns after ``W``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.lora.peft import LoRAAdapter
from jaxpaged.lora.placement import SlotPlacement
from models.lora import LORA_PROJECTIONS, LoRAWeights, ProjectionSpec, fold_kernel


def slot_columns(spec_name: str, max_lora_rank: int) -> int:
    """``C``: columns one slot takes in projection ``spec_name`` (parts x max_lora_rank)."""
    return len(LORA_PROJECTIONS[spec_name]) * max_lora_rank


def adapter_slot_arrays(
    adapter: LoRAAdapter | None,
    specs: dict[str, ProjectionSpec],
    num_layers: int,
    max_lora_rank: int,
) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], ...]:
    """One slot's contents, float32 on the host: per layer, per projection ``(a [in, C],
    b [C, out])``, rank-padded with zeros, ``b`` block-diagonal over a fused projection's parts
    (part ``p``: rows ``p*R .. p*R+r``, its own output columns). ``None``: an empty slot."""
    layers = []
    for layer in range(num_layers):
        arrays = {}
        for name, spec in specs.items():
            cols = slot_columns(name, max_lora_rank)
            a = np.zeros((spec.in_features, cols), np.float32)
            b = np.zeros((cols, spec.out_features), np.float32)
            out_start = 0
            for p, (module, size) in enumerate(
                zip(LORA_PROJECTIONS[name], spec.part_sizes, strict=True)
            ):
                pair = None if adapter is None else adapter.weights.get((layer, module))
                if pair is not None:
                    part_a, part_b = pair
                    r = part_a.shape[1]
                    row = p * max_lora_rank
                    a[:, row : row + r] = part_a
                    b[row : row + r, out_start : out_start + size] = part_b
                out_start += size
            arrays[name] = (a, b)
        layers.append(arrays)
    return tuple(layers)


def _write_slot(weights, slot, new):
    """``weights`` with slot ``slot`` (traced i32) replaced by ``new`` (one slot's arrays)."""

    def write(w: LoRAWeights, a: jax.Array, b: jax.Array) -> LoRAWeights:
        cols = a.shape[1]
        start = w.base_columns + slot * cols
        return dataclasses.replace(
            w,
            a=jax.lax.dynamic_update_slice(w.a, a.astype(w.a.dtype), (0, start)),
            b=jax.lax.dynamic_update_slice(w.b, b.astype(w.b.dtype), (slot * cols, 0)),
        )

    return tuple(
        {name: write(layer[name], *new_layer[name]) for name in layer}
        for layer, new_layer in zip(weights, new, strict=True)
    )


class LoRASlots:
    """The device arrays of ``max_loras`` adapter slots and the slot writer.

    Args:
        specs: projection sizes of one layer in the checkpoint's layout
            (``models.lora.llama_projection_specs``); adapters are read and checked against it.
        num_layers: layers of the base model.
        max_loras: ``S``, slots (adapters one step can use).
        max_lora_rank: ``R``; every slot is padded to it.
        dtype: the model's compute dtype (slot arrays are stored in it).
        placement: tensor parallelism (``jaxpaged.lora.placement``): the arrays take the
            sharded model's layout and are split over its mesh like the base layers; None:
            the checkpoint's layout on the default device.
        base_kernels: the fold layout (``models.lora``; one device only): per layer, each
            projection's base kernel ``[in, out]`` (``models.lora.take_fold_kernels``), folded
            into ``a = [W | zeros]`` one layer at a time as the iterable is consumed (so a
            generator holds one layer's second copy at a time). None: plain slot arrays.

    Raises:
        ValueError: ``base_kernels`` with a ``placement``, or with a layer count or a
            kernel shape other than ``num_layers`` / ``[in, out]`` of ``specs``.
    """

    def __init__(
        self,
        specs: dict[str, ProjectionSpec],
        *,
        num_layers: int,
        max_loras: int,
        max_lora_rank: int,
        dtype,
        placement: SlotPlacement | None = None,
        base_kernels: Iterable[dict[str, jax.Array]] | None = None,
    ):
        if base_kernels is not None and placement is not None:
            raise ValueError("base_kernels: the fold layout is for one device (no placement)")
        self.specs = specs
        self.num_layers = num_layers
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.placement = placement
        physical = specs if placement is None else placement.physical_specs

        def zeros(name: str, spec: ProjectionSpec) -> LoRAWeights:
            cols = max_loras * slot_columns(name, max_lora_rank)
            shapes = ((spec.in_features, cols), (cols, spec.out_features))
            shardings = (None, None) if placement is None else placement.shardings(name)
            a, b = (
                jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=sharding)()
                for shape, sharding in zip(shapes, shardings, strict=True)
            )
            return LoRAWeights(a=a, b=b)

        def folded(kernels: dict[str, jax.Array]) -> dict[str, LoRAWeights]:
            layer = {}
            for name, spec in physical.items():
                kernel = kernels[name]
                if kernel.shape != (spec.in_features, spec.out_features):
                    raise ValueError(
                        f"base_kernels: {name} kernel shape {kernel.shape} must be "
                        f"{(spec.in_features, spec.out_features)}"
                    )
                cols = max_loras * slot_columns(name, max_lora_rank)
                a = fold_kernel(kernel, cols)
                # On a's device, committed like a, so every write sees the same argument kind.
                b = jax.device_put(jnp.zeros((cols, spec.out_features), dtype), a.sharding)
                layer[name] = LoRAWeights(a=a, b=b, base_columns=spec.out_features)
            return layer

        if base_kernels is None:
            layers = ({name: zeros(name, spec) for name, spec in physical.items()}
                      for _ in range(num_layers))  # fmt: skip
        else:
            layers = (folded(kernels) for kernels in base_kernels)
        self.weights: tuple[dict[str, LoRAWeights], ...] = tuple(layers)
        if len(self.weights) != num_layers:
            raise ValueError(
                f"base_kernels: {len(self.weights)} layers, the model has {num_layers}"
            )
        self._shardings = jax.tree.map(lambda x: x.sharding, self.weights)
        # Donated: a write updates the slot arrays in place instead of copying all slots. On a
        # mesh the output keeps the slot arrays' shardings, so the step's executables stay
        # valid (one device: uncommitted arrays in and out, the same every write).
        placed = {} if placement is None else {"out_shardings": self._shardings}
        self._write = jax.jit(_write_slot, donate_argnums=0, **placed)
        self.num_writes = 0

    def write(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Put ``adapter`` (None: zeros, i.e. the base model) into slot ``slot``.

        Raises:
            ValueError: ``slot`` outside ``[0, max_loras)``.
        """
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"slot must be in [0, {self.max_loras}), got {slot}")
        arrays = adapter_slot_arrays(adapter, self.specs, self.num_layers, self.max_lora_rank)
        if self.placement is not None:
            # Physical layout, and each device receives only its own part of the slot.
            arrays = tuple(
                {name: self.placement.place(name, *pair) for name, pair in layer.items()}
                for layer in arrays
            )
            shardings = tuple(
                {name: (w.a, w.b) for name, w in layer.items()} for layer in self._shardings
            )
            arrays = jax.device_put(arrays, shardings)
        self.weights = self._write(self.weights, np.int32(slot), arrays)
        self.num_writes += 1

    @property
    def nbytes(self) -> int:
        """Bytes of the slot arrays (in the fold layout, the base kernels they hold included)."""
        return sum(x.nbytes for x in jax.tree.leaves(self.weights))
