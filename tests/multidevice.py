"""Run a check script in a fresh Python process that sees ``N`` CPU devices.

JAX fixes its device count when its backend starts, so multi-device checks (tensor parallelism,
sharded restores) run in a subprocess with ``--xla_force_host_platform_device_count``.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def run_on_cpu_devices(args: list[str], num_devices: int, *, timeout: int = 600) -> str:
    """``python *args`` from the repository root on ``num_devices`` CPU devices.

    Returns the tail of its stdout and stderr (the report a failing assertion shows).

    Raises:
        AssertionError: the process exited non-zero (its report is the message).
        subprocess.TimeoutExpired: it ran longer than ``timeout`` seconds.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(REPO),
        XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={num_devices}".strip(),
    )
    proc = subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    report = proc.stdout[-8000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, report
    return report
