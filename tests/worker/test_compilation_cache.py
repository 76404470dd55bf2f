"""The persistent compilation cache: a restart compiles nothing and a changed config recompiles."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from jaxpaged.worker.compilation_cache import CompileCounter, cache_subdir

PROBE = pathlib.Path(__file__).with_name("compile_cache_probe.py")
ROOT = PROBE.parents[2]


def _probe(cache_dir, *max_num_seqs: int) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, str(PROBE), str(cache_dir), *map(str, max_num_seqs)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_restart_compiles_nothing_and_a_changed_config_recompiles(tmp_path):
    # One fresh process builds the same engine twice, then a changed one; jax.clear_caches()
    # between builds drops the in-memory executables, so each build reads only the disk cache.
    cold, warm, changed = _probe(tmp_path, 2, 2, 1)
    assert cold["cache_hits"] == 0 and cold["compiled"] >= cold["buckets"]
    # The engine was the process's first JAX user, so it set the pool from
    # gpu_memory_utilization (memory_pool.py); the CPU client ignores the option.
    assert cold["started_before"] is False
    assert cold["client_options"] == {"memory_fraction": 0.7}
    assert warm["compiled"] == 0, warm  # a restart loads every executable from disk
    # the cold start compiled every bucket before it returned; the warm one got the first
    # steps' buckets and left the others to its background thread
    assert cold["deferred"] == 0
    assert 0 < warm["deferred"] < warm["buckets"]
    assert warm["startup"]["executables_s"] < cold["startup"]["executables_s"]
    assert warm["cache_hits"] == warm["requests"] == cold["requests"]
    assert warm["tokens"] == cold["tokens"]
    # max_num_seqs changes the step's shapes: its buckets are new keys, compiled, not reused
    assert changed["compiled"] >= changed["buckets"], changed
    assert changed["tokens"] == cold["tokens"]
    # every step bucket of both configs was stored, under its own key
    after = list(pathlib.Path(cold["cache_dir"]).glob("jit_step_segment-*"))
    assert len(after) == cold["buckets"] + changed["buckets"]


def test_cache_subdir_names_jax_version_platform_and_device_kind():
    assert cache_subdir("gpu", "NVIDIA H200", "0.11.2") == os.path.join(
        "jax-0.11.2", "gpu-nvidia_h200"
    )
    assert cache_subdir("cpu", "", "0.11.2").endswith("cpu-unknown")


def test_compile_counter_counts_only_real_compilations():
    import jax
    import jax.numpy as jnp

    # A constant of this run's own: an engine built earlier in this process may have turned the
    # persistent cache on, and a fixed program could then be a disk hit from an earlier run.
    unique = float(int.from_bytes(os.urandom(4), "little"))

    @jax.jit
    def f(x):
        return x * 3 + unique

    x, y = jnp.ones(7), jnp.ones(9)
    with CompileCounter() as counter:
        f(x).block_until_ready()
        f(x).block_until_ready()  # in-memory hit: no request
    assert counter.compiled == counter.requests == 1
    f(y)  # outside the context: not counted
    assert counter.requests == 1


def test_engine_args_turn_the_cache_off_and_name_its_dir(stories_dir):
    from jaxpaged.config import EngineArgs

    config = EngineArgs(
        model=stories_dir, enable_compilation_cache=False, compilation_cache_dir="/x"
    ).create_engine_config()
    assert config.enable_compilation_cache is False
    assert config.compilation_cache_dir == "/x"
