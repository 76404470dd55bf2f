"""One model over two processes: the multi-host recipe, run as two CPU processes on loopback.

Each process is ``jaxpaged generate`` with ``--nnodes 2 --node-rank i`` and one CPU device
(``--xla_force_host_platform_device_count=1``); ``--tensor-parallel-size 2`` makes one mesh over
both processes' devices, so every layer's all-reduce crosses processes (gloo, JAX's CPU
collectives). The reference is ``golden.json`` (HF transformers greedy), which the one-process
engine reproduces in ``tests/entrypoints/test_llm.py``.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import pytest

from jaxpaged.config import EngineArgs, ParallelConfig
from tests.conftest import SMALL_ENGINE

REPO = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine_flags() -> list[str]:
    flags = ["--dtype", "float32"]
    for name, value in SMALL_ENGINE.items():
        flags += ["--" + name.replace("_", "-"), str(value)]
    return flags


def test_two_processes_run_one_model_and_only_rank_0_prints(golden):
    cases = [c for c in golden["cases"] if c["prompt"]]
    port = _free_port()
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=1",
        PYTHONPATH=str(REPO),
    )
    procs = []
    for rank in (0, 1):
        command = [
            sys.executable, "-m", "jaxpaged.entrypoints.cli", "generate",
            *[c["prompt"] for c in cases],
            "--max-tokens", str(golden["max_new_tokens"]),
            "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", str(rank),
            "--master-addr", "127.0.0.1", "--master-port", str(port),
            *_engine_flags(),
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(
                command,
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
            results.append((proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for rank, (returncode, _, stderr) in enumerate(results):
        assert returncode == 0, f"rank {rank} failed:\n{stderr[-4000:]}"

    (_, out0, _), (_, out1, err1) = results
    expected = "".join(f"{c['prompt']}{c['new_text']}\n\n" for c in cases)
    assert _without_gloo_lines(out0) == expected
    assert _without_gloo_lines(out1) == ""
    assert "tokens/s" not in err1


def _without_gloo_lines(stdout: str) -> str:
    # gloo's C++ side writes "[Gloo] Rank i is connected to 1 peer ranks..." to stdout itself.
    return "".join(
        line for line in stdout.splitlines(keepends=True) if not line.startswith("[Gloo]")
    )


def test_multi_host_flags_are_validated():
    with pytest.raises(ValueError, match=r"node_rank must be in \[0, nnodes\) = \[0, 2\), got 2"):
        EngineArgs(nnodes=2, node_rank=2, tensor_parallel_size=2).create_engine_config()
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(1\) must be at least nnodes"):
        EngineArgs(nnodes=2).create_engine_config()
    with pytest.raises(ValueError, match="nnodes must be at least 1, got 0"):
        EngineArgs(nnodes=0).create_engine_config()
    with pytest.raises(ValueError, match="master_port must be in"):
        EngineArgs(master_port=70000).create_engine_config()
    config = EngineArgs(
        nnodes=2, node_rank=1, tensor_parallel_size=2, master_addr="10.0.0.1", master_port=1234
    ).create_engine_config()
    assert config.parallel_config == ParallelConfig(2, 2, 1, "10.0.0.1", 1234)
    assert config.parallel_config.coordinator_address == "10.0.0.1:1234"
