"""The ``max_loras`` adapter slots on the device, and the writes that fill them.

Every layer holds, per projection, one ``models.lora.LoRAWeights`` with all slots stacked
(``models.lora`` documents the layout). The arrays are allocated once at start-up at their
final shapes; loading an adapter into slot ``s`` writes its columns/rows with one jitted
``dynamic_update_slice`` per array, whose slot index is a traced argument, so no slot write
and no step ever compiles again because an adapter came or went.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.lora.peft import LoRAAdapter
from jaxpaged.lora.placement import SlotPlacement
from models.lora import LORA_PROJECTIONS, LoRAWeights, ProjectionSpec


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
        start = slot * cols
        return LoRAWeights(
            a=jax.lax.dynamic_update_slice(w.a, a.astype(w.a.dtype), (0, start)),
            b=jax.lax.dynamic_update_slice(w.b, b.astype(w.b.dtype), (start, 0)),
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
    ):
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

        self.weights: tuple[dict[str, LoRAWeights], ...] = tuple(
            {name: zeros(name, spec) for name, spec in physical.items()} for _ in range(num_layers)
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
        return sum(x.nbytes for x in jax.tree.leaves(self.weights))
