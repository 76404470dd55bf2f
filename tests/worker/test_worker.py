"""``Worker``: the one owner of the device; the engine's constructor only wires host objects."""

from __future__ import annotations

import ast
import gc
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpaged.worker.worker as worker_module
import pallas_kernels
from jaxpaged.config import EngineArgs
from jaxpaged.worker.kv_cache import MemoryBudget
from jaxpaged.worker.worker import Worker
from tests.conftest import SMALL_ENGINE

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_worker_start_up_phases_size_allocate_and_reset_the_cache():
    config = EngineArgs(
        dtype="float32", num_gpu_blocks_override=7, swap_space=0.001, **SMALL_ENGINE
    ).create_engine_config()
    worker = Worker(config, show_progress=False)
    worker.load_model()
    assert worker.vocab_size == 512 and worker.dtype == jnp.float32
    spec = worker.kv_cache_spec
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (5, 4, 8)
    assert worker.determine_num_blocks() == 7
    worker.initialize_cache(7)
    assert worker.num_cpu_blocks == int(0.001 * 1024**3) // spec.bytes_per_block
    caches = worker.model_runner.kv_caches
    assert len(caches) == 5
    assert caches[0][0].shape == pallas_kernels.kv_cache_shape(7, 16, 4, 8)
    assert not np.isnan(np.asarray(caches[0][0])).any()
    worker.reset_kv_caches(fill_value=np.nan)
    assert np.isnan(np.asarray(worker.model_runner.kv_caches[-1][1])).all()
    assert "7 blocks of 16 tokens = 112 tokens" in worker.kv_cache_report()


def test_the_engine_asks_its_worker_and_holds_no_device_object(stories_llm):
    engine = stories_llm.llm_engine
    worker = engine.worker
    assert engine.num_blocks == worker.num_gpu_blocks == engine.kv_cache_manager.num_blocks
    assert engine.vocab_size == worker.vocab_size
    assert engine.kv_cache_report() == worker.kv_cache_report()
    for name in ("model_runner", "block_mover", "mesh", "kv_cache_spec", "memory_budget"):
        assert not hasattr(engine, name), name


def test_set_kv_caches_refuses_caches_the_steps_were_not_built_for(stories_llm):
    runner = stories_llm.llm_engine.worker.model_runner
    before = runner.kv_caches
    smaller = [(k[:1], v[:1]) for k, v in before]
    with pytest.raises(ValueError, match="kv_caches must be 5 \\(k, v\\) pairs"):
        runner.set_kv_caches(smaller)
    with pytest.raises(ValueError, match="kv_caches must be"):
        runner.set_kv_caches(before[:-1])
    assert runner.kv_caches is before


def _runner_field_writes(path: pathlib.Path) -> list[str]:
    """Assignments to ``<...>.model_runner.<field>`` in ``path``."""
    writes = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Attribute) and ".model_runner." in ast.unparse(target):
                writes.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(target)}")
    return writes


def test_nothing_outside_the_worker_writes_runner_fields():
    paths = [
        p
        for package in ("jaxpaged", "scripts", "tests")
        for p in sorted((ROOT / package).rglob("*.py"))
        if "jaxpaged/worker/" not in p.as_posix()
    ]
    writes = [w for p in paths for w in _runner_field_writes(p)]
    assert not writes, writes


def test_profiling_frees_the_probe_runner_before_the_cache_is_sized(monkeypatch, tmp_path):
    # Fake memory statistics so that determine_num_blocks profiles (CPU reports none). The
    # probe runner's caches and LogitsState must be gone when it returns, even while Python's
    # cyclic collector does not run on its own: the budget gave their memory to the KV cache.
    config = EngineArgs(
        dtype="float32", compilation_cache_dir=str(tmp_path), **SMALL_ENGINE
    ).create_engine_config()
    worker = Worker(config, show_progress=False)
    worker.load_model()
    budget = MemoryBudget(total=2**30, pool=2**30, requested=2**30, weights=0, peak=0, headroom=0)
    monkeypatch.setattr(worker_module, "bytes_in_use", lambda device: 0)
    monkeypatch.setattr(worker_module, "measure_kv_budget", lambda *args, **kwargs: budget)
    gc.collect()  # earlier tests' cyclic garbage must not count in either sum
    before = sum(x.nbytes for x in jax.live_arrays())
    gc.disable()
    try:
        assert worker.determine_num_blocks() > 0
        after = sum(x.nbytes for x in jax.live_arrays())
    finally:
        gc.enable()
    assert after == before
