"""Structural rules from STYLE.md that a reviewer would otherwise check by hand."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("pallas_kernels", "models", "jaxpaged")
# Dependencies point one way: pallas_kernels <- models <- jaxpaged (DESIGN.md §1).
FORBIDDEN_IMPORTS = {
    "pallas_kernels": ("models", "jaxpaged", "flax"),
    "models": ("jaxpaged",),
    "jaxpaged/core": ("jax", "jaxlib", "flax", "models", "pallas_kernels"),
}
MAX_LINES = 1000


def _python_files(package: str):
    return sorted((ROOT / package).rglob("*.py"))


def _imported_modules(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN_IMPORTS))
def test_imports_point_one_way(package):
    offenders = []
    for path in _python_files(package):
        for module in _imported_modules(path):
            top = module.split(".")[0]
            if top in FORBIDDEN_IMPORTS[package]:
                offenders.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not offenders, offenders


@pytest.mark.parametrize("package", [*PACKAGES, "scripts", "tests"])
def test_no_module_passes_the_size_limit(package):
    too_long = [
        f"{path.relative_to(ROOT)}: {n} lines"
        for path in _python_files(package)
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    ]
    assert not too_long, too_long


def test_only_the_env_module_reads_the_environment():
    readers = [
        str(path.relative_to(ROOT))
        for package in PACKAGES
        for path in _python_files(package)
        if "os.environ" in path.read_text() or "os.getenv" in path.read_text()
    ]
    assert set(readers) <= {"jaxpaged/entrypoints/env.py"}, readers


def test_importing_the_offline_api_imports_neither_transformers_nor_torch():
    # transformers imports PyTorch when it is installed: seconds of every restart (issue 18).
    import subprocess
    import sys

    code = (
        "import sys; from jaxpaged import LLM, SamplingParams, EngineArgs; "
        "print(sorted(m for m in ('transformers', 'torch') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
