"""Which adapter sits in which device slot, and which adapters stay on the host.

Three tiers, as in vLLM's LoRA managers:

- *registered*: every ``LoRARequest`` the engine has seen (by ``lora_int_id``), with its path;
- *host*: up to ``max_cpu_loras`` adapters read and checked from disk, least recently used
  evicted first (a registered adapter evicted here is read from disk again when needed);
- *device*: ``max_loras`` slots (``jaxpaged.lora.slots``). Between steps, ``slots_for_step``
  gives each adapter of the step a slot, keeping adapters already resident where they are and
  replacing the least recently used adapter that this step does not need.

The scheduler guarantees at most ``max_loras`` distinct adapters per step
(``jaxpaged.core.scheduler``); more is a bug and raises. Invariant (``check_invariants``): an
adapter id is in at most one slot, and the host LRU holds at most ``max_cpu_loras`` adapters.
"""

from __future__ import annotations

import collections

import numpy as np
from flax import nnx

from jaxpaged.lora.peft import LoRAAdapter, load_peft_adapter
from jaxpaged.lora.placement import SlotPlacement
from jaxpaged.lora.request import LoRARequest
from jaxpaged.lora.slots import LoRASlots
from models.lora import lora_fold, take_fold_kernels
from models.sharding import tp_model_config, tp_size
from models.tp_layout import TPLayout

# Token slot of the base model (no adapter) in the step's per-token slot array.
NO_LORA_SLOT = -1


class LoRAManager:
    """Adapter registry, host LRU and slot assignment for one engine.

    Args:
        slots: the device slots (their count is ``max_loras``).
        max_cpu_loras: adapters kept in host memory, >= ``max_loras``.
    """

    def __init__(self, slots: LoRASlots, *, max_cpu_loras: int):
        if max_cpu_loras < slots.max_loras:
            raise ValueError(
                f"max_cpu_loras ({max_cpu_loras}) must be at least max_loras ({slots.max_loras})"
            )
        self.slots = slots
        self.max_loras = slots.max_loras
        self.max_cpu_loras = max_cpu_loras
        self._requests: dict[int, LoRARequest] = {}
        self._host: collections.OrderedDict[int, LoRAAdapter] = collections.OrderedDict()
        self._slot_ids: list[int | None] = [None] * self.max_loras
        self._slot_last_used = [0] * self.max_loras
        self._num_steps = 0

    # ------------------------------------------------------------------------- registry
    def add_adapter(self, request: LoRARequest) -> bool:
        """Register (and read, check and cache on the host) an adapter. False if the same
        adapter is already registered.

        Raises:
            ValueError: the id or the name is taken by a different adapter, or the adapter
                directory is bad (``jaxpaged.lora.peft.load_peft_adapter``).
        """
        known = self._requests.get(request.lora_int_id)
        if known is not None:
            if known.lora_name == request.lora_name and known.lora_path == request.lora_path:
                return False
            raise ValueError(
                f"lora_int_id {request.lora_int_id} is already used by adapter "
                f"{known.lora_name!r} ({known.lora_path!r})"
            )
        for other in self._requests.values():
            if other.lora_name == request.lora_name:
                raise ValueError(
                    f"lora_name {request.lora_name!r} is already used by lora_int_id "
                    f"{other.lora_int_id}"
                )
        adapter = self._read(request)
        self._requests[request.lora_int_id] = request
        self._remember(request.lora_int_id, adapter)
        return True

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Forget an adapter: host copy dropped, its slot zeroed. False if it was unknown.

        A running request that still uses it reads it from its path again when scheduled.
        """
        if self._requests.pop(lora_int_id, None) is None:
            return False
        self._host.pop(lora_int_id, None)
        if lora_int_id in self._slot_ids:
            slot = self._slot_ids.index(lora_int_id)
            self._slot_ids[slot] = None
            self.slots.write(slot, None)
        return True

    def list_adapters(self) -> dict[int, LoRARequest]:
        """Registered adapters by ``lora_int_id``."""
        return dict(self._requests)

    def get_adapter(self, lora_name: str) -> LoRARequest | None:
        return next((r for r in self._requests.values() if r.lora_name == lora_name), None)

    @property
    def slot_ids(self) -> tuple[int | None, ...]:
        """The adapter id in each device slot (None: empty)."""
        return tuple(self._slot_ids)

    @property
    def host_ids(self) -> tuple[int, ...]:
        """Adapter ids in the host LRU, least recently used first."""
        return tuple(self._host)

    # ---------------------------------------------------------------------------- steps
    def slots_for_step(self, lora_requests: list[LoRARequest | None]) -> np.ndarray:
        """``i32[len(lora_requests)]``: each scheduled sequence's slot (``NO_LORA_SLOT`` for
        the base model), after writing the step's missing adapters into slots.

        Raises:
            RuntimeError: more distinct adapters than ``max_loras`` (a scheduler bug).
        """
        self._num_steps += 1
        wanted = {r.lora_int_id: r for r in lora_requests if r is not None}
        if len(wanted) > self.max_loras:
            raise RuntimeError(
                f"a step uses {len(wanted)} adapters but max_loras is {self.max_loras}: "
                "the scheduler must not admit more"
            )
        for lora_id, request in wanted.items():
            if lora_id not in self._slot_ids:
                slot = self._victim_slot(wanted)
                self.slots.write(slot, self._adapter(request))
                self._slot_ids[slot] = lora_id
        slot_of = {}
        for lora_id in wanted:
            slot = self._slot_ids.index(lora_id)
            self._slot_last_used[slot] = self._num_steps
            slot_of[lora_id] = slot
        return np.array(
            [NO_LORA_SLOT if r is None else slot_of[r.lora_int_id] for r in lora_requests],
            np.int32,
        )

    def _victim_slot(self, wanted: dict) -> int:
        """An empty slot, else the least recently used slot whose adapter ``wanted`` lacks."""
        if None in self._slot_ids:
            return self._slot_ids.index(None)
        free = [s for s, lora_id in enumerate(self._slot_ids) if lora_id not in wanted]
        return min(free, key=lambda s: self._slot_last_used[s])

    def _adapter(self, request: LoRARequest) -> LoRAAdapter:
        adapter = self._host.get(request.lora_int_id)
        if adapter is None:
            adapter = self._read(request)
            self._remember(request.lora_int_id, adapter)
        else:
            self._host.move_to_end(request.lora_int_id)
        return adapter

    def _read(self, request: LoRARequest) -> LoRAAdapter:
        slots = self.slots
        return load_peft_adapter(
            request.lora_path,
            specs=slots.specs,
            num_layers=slots.num_layers,
            max_lora_rank=slots.max_lora_rank,
        )

    def _remember(self, lora_id: int, adapter: LoRAAdapter) -> None:
        self._host[lora_id] = adapter
        self._host.move_to_end(lora_id)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` if the slot table or the host LRU is inconsistent."""
        slotted = [lora_id for lora_id in self._slot_ids if lora_id is not None]
        if len(slotted) != len(set(slotted)):
            raise RuntimeError(f"an adapter sits in two slots: {self._slot_ids=}")
        if len(self._host) > self.max_cpu_loras:
            raise RuntimeError(f"host LRU over capacity: {len(self._host)=} {self.max_cpu_loras=}")


def create_lora_manager(lora_config, model, hf_config, dtype, mesh=None) -> LoRAManager | None:
    """The engine's ``LoRAManager`` with zeroed slots, or None when ``lora_config`` is None
    (LoRA off). With a ``mesh`` (tensor parallelism) the slots take the sharded model's layout
    and are split over the mesh like the base layers (``jaxpaged.lora.placement``); else they
    live on the default device, in the fold layout when ``models.lora.lora_fold`` says so
    (every adapted projection unquantized): the slots then take the model's kernels of those
    projections over (``models.lora.take_fold_kernels``), and the model runs them only with
    the slots' weights passed in (every step of an engine with LoRA does).

    Raises:
        ValueError: the model family has no LoRA support: its class does not itself define
            ``lora_projection_specs`` (a subclass must declare it, since one that overrides a
            layer's forward without passing ``lora`` on would silently drop the adapters).
    """
    if lora_config is None:
        return None
    model_class = type(model)
    if "lora_projection_specs" not in vars(model_class):
        raise ValueError(
            f"enable_lora: the model class {model_class.__name__} does not support LoRA"
        )
    placement = base_kernels = None
    tp = 1 if mesh is None else tp_size(mesh)
    if tp > 1:
        layout = TPLayout.from_hf_config(hf_config, tp)
        physical = model_class.lora_projection_specs(tp_model_config(hf_config, layout))
        placement = SlotPlacement.for_mesh(physical, hf_config, mesh)
    linears = model.lora_linears()
    quantized = any(not isinstance(m, nnx.Linear) for layer in linears for m in layer.values())
    if lora_fold(tp_size=tp, quantized=quantized):
        base_kernels = (take_fold_kernels(layer) for layer in linears)
    slots = LoRASlots(
        model_class.lora_projection_specs(hf_config),
        num_layers=int(hf_config.num_hidden_layers),
        max_loras=lora_config.max_loras,
        max_lora_rank=lora_config.max_lora_rank,
        dtype=dtype,
        placement=placement,
        base_kernels=base_kernels,
    )
    return LoRAManager(slots, max_cpu_loras=lora_config.max_cpu_loras)
