"""benchmarks/gpu.sh's driver (benchmarks/lib/gpu_run.py): step lists, resuming an earlier
call, the matrix's rows across calls, time boxes. ``bash benchmarks/gpu.sh --smoke`` runs every
step end to end on CPU (about 4 minutes): too slow for the suite, so these check the logic."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_run():
    spec = importlib.util.spec_from_file_location("gpu_run", ROOT / "benchmarks/lib/gpu_run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_the_script_lists_every_step_once_in_priority_order(gpu_run):
    text = (ROOT / "benchmarks/gpu.sh").read_text()
    default = text.split('STEPS=${STEPS:-"', 1)[1].split('"', 1)[0]
    steps = gpu_run.parse_steps(default)
    assert [s.name for s in steps] == list(gpu_run.KNOWN_STEPS)
    assert steps[0].name == "bf16" and steps[-1].box_s is None  # the matrix takes the rest
    # Every step but the open-ended matrix fits one call's deadline together with bf16.
    deadline = float(text.split("DEADLINE_S=${DEADLINE_S:-", 1)[1].split("}", 1)[0])
    assert all(steps[0].box_s + s.box_s < deadline for s in steps[1:-1])


@pytest.mark.parametrize(
    "spec,match",
    [("bf16:200 nope:10", "unknown step 'nope'"), ("bf16:200 bf16:10", "listed twice"),
     ("bf16:0", "box must be"), ("bf16:abc", "box must be")],
)  # fmt: skip
def test_bad_step_lists_name_the_step(gpu_run, spec, match):
    with pytest.raises(ValueError, match=match):
        gpu_run.parse_steps(spec)


def _step(status, device="NVIDIA H100 80GB HBM3", **extra):
    return dict(status=status, device=device, smoke=False, tree="abc", date="2026-12-08", **extra)


def test_resume_keeps_ok_steps_of_the_device_runs_new_steps_then_failed_ones_then_the_rest(
    gpu_run,
):
    previous = {
        "schema": gpu_run.SCHEMA,
        "steps": {
            "bf16": _step("ok", result={"random": {}}),
            "fp8": _step("timeout"),
            "int8": _step("ok", device="NVIDIA H200"),  # another card: measured again
            "awq": _step("deferred"),
            "matrix": _step("timeout", result={"rows": [{"name": "a"}]}),
        },
    }
    kept = gpu_run.carried_steps(previous, "NVIDIA H100 80GB HBM3", smoke=False)
    assert sorted(kept) == ["bf16", "matrix"]
    steps = gpu_run.parse_steps("bf16:200 fp8:150 int8:150 awq:120 gptq:120 matrix:rest")
    order = [s.name for s in gpu_run.order(steps, previous, kept)]
    assert order == ["int8", "awq", "gptq", "fp8", "matrix"]
    assert gpu_run.carried_steps(previous, "NVIDIA H100 80GB HBM3", smoke=True) == {}
    assert gpu_run.carried_steps({"schema": "other"}, "x", smoke=False) == {}


def test_the_matrix_runs_only_the_rows_an_earlier_call_did_not_finish(gpu_run):
    killed = {"name": "c", "compiled": "error", "note": "worker exited with status -15 before"}
    kept = {"matrix": {"result": {"rows": [{"name": "a", "compiled": "yes"}, killed]}}}
    assert gpu_run.matrix_rows_left(kept, ["a", "b", "c"]) == ["b", "c"]
    assert gpu_run.matrix_rows_left({}, ["a", "b"]) is None  # nothing kept: every row
    assert gpu_run.matrix_rows_left(kept, None) is None  # names unknown: every row
    merged = gpu_run.merge_matrix(kept["matrix"], {"rows": [{"name": "b"}, {"name": "c"}]})
    assert [r["name"] for r in merged["rows"]] == ["a", "b", "c"]
    assert merged["rows"][2] == {"name": "c"}  # the new record, not the killed worker's


def test_a_matrix_stopped_before_merging_keeps_its_workers_rows(gpu_run, tmp_path):
    out = tmp_path / "matrix.json"
    assert gpu_run.matrix_rows_so_far(out) is None
    for k, names in enumerate((["a", "b"], ["c"])):
        part = {"device": "gpu", "rows": [{"name": n} for n in names]}
        pathlib.Path(f"{out}.shard{k}").write_text(json.dumps(part))
    merged = gpu_run.matrix_rows_so_far(out)
    assert merged["device"] == "gpu" and [r["name"] for r in merged["rows"]] == ["a", "b", "c"]
    out.write_text(json.dumps({"rows": [{"name": "z"}]}))  # the parent's merge wins
    assert [r["name"] for r in gpu_run.matrix_rows_so_far(out)["rows"]] == ["z"]


def test_a_step_past_its_box_is_stopped_with_its_children(gpu_run, tmp_path):
    marker = tmp_path / "child.pid"
    # A parent that starts a child in its process group, then both sleep past the box.
    code = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(marker)!r}, 'w').write(str(p.pid))\n"
        "def waiting_past_the_box():\n    time.sleep(60)\n"
        "waiting_past_the_box()\n"
    )
    start = time.time()
    env = {"PYTHONFAULTHANDLER": "1"}
    status, _ = gpu_run.run_process([sys.executable, "-c", code], env, 3, tmp_path / "log")
    assert status == "timeout" and time.time() - start < 30
    log = (tmp_path / "log").read_text()  # where it was when stopped: every thread's stack
    assert "Fatal Python error: Aborted" in log and "in waiting_past_the_box" in log
    child = int(marker.read_text())
    with pytest.raises(ProcessLookupError):
        import os

        for _ in range(50):  # the child may take a moment to be reaped by init
            os.kill(child, 0)
            time.sleep(0.1)
    status, rc = gpu_run.run_process([sys.executable, "-c", "raise SystemExit(3)"], {}, 30,
                                     tmp_path / "log2")  # fmt: skip
    assert (status, rc) == ("failed", 3)
    assert (tmp_path / "log2").read_text().startswith("$ ")


def test_save_turns_each_steps_json_into_figures_with_its_tree_date_and_device(gpu_run, tmp_path):
    suite = {
        "args": {"num_prompts": 1000, "input_len": 128, "output_len": 128,
                 "latency_input_len": 128, "latency_output_len": 128},
        "random": {"output_tokens_per_second": 16398.4},
        "latency": {"avg_tpot_seconds": 0.00566},
        "startup_seconds": 98.04,
    }  # fmt: skip
    results = {
        "source": "benchmarks/gpu.sh",
        "steps": {
            "bf16": _step("ok", result=suite),
            "fp8": _step("timeout", seconds=150.2, result=None),
        },
    }
    gpu_run.save(tmp_path, results)
    saved = json.loads((tmp_path / "results.json").read_text())
    by_measure = {(f["configuration"], f["measure"]): f for f in saved["figures"]}
    toks = by_measure["bf16", "output tok/s, 1000 x 128/128"]
    assert (toks["value"], toks["device"], toks["tree"], toks["date"]) == (
        16398, "NVIDIA H100 80GB HBM3", "abc", "2026-12-08")  # fmt: skip
    assert by_measure["bf16", "batch-1 TPOT, 128/128"]["value"] == 5.66
    fp8 = by_measure["FP8 W8A8 (online) + FP8 KV cache", "start-up, engine built"]
    assert fp8["value"] == "not built in 150 s (timeout)"
    assert "bf16" in gpu_run.table(saved) and "16398" in gpu_run.table(saved)


def test_a_calls_results_json_is_a_figure_file_the_page_renders(gpu_run, tmp_path):
    from jaxpaged.benchmarks.figures import load_file

    suite = {"args": {"num_prompts": 8, "input_len": 16, "output_len": 8},
             "random": {"output_tokens_per_second": 123.0}}  # fmt: skip
    gpu_run.save(
        tmp_path, {"source": "benchmarks/gpu.sh", "steps": {"bf16": _step("ok", result=suite)}}
    )
    (figure,) = load_file(tmp_path / "results.json")
    assert figure["source"] == "benchmarks/gpu.sh (ok)" and figure["value"] == 123
