"""Benchmarks have two homes: the library in ``jaxpaged/benchmarks/`` and the runnable suites in
``benchmarks/``; ``scripts/`` holds only the tools users run (benchmarks/README.md)."""

from __future__ import annotations

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
USER_TOOLS = {"__init__", "launch_replicas", "profile_step", "profile_host_step", "trace_summary",
              "trace_request_life", "bucket_memory"}  # fmt: skip


def test_scripts_holds_only_the_tools_users_run():
    assert {path.stem for path in (ROOT / "scripts").glob("*.py")} == USER_TOOLS


def test_every_script_and_suite_path_named_in_the_tree_exists():
    """No doc, test, suite or docstring points at a benchmark that moved or left (the raw logs
    of past runs under benchmarks/results keep the paths of their day; ``benchmarks/
    benchmark_*.py`` and lines naming vLLM are vLLM's tree)."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()  # fmt: skip
    pattern = re.compile(r"(?<![\w/.])((?:scripts|benchmarks)/[\w/]+\.(?:py|sh))\b")
    missing = set()
    for name in files:
        if name.startswith("benchmarks/results/") or not name.endswith((".py", ".md", ".sh")):
            continue
        for line in (ROOT / name).read_text(errors="replace").splitlines():
            for path in pattern.findall(line):
                vllms = "vLLM" in line or path.startswith("benchmarks/benchmark_")
                if not vllms and not (ROOT / path).exists():
                    missing.add(f"{name}: {path}")
    # docs/benchmarks.md's history names the quantized-linear script it says was removed.
    missing = {m for m in missing if "benchmark_quantized_linear.py" not in m}
    assert not missing, sorted(missing)


def test_no_benchmark_program_passes_the_size_limit():
    too_long = [f"{p.relative_to(ROOT)}: {n}" for p in sorted((ROOT / "benchmarks").rglob("*.py"))
                if (n := len(p.read_text().splitlines())) > 1000]  # fmt: skip
    assert not too_long, too_long
