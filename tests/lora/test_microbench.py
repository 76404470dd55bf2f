"""``benchmarks/lora_layer.py`` runs with ``--small`` (the GPU run is the lead's)."""

from __future__ import annotations

import importlib.util
import pathlib

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks/lora_layer.py"


def test_microbench_small_runs_every_path_and_prints_the_table(capsys):
    spec = importlib.util.spec_from_file_location("lora_microbench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # One T (each costs ~6 compilations on CPU); the paths must agree there (checked inside).
    argv = ["--small", "--tokens", "3", "--iters", "2", "--reps", "1", "--dtype", "float32",
            "--kernels"]  # fmt: skip
    rows = module.main(argv)
    assert [row["tokens"] for row in rows] == [3]
    for row in rows:
        assert all(row[v] > 0 for v in ("base", "dense", "gather", "bgmv", "fold"))
        # The fold layout's point: fewer kernels than the dense path (CPU HLO as a proxy), and
        # every LoRA variant launches more than the base layer.
        assert row["base kernels"] < row["fold kernels"] < row["dense kernels"]
    table = capsys.readouterr().out.splitlines()
    assert table[-5].split()[:2] == ["T", "base"]
    assert table[-4].split()[0] == "3"
    assert table[-2].split() == ["T", "base", "dense", "gather", "bgmv", "fold"]
    assert table[-1].split()[0] == "3"
