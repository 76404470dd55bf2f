"""``jaxpaged bench matrix`` end to end on a few stories260k rows, and its comparison rule."""

from __future__ import annotations

import json
import math

import pytest

from jaxpaged.benchmarks import matrix
from jaxpaged.benchmarks.matrix import Completion, compare
from jaxpaged.entrypoints import cli


def _c(tokens, logprobs=None):
    return Completion(tokens, logprobs, None)


def test_compare_accepts_equal_tokens_within_tolerance():
    a = [[_c([5, 6], [{5: -1.0, 7: -2.0}, {6: -0.5}])]]
    b = [[_c([5, 6], [{5: -1.05, 7: -2.0}, {6: -0.52}])]]
    ok, worst, note = compare(a, b, 0.1)
    assert ok and worst == pytest.approx(0.05) and note == ""
    ok, worst, note = compare(a, b, 0.01)
    assert not ok and "max |delta logprob|" in note


def test_compare_accepts_a_near_tie_and_stops_there():
    a = [[_c([5, 9, 1], [{5: -1.0}, {9: -1.00, 8: -1.01}, {1: -3.0}])]]
    b = [[_c([5, 8, 2], [{5: -1.0}, {8: -1.00, 9: -1.02}, {2: -0.1}])]]
    ok, _, note = compare(a, b, 0.05)
    assert ok and "near-tie at request 0.0 token 1" in note


def test_compare_refuses_a_token_outside_the_other_top_k():
    a = [[_c([5, 9], [{5: -1.0}, {9: -1.0}])]]
    b = [[_c([5, 8], [{5: -1.0}, {8: -0.1, 7: -3.0}])]]
    ok, _, note = compare(a, b, 0.05)
    assert not ok and "token 1 is 9, reference 8" in note
    ok, _, _ = compare([[_c([1, 2])]], [[_c([1, 3])]], 1.0)  # tokens only (golden)
    assert not ok
    ok, worst, _ = compare([[_c([1]), _c([2])]], [[_c([1])]], 1.0)
    assert not ok and math.isinf(worst)


def test_compare_refuses_a_nan_logprob():
    a = [[_c([5], [{5: float("nan")}])]]
    ok, worst, note = compare(a, [[_c([5], [{5: -1.0}])]], 1.0)
    assert not ok and math.isinf(worst) and "NaN" in note


def test_patched_restores_the_constant():
    import models.lora

    before = models.lora.LORA_FOLD
    with pytest.raises(RuntimeError), matrix.patched({"models.lora:LORA_FOLD": not before}):
        assert models.lora.LORA_FOLD is (not before)
        raise RuntimeError
    assert models.lora.LORA_FOLD is before


def test_matrix_runs_rows_end_to_end(tmp_path, capsys):
    out = tmp_path / "matrix.json"
    status = cli.main([
        "bench", "matrix", "--only", "stories-f32-auto", "stories-f32-reference-golden",
        "--out", str(out), "--no-tqdm",
    ])  # fmt: skip
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    rows = {r["name"]: r for r in report["rows"]}
    # On CPU "auto" is the reference backend: the harness (two engines, two passes each, the
    # comparison, the golden tokens, the table and the JSON) is what runs here.
    assert set(rows) == {"stories-f32-auto", "stories-f32-reference-golden"}
    for record in rows.values():
        assert record["compiled"] == "ok" and record["matches"] is True, record
        assert record["startup_s"] > 0 and record["step_ms"] > 0
    assert rows["stories-f32-auto"]["max_abs_dlogprob"] <= 2e-3
    assert status == 0
    assert "stories-f32-auto" in printed and "failing: none" in printed
    assert report["platform"] == "cpu" and report["rows"][0]["tolerance"] == 2e-3


def test_a_failing_row_is_recorded_and_the_walk_goes_on(tmp_path, monkeypatch):
    from jaxpaged.benchmarks.matrix_rows import MatrixRow

    rows = (
        MatrixRow("broken", "stories260k", {"dtype": "float32", "block_size": 7}),
        MatrixRow("structured", "stories260k", {"dtype": "float32"}, workload="structured_outputs"),
    )
    monkeypatch.setattr(matrix, "ROWS", rows)
    monkeypatch.setattr(matrix, "structured_outputs_params", lambda: None)
    out = tmp_path / "m.json"
    assert matrix.main(["--out", str(out), "--no-tqdm"]) == 1
    broken, structured = json.loads(out.read_text())["rows"]
    assert broken["compiled"] == "error"
    assert broken["note"].startswith("ValueError: block_size must be one of")
    assert structured["compiled"] == "skipped" and "not built yet" in structured["note"]


def test_only_that_matches_nothing_is_an_error(capsys):
    assert matrix.main(["--only", "no-such-row"]) == 2
    assert "matches no row" in capsys.readouterr().err


def test_resume_keeps_the_rows_done_and_runs_the_others(tmp_path, monkeypatch):
    from jaxpaged.benchmarks.matrix_rows import MatrixRow

    rows = (
        MatrixRow("done", "stories260k", {"dtype": "float32"}),
        MatrixRow("left", "stories260k", {"dtype": "float32", "block_size": 7}),
    )
    monkeypatch.setattr(matrix, "ROWS", rows)
    out = tmp_path / "m.json"
    out.write_text(json.dumps({"rows": [{"name": "done", "compiled": "ok", "matches": True}]}))
    assert matrix.main(["--out", str(out), "--no-tqdm", "--resume"]) == 1  # "left" fails
    names = [r["name"] for r in json.loads(out.read_text())["rows"]]
    assert names == ["done", "left"]
    assert matrix.main(["--out", str(tmp_path / "none.json"), "--resume"]) == 2
