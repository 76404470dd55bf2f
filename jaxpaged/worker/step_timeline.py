"""When each dispatched step finished on the device, for the device idle fraction.

A watcher thread blocks on each step's output (``block_until_ready`` releases the GIL) and
stamps the moment it is ready. The device can only start step ``k`` once the host has dispatched
it, and only after step ``k - 1`` is done, so its idle time before step ``k`` is at most
``max(0, dispatched[k] - finished[k - 1])``. Summed over steps and divided by the span from the
first dispatch to the last finish, that is an upper bound on the fraction of time the device
waited on the host (the dispatch call may return after the device has already started).
"""

from __future__ import annotations

import queue
import threading
import time

import jax


class StepTimeline:
    """Dispatch and finish times (``time.perf_counter`` seconds) of every step since ``start``."""

    def __init__(self):
        self.dispatch_times: list[float] = []
        self.finish_times: list[float] = []
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def dispatched(self, output: jax.Array) -> None:
        """Record a step just dispatched; ``output`` is one of its on-device results."""
        self.dispatch_times.append(time.perf_counter())
        self._queue.put(output)

    def _watch(self) -> None:
        while True:
            output = self._queue.get()
            if output is None:
                return
            output.block_until_ready()
            self.finish_times.append(time.perf_counter())

    def close(self) -> None:
        """Wait until every recorded step has finished, then stop the watcher."""
        self._queue.put(None)
        self._thread.join()

    def idle_fraction(self) -> tuple[float, float, int]:
        """``(idle upper bound / span, span seconds, steps)``; call after ``close``."""
        n = min(len(self.dispatch_times), len(self.finish_times))
        if n == 0:
            return 0.0, 0.0, 0
        span = self.finish_times[n - 1] - self.dispatch_times[0]
        idle = sum(max(0.0, self.dispatch_times[k] - self.finish_times[k - 1]) for k in range(1, n))
        return idle / span if span > 0 else 0.0, span, n
