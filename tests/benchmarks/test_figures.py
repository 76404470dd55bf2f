"""docs/benchmarks.md's current tables come from the figure files (jaxpaged.benchmarks.figures,
benchmarks/render.py): the page must equal their rendering, and each figure names its tree,
date, device and source."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import pytest

from jaxpaged.benchmarks.figures import current, format_value, load_file, render

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def render_script():
    spec = importlib.util.spec_from_file_location("render", ROOT / "benchmarks/render.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_the_page_holds_exactly_the_rendering_of_the_committed_figures(render_script):
    page = render_script.DOC.read_text()
    assert render_script.current_block(page) == render_script.rendered(), (
        "docs/benchmarks.md disagrees with benchmarks/results/figures/: "
        "run python benchmarks/render.py --write"
    )
    assert render_script.main(["--check"]) == 0


def test_check_fails_on_a_page_edited_by_hand(render_script, tmp_path, monkeypatch):
    page = render_script.DOC.read_text()
    edited = page.replace("16,398 tok/s", "17,000 tok/s", 1)
    assert edited != page
    doc = tmp_path / "benchmarks.md"
    doc.write_text(edited)
    monkeypatch.setattr(render_script, "DOC", doc)
    assert render_script.main(["--check"]) == 1
    assert render_script.main(["--write"]) == 0
    assert doc.read_text() == page


def test_every_committed_figure_has_its_tree_date_device_and_source(render_script):
    files = render_script.figure_files()
    assert files, "no figure files"
    for path in files:
        for figure in load_file(path):
            assert len(figure["date"]) == 10 and figure["date"][4] == "-", (path, figure)
            assert figure["tree"] and figure["device"] and figure["source"], (path, figure)


def _write(path, figures, **top):
    path.write_text(json.dumps({"figures": figures, **top}))
    return path


def test_a_figure_without_its_device_is_refused_naming_file_and_figure(tmp_path):
    path = _write(tmp_path / "f.json", [dict(group="g", configuration="bf16", measure="tok/s",
                                             value=1, tree="abc", date="2026-12-08")],
                  source="me")  # fmt: skip
    with pytest.raises(
        ValueError, match=r"f\.json: figure 0 \('bf16', 'tok/s'\): missing \['device'\]"
    ):
        load_file(path)
    _write(path, [dict(group="g", configuration="c", measure="m", value=1, tree="t",
                       date="2026-12-08", device="d", source="s", colour="red")])  # fmt: skip
    with pytest.raises(ValueError, match=r"unknown keys \['colour'\]"):
        load_file(path)


def test_the_latest_figure_per_device_wins_and_the_defaults_fill_each_figure(tmp_path):
    base = dict(group="engine", configuration="bf16", measure="tok/s", unit="tok/s")
    h100 = dict(date="2026-12-05", device="H100")
    old = _write(tmp_path / "a.json", [dict(base, value=100, date="2026-12-01"),
                                        dict(base, value=7, device="H200")],
                 source="old", defaults=dict(h100, tree="t1"))  # fmt: skip
    new = _write(tmp_path / "b.json", [dict(base, value=200),
                                        dict(base, value=300, date="2026-12-01")],
                 source="new", defaults=dict(h100, tree="t2"))  # fmt: skip
    figures = load_file(old) + load_file(new)
    chosen = current(figures)
    assert [(f["value"], f["device"], f["tree"]) for f in chosen] == [
        (200, "H100", "t2"),
        (7, "H200", "t1"),
    ]
    table = render(figures)
    assert "| bf16 | tok/s | 200 tok/s |  | H100 | `t2` | 2026-12-05 | [1] |" in table
    assert "[1] new" in table and "[2] old" in table


@pytest.mark.parametrize(
    "value,unit,text",
    [(16398, "tok/s", "16,398 tok/s"), (16398.4, "tok/s", "16,398 tok/s"), (5.66, "ms", "5.66 ms"),
     (0.0004, "s", "0.0004 s"), (0.6, "x", "0.60x"), (13.0, "%", "+13.0%"), ("n/a", "ms", "n/a")],
)  # fmt: skip
def test_values_keep_their_digits_and_units(value, unit, text):
    assert format_value(value, unit) == text
