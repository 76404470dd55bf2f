"""The ``max_loras`` adapter slots on the device, and the writes that fill them.

Every layer holds, per projection, one ``models.lora.LoRAWeights`` with all slots stacked
(``models.lora`` documents the layout). The arrays are allocated once at start-up at their
final shapes; loading an adapter into slot ``s`` writes its columns/rows with one jitted
``dynamic_update_slice`` per array, whose slot index is a traced argument, so no slot write
and no step ever compiles again because an adapter came or went.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.lora.peft import LoRAAdapter
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
        specs: projection sizes of one layer (``models.lora.llama_projection_specs``).
        num_layers: layers of the base model.
        max_loras: ``S``, slots (adapters one step can use).
        max_lora_rank: ``R``; every slot is padded to it.
        dtype: the model's compute dtype (slot arrays are stored in it).
        sharding: where the arrays live (replicated on a mesh); None = default device.
    """

    def __init__(
        self,
        specs: dict[str, ProjectionSpec],
        *,
        num_layers: int,
        max_loras: int,
        max_lora_rank: int,
        dtype,
        sharding=None,
    ):
        self.specs = specs
        self.num_layers = num_layers
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank

        def zeros(shape):
            array = jnp.zeros(shape, dtype)
            return array if sharding is None else jax.device_put(array, sharding)

        self.weights: tuple[dict[str, LoRAWeights], ...] = tuple(
            {
                name: LoRAWeights(
                    a=zeros((spec.in_features, max_loras * slot_columns(name, max_lora_rank))),
                    b=zeros((max_loras * slot_columns(name, max_lora_rank), spec.out_features)),
                )
                for name, spec in specs.items()
            }
            for _ in range(num_layers)
        )
        # Donated: a write updates the slot arrays in place instead of copying all slots.
        self._write = jax.jit(_write_slot, donate_argnums=0)
        self.num_writes = 0

    def write(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Put ``adapter`` (None: zeros, i.e. the base model) into slot ``slot``.

        Raises:
            ValueError: ``slot`` outside ``[0, max_loras)``.
        """
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"slot must be in [0, {self.max_loras}), got {slot}")
        arrays = adapter_slot_arrays(adapter, self.specs, self.num_layers, self.max_lora_rank)
        self.weights = self._write(self.weights, np.int32(slot), arrays)
        self.num_writes += 1

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(self.weights))
