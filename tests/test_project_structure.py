"""Structural rules of docs/style.md that a reviewer would otherwise check by hand."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("pallas_kernels", "models", "jaxpaged")
# Dependencies point one way: pallas_kernels <- models <- jaxpaged (docs/architecture.md, "Layers").
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
    # transformers imports PyTorch when it is installed: seconds of every restart.
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


# Text a reason outside the repository would be cited by: the steering notes' files and folder,
# the machine's work tree, and the tracker's issue numbers (the word, a space, a number).
# Upstream citations with a "#" ("vLLM PR #27752", "vllm issue #19254") name public sources.
# The patterns are written so that this file does not match them itself.
OUTSIDE_CITATIONS = re.compile(
    r"\b(?:DESIGN|STYLE|COMMON)[.]md\b|[.][.]/shared\b|/work[/]|\bvllm_surface[.]md\b"
    r"|\b[Ii]ssues? +\d"
)
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".yaml", ".yml", ".ipynb", ".cfg", ".conf", ".cmd"}
SKIPPED_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", "node_modules"}


def _project_text_files():
    for path in sorted(ROOT.rglob("*")):
        relative = path.relative_to(ROOT)
        if SKIPPED_DIRS & set(relative.parts) or not path.is_file():
            continue
        if path.suffix not in TEXT_SUFFIXES:
            continue
        # Recorded device output (logs, JSON) quotes the paths of the machine it ran on; the
        # write-ups beside it (README.md) are docs like any other.
        if relative.parts[:2] == ("benchmarks", "results") and path.suffix != ".md":
            continue
        yield path


def test_no_file_cites_a_path_outside_the_repository():
    # A reason lives beside the code or in docs/ (architecture.md, style.md, benchmarks.md):
    # a newcomer with only this tree must be able to follow every citation.
    offenders = []
    for path in _project_text_files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if match := OUTSIDE_CITATIONS.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r}")
    assert not offenders, offenders
