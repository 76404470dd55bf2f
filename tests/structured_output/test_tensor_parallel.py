"""Structured outputs under tensor parallelism (two CPU devices, in a subprocess)."""

from __future__ import annotations

import pathlib

import pytest

from tests.multidevice import run_on_cpu_devices

HERE = pathlib.Path(__file__).resolve().parent


def test_tp2_constrained_outputs_validate_and_equal_tp1():
    pytest.importorskip("xgrammar")
    report = run_on_cpu_devices([str(HERE / "multidevice_structured_checks.py")], 2)
    assert "tp=2: constrained greedy outputs validate and equal tp=1's" in report, report
    assert "ALL OK" in report, report
