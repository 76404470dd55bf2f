"""Slot assignment and the host LRU of ``LoRAManager``; slot writes never re-trace."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.lora.dummy import write_random_peft_adapter
from jaxpaged.lora.manager import NO_LORA_SLOT, LoRAManager
from jaxpaged.lora.request import LoRARequest
from jaxpaged.lora.slots import LoRASlots
from models.lora import ProjectionSpec

SPECS = {
    "qkv_proj": ProjectionSpec(8, (8, 4, 4)),
    "o_proj": ProjectionSpec(8, (8,)),
    "gate_up_proj": ProjectionSpec(8, (12, 12)),
    "down_proj": ProjectionSpec(12, (8,)),
}


@pytest.fixture
def requests(tmp_path):
    out = []
    for i in range(1, 5):
        path = write_random_peft_adapter(
            str(tmp_path / f"a{i}"),
            specs=SPECS,
            num_layers=2,
            rank=2 * i,
            lora_alpha=4.0,
            target_modules=["q_proj", "down_proj"],
            seed=i,
        )
        out.append(LoRARequest(f"a{i}", i, path))
    return out


def _manager(max_loras=2, max_cpu_loras=3):
    slots = LoRASlots(SPECS, num_layers=2, max_loras=max_loras, max_lora_rank=8, dtype=jnp.float32)
    return LoRAManager(slots, max_cpu_loras=max_cpu_loras)


def _slot_a(manager, slot, layer=0, name="qkv_proj"):
    a = np.asarray(manager.slots.weights[layer][name].a)
    cols = a.shape[1] // manager.max_loras
    return a[:, slot * cols : (slot + 1) * cols]


def test_resident_adapters_keep_their_slots_and_the_lru_one_is_replaced(requests):
    manager = _manager()
    r1, r2, r3, _ = requests
    slots = manager.slots_for_step([r1, None, r2, r1])
    assert slots.tolist() == [0, NO_LORA_SLOT, 1, 0]
    assert manager.slots_for_step([r2]).tolist() == [1]  # r2 used last; r1 is now the LRU
    writes = manager.slots.num_writes
    assert manager.slots_for_step([r3, r2]).tolist() == [0, 1]
    assert manager.slots.num_writes == writes + 1
    assert manager.slot_ids == (3, 2)
    manager.check_invariants()


def test_slot_holds_the_adapter_q_columns_then_zeros_after_unload(requests):
    manager = _manager()
    manager.add_adapter(requests[0])
    (slot,) = manager.slots_for_step([requests[0]])
    a_q = manager._host[1].weights[(0, "q_proj")][0]  # [in, r=2]
    np.testing.assert_array_equal(_slot_a(manager, slot)[:, :2], a_q)
    assert not _slot_a(manager, slot)[:, 2:8].any()  # rank padding and the un-adapted k
    assert manager.remove_adapter(1)
    assert not _slot_a(manager, slot).any()
    assert manager.slot_ids[slot] is None
    assert not manager.remove_adapter(1)


def test_more_adapters_than_slots_in_one_step_is_a_bug(requests):
    manager = _manager()
    with pytest.raises(RuntimeError, match="a step uses 3 adapters but max_loras is 2"):
        manager.slots_for_step(requests[:3])


def test_host_lru_keeps_max_cpu_loras_most_recent(requests):
    manager = _manager(max_cpu_loras=3)
    for request in requests:
        manager.add_adapter(request)
    assert manager.host_ids == (2, 3, 4)
    manager.slots_for_step([requests[0]])  # read from disk again, now most recent
    assert manager.host_ids == (3, 4, 1)
    assert set(manager.list_adapters()) == {1, 2, 3, 4}


def test_registry_refuses_clashing_ids_and_names(requests):
    manager = _manager()
    assert manager.add_adapter(requests[0])
    assert not manager.add_adapter(requests[0])
    with pytest.raises(ValueError, match="lora_int_id 1 is already used by adapter 'a1'"):
        manager.add_adapter(LoRARequest("other", 1, requests[1].lora_path))
    with pytest.raises(ValueError, match="lora_name 'a1' is already used by lora_int_id 1"):
        manager.add_adapter(LoRARequest("a1", 7, requests[1].lora_path))


def test_max_cpu_loras_below_max_loras_is_refused():
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be at least max_loras \(2\)"):
        _manager(max_loras=2, max_cpu_loras=1)


def test_slot_writes_compile_once(requests):
    manager = _manager()
    manager.slots_for_step([requests[0]])
    with jax.no_tracing(True):
        for request in requests[1:]:
            manager.slots_for_step([request])
        manager.remove_adapter(requests[3].lora_int_id)


def test_a_model_class_must_declare_lora_support_itself():
    from types import SimpleNamespace

    from jaxpaged.lora.manager import create_lora_manager
    from models.llama import LlamaForCausalLM

    class Subclass(LlamaForCausalLM):  # e.g. a family overriding a layer's forward
        pass

    config = SimpleNamespace(max_loras=1, max_lora_rank=8, max_cpu_loras=1)
    with pytest.raises(ValueError, match="model class Subclass does not support LoRA"):
        create_lora_manager(config, object.__new__(Subclass), None, jnp.float32)


@pytest.mark.parametrize("class_name", ["GPT2LMHeadModel", "BloomForCausalLM"])
def test_layernorm_families_refuse_lora_by_class_name(class_name):
    from types import SimpleNamespace

    import models.gpt2
    from jaxpaged.lora.manager import create_lora_manager

    cls = getattr(models.gpt2, class_name)
    config = SimpleNamespace(max_loras=1, max_lora_rank=8, max_cpu_loras=1)
    with pytest.raises(ValueError, match=f"model class {class_name} does not support LoRA"):
        create_lora_manager(config, object.__new__(cls), None, jnp.float32)
