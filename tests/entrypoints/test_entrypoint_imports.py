"""The entry points import one way (``cli`` -> ``openai/api_server`` -> ``openai/multi_api_server``,
all -> ``cli_args``), and every ``jaxpaged`` (sub)command's help names itself."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

from jaxpaged.entrypoints import cli

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENTRYPOINTS = ROOT / "jaxpaged" / "entrypoints"


def _imports(path: pathlib.Path) -> set[str]:
    """Every module ``path`` imports, at any depth (function-level imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_nothing_in_the_package_imports_the_cli():
    importers = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "jaxpaged").rglob("*.py")
        if path != ENTRYPOINTS / "cli.py" and "jaxpaged.entrypoints.cli" in _imports(path)
    ]
    assert importers == []


@pytest.mark.parametrize(
    "module, forbidden",
    [
        ("openai/multi_api_server.py", {"jaxpaged.entrypoints.openai.api_server"}),
        ("cli_args.py", {"jaxpaged.entrypoints.openai.api_server", "jaxpaged.entrypoints.cli"}),
        ("env.py", {"jaxpaged.entrypoints.cli_args", "jaxpaged.entrypoints.cli"}),
    ],
)
def test_lower_entry_modules_do_not_import_higher_ones(module, forbidden):
    assert not _imports(ENTRYPOINTS / module) & forbidden


def test_importing_the_servers_loads_neither_the_cli_nor_a_higher_server():
    code = (
        "import sys\n"
        "import jaxpaged.entrypoints.openai.multi_api_server\n"
        "print('jaxpaged.entrypoints.openai.api_server' in sys.modules)\n"
        "import jaxpaged.entrypoints.openai.api_server\n"
        "print('jaxpaged.entrypoints.cli' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "False"]


def test_bench_help_lists_every_kind(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["bench", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: jaxpaged bench")
    for kind in ("throughput", "latency", "serve", "matrix"):
        assert f"    {kind}" in out


@pytest.mark.parametrize("kind", sorted(cli.BENCHMARKS))
def test_each_bench_usage_line_names_its_command(kind, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["bench", kind, "--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: jaxpaged bench {kind} ")


@pytest.mark.parametrize("command", ["generate", "serve", "convert"])
def test_each_command_usage_line_names_itself(command, capsys):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    assert capsys.readouterr().out.startswith(f"usage: jaxpaged {command} ")


def test_bench_without_a_known_kind_is_a_usage_error(capsys):
    for argv in (["bench"], ["bench", "nonsense"]):
        with pytest.raises(SystemExit) as exited:
            cli.main(argv)
        assert exited.value.code == 2
    assert "invalid choice: 'nonsense'" in capsys.readouterr().err


def test_a_bench_refused_workload_is_one_error_line_and_exit_2(capsys):
    """A prompt longer than the context: one line naming the benchmark, no traceback."""
    code = cli.main(
        ["bench", "throughput", "--input-len", "100", "--output-len", "4", "--num-prompts", "1",
         "--max-model-len", "64", "--dtype", "float32"]
    )  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("jaxpaged bench throughput: error: ")
    assert "Traceback" not in "\n".join(err)
