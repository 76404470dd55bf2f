"""ExecutableTable: each key got once, on whichever thread asks first; background loading."""

from __future__ import annotations

import threading
import time

import pytest

from jaxpaged.worker.executables import ExecutableTable


class SlowCompiler:
    """``compile_fn`` that takes ``seconds`` and records which keys it got, on which thread."""

    def __init__(self, seconds: float = 0.05, fail: set | None = None):
        self.seconds, self.fail = seconds, fail or set()
        self.calls: list = []
        self._lock = threading.Lock()

    def __call__(self, key):
        with self._lock:
            self.calls.append((key, threading.current_thread().name))
        time.sleep(self.seconds)
        if key in self.fail:
            raise RuntimeError(f"cannot compile {key}")
        return f"exe-{key}"


def test_concurrent_askers_get_one_compilation():
    compiler = SlowCompiler(0.2)
    table = ExecutableTable(compiler)
    results = []
    threads = [threading.Thread(target=lambda: results.append(table.get("a"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == ["exe-a"] * 4
    assert [key for key, _ in compiler.calls] == ["a"]
    assert table.num_compilations == 1 and "a" in table


def test_background_loads_every_key_and_a_step_takes_an_unreached_key_itself():
    compiler = SlowCompiler(0.1)
    table = ExecutableTable(compiler)
    table.load_in_background(["a", "b", "c", "d"])
    assert table.get("d") == "exe-d"  # not reached yet: got here, and skipped by the thread
    table.wait()
    assert table.background_left == 0
    assert sorted(key for key, _ in compiler.calls) == ["a", "b", "c", "d"]  # once each
    assert dict(compiler.calls)["d"] == threading.current_thread().name
    assert set(table.compiled) == {"a", "b", "c", "d"}


def test_a_failed_background_key_is_left_for_the_step_to_retry_and_see():
    compiler = SlowCompiler(0.01, fail={"b"})
    table = ExecutableTable(compiler)
    table.load_in_background(["a", "b", "c"])
    table.wait()
    assert set(table.compiled) == {"a", "c"}
    with pytest.raises(RuntimeError, match="cannot compile b"):
        table.get("b")
    compiler.fail.clear()
    assert table.get("b") == "exe-b"


def test_load_in_background_twice_is_refused():
    table = ExecutableTable(SlowCompiler(0.0))
    table.load_in_background([])
    with pytest.raises(RuntimeError, match="already"):
        table.load_in_background([])
