"""Multi-LoRA under tensor parallelism: the slot layout on the host, and the engine at tp=2 on
two CPU devices (``multidevice_lora_checks.py``, in a subprocess)."""

from __future__ import annotations

import pathlib

import numpy as np
import transformers
from jax.sharding import AbstractMesh

from jaxpaged.lora.peft import LoRAAdapter
from jaxpaged.lora.placement import SlotPlacement
from jaxpaged.lora.slots import adapter_slot_arrays
from models.lora import LORA_PROJECTIONS, llama_projection_specs
from models.sharding import tp_model_config
from models.tp_layout import TPLayout
from tests.multidevice import run_on_cpu_devices

HERE = pathlib.Path(__file__).resolve().parent


def test_tp2_engine_with_mixed_adapters_matches_peft_and_never_compiles_on_swaps():
    report = run_on_cpu_devices([str(HERE / "multidevice_lora_checks.py")], 2)
    for line in (
        "tp=2: slot arrays split like their base layers",
        "tp=2: greedy tokens with mixed adapters equal peft's",
        "tp=2: row-parallel LoRA shrinks reduced with the base outputs",
        "tp=2: loading, swapping and unloading adapters compiled nothing",
        "ALL OK",
    ):
        assert line in report, report


def test_slot_follows_repeated_kv_heads_padded_mlp_and_shard_major_columns():
    """tp=4 over Hq=4, Hkv=2 (each KV head on 2 devices), D=2, intermediate 6 (padded to 8):
    a token's update, computed from the physical slot and split as the sharded model splits
    its fused output, equals the checkpoint-layout update (k/v heads repeated in place,
    padding zero); padded down inputs add nothing."""
    tp, heads, kv_heads, head_dim, inter, hidden, rank = 4, 4, 2, 2, 6, 8, 3
    config = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, num_hidden_layers=1, vocab_size=16,
    )  # fmt: skip
    layout = TPLayout.from_hf_config(config, tp)
    specs = llama_projection_specs(config)
    physical = llama_projection_specs(tp_model_config(config, layout))
    placement = SlotPlacement.for_mesh(physical, config, AbstractMesh((tp,), ("tp",)))
    rng = np.random.default_rng(0)
    weights = {}
    for name, spec in specs.items():
        for module, size in zip(LORA_PROJECTIONS[name], spec.part_sizes, strict=True):
            weights[(0, module)] = (rng.normal(size=(spec.in_features, rank)),
                                    rng.normal(size=(rank, size)))  # fmt: skip
    (slot,) = adapter_slot_arrays(LoRAAdapter(rank, 1.0, weights), specs, 1, 4)

    def update(name, x, physical_layout):
        a, b = placement.place(name, *slot[name]) if physical_layout else slot[name]
        return x @ a @ b

    def split(y, sizes):  # the sharded model's split of a fused output (models.merged_linear)
        y = y.reshape(len(y), tp, -1)
        bounds = np.cumsum([0, *(n // tp for n in sizes)])
        return [
            y[:, :, lo:hi].reshape(len(y), -1)
            for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)
        ]

    x = rng.normal(size=(3, hidden))
    q, k, v = np.split(
        update("qkv_proj", x, False), np.cumsum(specs["qkv_proj"].part_sizes)[:-1], 1
    )
    q_p, k_p, v_p = split(update("qkv_proj", x, True), physical["qkv_proj"].part_sizes)
    np.testing.assert_allclose(q_p, q)
    for logical, got in ((k, k_p), (v, v_p)):  # each KV head twice, in place
        repeated = np.repeat(logical.reshape(3, kv_heads, head_dim), tp // kv_heads, axis=1)
        np.testing.assert_allclose(got, repeated.reshape(3, -1))
    gate, up = np.split(update("gate_up_proj", x, False), 2, axis=1)
    gate_p, up_p = split(update("gate_up_proj", x, True), physical["gate_up_proj"].part_sizes)
    for logical, got in ((gate, gate_p), (up, up_p)):
        np.testing.assert_allclose(got[:, :inter], logical)
        assert not got[:, inter:].any()  # padded columns stay zero
    h = rng.normal(size=(3, inter))
    padded = np.concatenate([h, rng.normal(size=(3, 2))], axis=1)  # padding rows of A are zero
    np.testing.assert_allclose(update("down_proj", padded, True), update("down_proj", h, False))
    attn = rng.normal(size=(3, heads * head_dim))
    np.testing.assert_allclose(update("o_proj", attn, True), update("o_proj", attn, False))
