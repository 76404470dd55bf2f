"""The fold layout (``models.lora``: ``x @ [W | a]``, then mask and expand) against the base
projection plus the per-token reference (``lora_delta_reference``) and against the dense path,
through the slot writer (``jaxpaged.lora.slots.LoRASlots``) loading and unloading adapters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models.lora
from jaxpaged.lora.peft import LoRAAdapter
from jaxpaged.lora.slots import LoRASlots
from models.lora import (
    LORA_PROJECTIONS,
    LoRALayer,
    ProjectionSpec,
    lora_delta_reference,
    lora_fold,
    lora_project,
    take_fold_kernels,
)
from models.merged_linear import MergedColumnParallelLinear

SPECS = {"qkv_proj": ProjectionSpec(12, (8, 4, 4)), "o_proj": ProjectionSpec(8, (12,))}
MAX_LORAS, MAX_RANK = 3, 4


def _linears(seed: int) -> dict:
    kw = dict(dtype=jnp.float32, param_dtype=jnp.float32,
              precision=jax.lax.Precision.HIGHEST, rngs=nnx.Rngs(seed))  # fmt: skip
    qkv = SPECS["qkv_proj"]
    return {
        "qkv_proj": MergedColumnParallelLinear(
            qkv.in_features, qkv.part_sizes, num_shards=1, use_bias=True, **kw
        ),
        "o_proj": nnx.Linear(8, 12, use_bias=False, **kw),
    }


def _adapter(rng, rank: int, skip: str) -> LoRAAdapter:
    """Random A / B on every module of ``SPECS`` except ``skip``."""
    weights = {}
    for name, spec in SPECS.items():
        for module, size in zip(LORA_PROJECTIONS[name], spec.part_sizes, strict=True):
            if module != skip:
                a = rng.normal(size=(spec.in_features, rank)).astype(np.float32)
                weights[(0, module)] = (a, rng.normal(size=(rank, size)).astype(np.float32))
    return LoRAAdapter(rank, 1.0, weights)


def _expected(name, x, token_slots, kernel, bias, adapters):
    """``x @ W + bias`` plus each token's adapter, module by module (the reference)."""
    out = x @ kernel + (0.0 if bias is None else bias)
    start = 0
    spec = SPECS[name]
    for module, size in zip(LORA_PROJECTIONS[name], spec.part_sizes, strict=True):
        pairs = []
        for adapter in adapters:
            pair = None if adapter is None else adapter.weights.get((0, module))
            zero = (np.zeros((spec.in_features, 1), np.float32), np.zeros((1, size), np.float32))
            pairs.append(zero if pair is None else pair)
        out[:, start : start + size] += lora_delta_reference(
            x, token_slots, [a for a, _ in pairs], [b for _, b in pairs]
        )
        start += size
    return out


def test_fold_equals_reference_and_dense_through_load_and_unload():
    rng = np.random.default_rng(0)
    fold_linears, dense_linears = _linears(1), _linears(1)  # same initial weights
    kernels = {n: np.asarray(m.kernel[...]) for n, m in dense_linears.items()}
    bias = np.asarray(dense_linears["qkv_proj"].bias[...])
    common = dict(num_layers=1, max_loras=MAX_LORAS, max_lora_rank=MAX_RANK, dtype=jnp.float32)
    fold = LoRASlots(SPECS, base_kernels=[take_fold_kernels(fold_linears)], **common)
    dense = LoRASlots(SPECS, **common)
    # The slots hold the only copy of W: the layers keep empty placeholders.
    assert all(m.kernel[...].shape == (s.in_features, 0)
               for m, s in zip(fold_linears.values(), SPECS.values(), strict=True))  # fmt: skip
    adapters = [_adapter(rng, 2, skip="v_proj"), None, _adapter(rng, 4, skip="o_proj")]
    x = rng.normal(size=(6, 12)).astype(np.float32)
    token_slots = np.array([0, -1, 2, 0, 2, 1], np.int32)

    def check(adapters):
        for slots in (fold, dense):
            for s, adapter in enumerate(adapters):
                slots.write(s, adapter)
        for name, xs in (("qkv_proj", x), ("o_proj", x[:, :8])):
            got = [
                lora_project(LoRALayer(jnp.asarray(token_slots), slots.weights[0], MAX_LORAS),
                             name, linears[name], jnp.asarray(xs))
                for slots, linears in ((fold, fold_linears), (dense, dense_linears))
            ]  # fmt: skip
            got = [np.concatenate(g, axis=1) if isinstance(g, tuple) else g for g in got]
            expected = _expected(name, xs, token_slots, kernels[name],
                                 bias if name == "qkv_proj" else None, adapters)  # fmt: skip
            scale = np.abs(expected).max()
            # float32 at full precision: only the summation order differs.
            np.testing.assert_allclose(got[0], expected, rtol=0, atol=1e-5 * scale)
            np.testing.assert_allclose(got[0], got[1], rtol=0, atol=1e-5 * scale)
            # Slot writes leave the base columns bit for bit.
            w = fold.weights[0][name]
            assert w.base_columns == kernels[name].shape[1]
            np.testing.assert_array_equal(np.asarray(w.a[:, : w.base_columns]), kernels[name])

    check(adapters)
    # Swap: slot 0 unloaded (its tokens get the base output only), slot 1 loaded.
    check([None, _adapter(rng, 3, skip="q_proj"), adapters[2]])


def test_fold_policy_is_one_device_and_unquantized_only(monkeypatch):
    assert not lora_fold(tp_size=1, quantized=False)  # off by default (models.lora.LORA_FOLD)
    monkeypatch.setattr(models.lora, "LORA_FOLD", True)
    assert lora_fold(tp_size=1, quantized=False)
    assert not lora_fold(tp_size=2, quantized=False)
    assert not lora_fold(tp_size=1, quantized=True)


def test_fold_slots_refuse_a_mesh_placement_and_a_wrong_kernel():
    common = dict(num_layers=1, max_loras=1, max_lora_rank=2, dtype=jnp.float32)
    wrong = {"qkv_proj": jnp.zeros((12, 15)), "o_proj": jnp.zeros((8, 12))}
    with pytest.raises(ValueError, match=r"qkv_proj kernel shape \(12, 15\) must be \(12, 16\)"):
        LoRASlots(SPECS, base_kernels=[wrong], **common)
    with pytest.raises(ValueError, match="base_kernels: the fold layout is for one device"):
        LoRASlots(SPECS, base_kernels=[], placement=object(), **common)
