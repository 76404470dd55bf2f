"""scripts/trace_summary: step spans, busy time, gaps and categories from a synthetic trace."""

from __future__ import annotations

import gzip
import json

import pytest

from scripts import trace_summary


def _trace() -> list[dict]:
    gpu, host = 7, 1
    meta = [
        {"ph": "M", "pid": gpu, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": host, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": gpu, "tid": 1, "name": "thread_name", "args": {"name": "XLA Modules"}},
        {
            "ph": "M",
            "pid": gpu,
            "tid": 2,
            "name": "thread_name",
            "args": {"name": "Stream #14(Compute)"},
        },
        {"ph": "M", "pid": gpu, "tid": 3, "name": "thread_name", "args": {"name": "XLA Ops"}},
        {"ph": "M", "pid": host, "tid": 9, "name": "thread_name", "args": {"name": "python"}},
    ]

    def x(pid, tid, name, ts, dur, **args):
        return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur, "args": args}

    events = [
        # step 1: [100, 200); kernels overlap at 110-130 and leave gaps.
        x(gpu, 1, "jit__step(1)", 100, 100),
        x(gpu, 2, "gemm_fusion_dot_1", 100, 30, hlo_op="gemm_fusion.1"),
        x(gpu, 2, "loop_fusion_2", 110, 20),
        x(gpu, 2, "paged_attention_kernel", 150, 10, hlo_op="custom-call.3"),
        x(gpu, 2, "memcpy32_post", 190, 5),
        # step 2: [250, 300), a single kernel filling it.
        x(gpu, 1, "jit__step(1)", 250, 50),
        x(gpu, 2, "nvjet_hsh_128x64", 250, 50),
        # derived and host lines are not kernels.
        x(gpu, 3, "gemm_fusion.1", 100, 30),
        x(host, 9, "PjitFunction(_step)", 90, 400),
        # a module of another program is filtered by name.
        x(gpu, 1, "jit_other(2)", 400, 10),
        x(gpu, 2, "loop_fusion_9", 400, 10),
    ]
    return meta + events


def test_steps_split_kernels_by_module_with_busy_time_and_gaps(tmp_path):
    path = tmp_path / "host.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace()}, f)
    steps = trace_summary.gpu_steps(
        trace_summary.load_events(trace_summary.find_trace(tmp_path)), "_step"
    )
    assert [s["kernels"] for s in steps] == [4, 1]
    first, second = steps
    assert first["span_us"] == 100
    assert first["busy_us"] == pytest.approx(30 + 10 + 5)  # 100-130 covered once
    assert first["gap_us"] == pytest.approx(55)
    assert first["by_category"] == {"matmul": 30, "pallas": 10, "fusion": 20, "copy": 5}
    assert second["by_category"]["matmul"] == 50 and second["gap_us"] == 0
    # 50 us of the 200 us from the first start to the last end had no step running.
    assert trace_summary.idle_between_steps(steps) == pytest.approx(50 / 200)


def test_group_steps_medians_and_report():
    steps = trace_summary.gpu_steps(_trace(), "_step") * 3
    rows = trace_summary.group_steps(steps, min_count=3)
    assert [(r["kernels"], r["steps"]) for r in rows] == [(4, 3), (1, 3)]
    assert rows[0]["top_kernels"][0] == ("gemm_fusion_dot_1", 30)
    report = trace_summary.format_report(steps)
    assert "gemm_fusion_dot_1" in report and "kernels/step" in report


def test_find_trace_names_the_directory_when_empty(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        trace_summary.find_trace(tmp_path)


def _stream_only(kernel_names_per_step: list[list[str]], graphs: bool) -> list[dict]:
    """A trace with no XLA Modules line: steps of 10 us kernels, 15 us apart, 100 us apart.

    With ``graphs`` each step's kernels share one CUDA graph launch's ``correlation_id``, and a
    memset launched on its own (its own id) runs 2 us after each step's first kernel.
    """
    events = [
        {"ph": "M", "pid": 3, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {
            "ph": "M",
            "pid": 3,
            "tid": 4,
            "name": "thread_name",
            "args": {"name": "Stream #14(Compute)"},
        },
    ]
    launch = iter(range(1000, 2000))
    for step, names in enumerate(kernel_names_per_step):
        graph = next(launch)
        for i, name in enumerate(names):
            args = {"correlation_id": str(graph if graphs else next(launch))}
            events.append(
                {
                    "ph": "X",
                    "pid": 3,
                    "tid": 4,
                    "name": name,
                    "ts": 100 * step + 15 * i,
                    "dur": 10,
                    "args": args,
                }
            )
        if graphs:
            events.append(
                {
                    "ph": "X",
                    "pid": 3,
                    "tid": 4,
                    "name": "Memset",
                    "ts": 100 * step + 2,
                    "dur": 1,
                    "args": {"correlation_id": str(next(launch))},
                }
            )
    return events


@pytest.mark.parametrize("graphs", [True, False])
def test_steps_without_a_modules_line_by_graph_launch_or_anchor_kernel(graphs):
    per_step = [["embed", "gemm_a", "loop_fusion", "gemm_a", "sample"]] * 4
    steps = trace_summary.gpu_steps(_stream_only(per_step, graphs))
    assert [s["kernels"] for s in steps] == [6 if graphs else 5] * 4
    assert all(s["span_us"] == 70 and s["busy_us"] == 50 for s in steps)
    assert steps[0]["by_category"]["matmul"] == 20
    assert steps[0]["by_category"]["copy"] == (1 if graphs else 0)
    # 30 us between one step's last kernel and the next one's first, three times in 370 us.
    assert trace_summary.idle_between_steps(steps) == pytest.approx(90 / 370)


def test_a_single_step_group_is_reported():
    steps = trace_summary.gpu_steps(_trace(), "_step")
    rows = trace_summary.group_steps(steps)
    assert [(r["kernels"], r["steps"]) for r in rows] == [(4, 1), (1, 1)]


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"\x00\x01 not json", "not a trace-viewer JSON"), (b"{}", "no traceEvents")],
)
def test_bad_trace_files_are_named_in_a_clear_error(tmp_path, content, message):
    path = tmp_path / "x.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        trace_summary.load_events(path)


def test_command_line_errors_name_the_path(tmp_path, capsys):
    with pytest.raises(SystemExit) as missing:
        trace_summary.main([str(tmp_path / "nowhere")])
    assert missing.value.code == 2 and "does not exist" in capsys.readouterr().err
    (tmp_path / "empty.trace.json.gz").write_bytes(gzip.compress(b'{"traceEvents": []}'))
    assert trace_summary.main([str(tmp_path)]) == 0
    assert "no events" in capsys.readouterr().out


def test_idle_between_steps_of_zero_length_steps_is_zero():
    steps = [{"start_us": 5.0, "span_us": 0.0}, {"start_us": 5.0, "span_us": 0.0}]
    assert trace_summary.idle_between_steps(steps) == 0.0
