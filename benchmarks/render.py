"""docs/benchmarks.md's current tables, rendered from the figure files under
benchmarks/results/figures/ (``jaxpaged.benchmarks.figures``: each figure with its tree, date,
device and source; the latest per configuration, measure and device).

    python benchmarks/render.py            # print the tables
    python benchmarks/render.py --write    # put them into docs/benchmarks.md between its markers
    python benchmarks/render.py --check    # exit 1 when docs/benchmarks.md differs from the files

A GPU call's ``results.json`` (``benchmarks/gpu.sh``) is a figure file: commit it into
benchmarks/results/figures/ as ``<date>-<device>-<tree>.json`` and run ``--write``. Files are
read in name order; on the same date a later file's figure wins.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxpaged.benchmarks.figures import load_figures, render  # noqa: E402

FIGURES_DIR = ROOT / "benchmarks" / "results" / "figures"
DOC = ROOT / "docs" / "benchmarks.md"
BEGIN = "<!-- figures: begin (rendered by `python benchmarks/render.py --write`; edit the JSON) -->"
END = "<!-- figures: end -->"


def figure_files(directory: pathlib.Path = FIGURES_DIR) -> list[pathlib.Path]:
    return sorted(directory.glob("*.json"))


def rendered(directory: pathlib.Path = FIGURES_DIR) -> str:
    return render(load_figures(figure_files(directory)))


def replace_block(text: str, tables: str) -> str:
    """``text`` with the part between :data:`BEGIN` and :data:`END` replaced by ``tables``.

    Raises:
        ValueError: the markers are missing, repeated or out of order.
    """
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{DOC.name} must hold one {BEGIN!r} before one {END!r}")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{tables}{END}{tail}"


def current_block(text: str) -> str:
    """What the page holds between the markers."""
    return text.split(BEGIN, 1)[1].split(END, 1)[0].removeprefix("\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    mode.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = parser.parse_args(argv)
    tables = rendered()
    text = DOC.read_text()
    if args.write:
        DOC.write_text(replace_block(text, tables))
    elif args.check:
        if current_block(text) != tables:
            print(f"{DOC} is stale: run python benchmarks/render.py --write", file=sys.stderr)
            return 1
    else:
        print(tables, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
