"""``models.lora.lora_delta`` (the batched per-token LoRA matmul) against a per-token loop."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.lora.peft import LoRAAdapter
from jaxpaged.lora.slots import adapter_slot_arrays
from models.lora import (
    LORA_PATHS,
    ProjectionSpec,
    lora_delta,
    lora_delta_reference,
    lora_path,
)


# Both paths at fewer tokens than the 3 slots (where the gather may be chosen) and at more.
@pytest.mark.parametrize("path", LORA_PATHS)
@pytest.mark.parametrize("num_tokens", [1, 2, 7])
def test_each_token_gets_its_own_slot_and_minus_one_gets_nothing(num_tokens, path):
    rng = np.random.default_rng(num_tokens)
    in_f, out_f, max_rank, ranks = 12, 10, 8, (3, 8, 1)
    spec = {"o_proj": ProjectionSpec(in_f, (out_f,))}
    a_list = [rng.normal(size=(in_f, r)).astype(np.float32) for r in ranks]
    b_list = [rng.normal(size=(r, out_f)).astype(np.float32) for r in ranks]
    slots = [
        adapter_slot_arrays(LoRAAdapter(r, 1.0, {(0, "o_proj"): (a, b)}), spec, 1, max_rank)[0]
        for r, a, b in zip(ranks, a_list, b_list, strict=True)
    ]
    a_all = np.concatenate([s["o_proj"][0] for s in slots], axis=1)
    b_all = np.concatenate([s["o_proj"][1] for s in slots], axis=0)
    x = rng.normal(size=(num_tokens, in_f)).astype(np.float32)
    token_slots = rng.integers(-1, len(ranks), num_tokens).astype(np.int32)
    token_slots[0] = -1
    got = lora_delta(
        jnp.asarray(x),
        jnp.asarray(token_slots),
        jnp.asarray(a_all),
        jnp.asarray(b_all),
        max_loras=len(ranks),
        path=path,
    )
    expected = lora_delta_reference(x, token_slots, a_list, b_list)
    # float32 at full precision: only summation order differs (contractions of <= 24 terms).
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)
    assert not np.asarray(got)[0].any()


def test_fused_projection_places_each_part_in_its_own_columns():
    spec = {"qkv_proj": ProjectionSpec(4, (6, 2, 2))}
    rng = np.random.default_rng(0)
    a_k, b_k = rng.normal(size=(4, 2)), rng.normal(size=(2, 2))  # only k_proj adapted
    adapter = LoRAAdapter(2, 1.0, {(0, "k_proj"): (a_k, b_k)})
    a, b = adapter_slot_arrays(adapter, spec, 1, 4)[0]["qkv_proj"]
    assert a.shape == (4, 12) and b.shape == (12, 10)
    x = rng.normal(size=(3, 4))
    delta = x @ a @ b
    np.testing.assert_allclose(delta[:, 6:8], x @ a_k @ b_k, rtol=1e-5)
    assert not delta[:, :6].any() and not delta[:, 8:].any()


def test_path_policy_gathers_only_small_steps_below_the_slot_count(monkeypatch):
    import models.lora

    monkeypatch.setattr(models.lora, "LORA_GATHER_MAX_TOKENS", 4)
    assert [lora_path(t, 8) for t in (1, 4, 5, 16)] == ["gather", "gather", "dense", "dense"]
    assert lora_path(3, 2) == "dense"  # never with more tokens than slots
    monkeypatch.setattr(models.lora, "LORA_GATHER_MAX_TOKENS", 0)
    assert lora_path(1, 8) == "dense"
    x = jnp.zeros((1, 4))
    with pytest.raises(ValueError, match="path must be one of"):
        lora_delta(x, jnp.zeros(1, jnp.int32), jnp.zeros((4, 8)), jnp.zeros((8, 3)),
                   max_loras=2, path="sparse")  # fmt: skip
