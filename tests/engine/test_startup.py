"""Start-up phase timer and the background transformers import."""

from __future__ import annotations

import time

from jaxpaged.engine.startup import StartupTimer, process_start_time


def test_process_start_time_is_before_now():
    start = process_start_time()
    assert start is None or 0 < time.time() - start < 24 * 3600


def test_timer_lists_phases_in_order_with_notes_and_json_keys():
    timer = StartupTimer()
    with timer.phase("config/tokenizer"):
        pass
    timer.add("executables", 1.25, "2 loaded, 0 compiled, 16 loading in the background")
    timer.add("KV allocation", 0.5)
    line = timer.line()
    assert line.index("config/tokenizer") < line.index("executables") < line.index("KV")
    assert "executables 1.2 s (2 loaded, 0 compiled, 16 loading in the background)" in line
    d = timer.as_dict()
    assert d["executables_s"] == 1.25 and d["kv_allocation_s"] == 0.5
    assert {"config_tokenizer_s", "process_start_to_engine_s", "engine_s"} <= set(d)
