"""KV-cache sizing from gpu_memory_utilization (docs/architecture.md, "KV cache sizing") on fake memory statistics."""

from __future__ import annotations

import types

import pytest

from jaxpaged.worker.kv_cache import (
    KV_HEADROOM_FRACTION,
    KVCacheSpec,
    MemoryBudget,
    device_memory_bytes,
    measure_kv_budget,
    num_blocks_for_budget,
)

GIB = 2**30


def _device(stats, platform="cpu"):
    return types.SimpleNamespace(memory_stats=lambda: stats, platform=platform, id=0)


def test_budget_is_utilization_of_the_device_minus_the_profiled_peak():
    # No driver to ask off GPU: the pool stands for the device.
    device = _device({"bytes_limit": 100 * GIB, "peak_bytes_in_use": 30 * GIB})
    budget = measure_kv_budget(0.9, device, weights_bytes=16 * GIB)
    assert budget.usable == 90 * GIB
    assert budget.left_after_weights_and_activations == 60 * GIB
    assert budget.kv_bytes == 60 * GIB - int(KV_HEADROOM_FRACTION * 60 * GIB)
    assert budget.kv_bytes / budget.left_after_weights_and_activations >= 0.9


def test_budget_never_exceeds_the_jax_pool():
    budget = MemoryBudget(
        total=140 * GIB,
        pool=105 * GIB,
        requested=126 * GIB,
        weights=15 * GIB,
        peak=20 * GIB,
        headroom=GIB,
    )
    assert budget.usable == 105 * GIB
    assert budget.kv_bytes == 84 * GIB


def test_no_memory_statistics_means_no_budget():
    assert measure_kv_budget(0.9, _device(None), weights_bytes=0) is None
    assert device_memory_bytes(_device(None)) is None  # not a GPU


def test_blocks_for_budget_of_llama3_8b_shape():
    spec = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
    assert spec.bytes_per_block == 2 * 1024**2  # 16 tokens x 128 KiB
    assert num_blocks_for_budget(spec, 100 * GIB, cap=2**31 - 1) == 51200
    with pytest.raises(ValueError, match="holds no block"):
        num_blocks_for_budget(spec, 1024, cap=10)
