"""scripts/profile_step.py: a traced window of a workload's steps on a tiny config-only model."""

from __future__ import annotations

import json

import pytest

from scripts import profile_step
from tests.benchmarks.test_suites import ENGINE_FLAGS, TINY_CONFIG


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    (path / "config.json").write_text(json.dumps(TINY_CONFIG))
    return str(path)


def test_profile_step_traces_a_window_and_refuses_one_the_run_never_reaches(
    tiny_model, tmp_path, capsys
):
    trace_dir = tmp_path / "trace"
    flags = [
        "--model",
        tiny_model,
        *ENGINE_FLAGS,
        "--workload",
        "latency",
        "--input-len",
        "8",
        "--output-len",
        "6",
        "--latency-iters",
        "1",
        "--trace-dir",
        str(trace_dir),
    ]
    out = tmp_path / "profile.json"
    assert profile_step.main([*flags, "--trace-steps", "2", "--output-json", str(out)]) == 0
    first = json.loads(out.read_text())["trace"]
    assert first.endswith(".trace.json.gz") and str(trace_dir) in first
    # A window past the run's last step traces nothing: an error, not the earlier trace.
    with pytest.raises(RuntimeError, match="--trace-start 50 was never reached"):
        profile_step.main([*flags, "--trace-start", "50"])
    with pytest.raises(SystemExit):
        profile_step.main([*flags, "--trace-steps", "0"])
    assert "--trace-steps >= 1" in capsys.readouterr().err
