"""A worker whose device takes a fixed time per step, for tests of when the core schedules.

``SlowDevice`` wraps a real ``Worker`` (stories260k on the CPU runs a step in about a
millisecond): each step begins once its sampling is launched and the previous step is done, and
its tokens are ready ``step_s`` seconds later; ``is_ready``, ``wait`` and ``collect``
follow that clock. It records every step's sequence ids and simulated start and end.
"""

from __future__ import annotations

import dataclasses
import time


@dataclasses.dataclass
class SimulatedStep:
    seq_ids: set[str]
    start: float  # time.monotonic()
    end: float


class SlowDevice:
    """``worker`` with every non-empty step taking ``step_s`` seconds on a simulated device."""

    def __init__(self, worker, step_s: float):
        self._worker = worker
        self.step_s = step_s
        self.steps: list[SimulatedStep] = []
        self._due: dict[int, float] = {}

    def __getattr__(self, name):
        return getattr(self._worker, name)

    def launch(self, step, segment=("forward", "sample"), *, fill_bitmask=None):
        step = self._worker.launch(step, segment, fill_bitmask=fill_bitmask)
        if step.out is not None and id(step) not in self._due:  # its sampling just launched
            previous_end = self.steps[-1].end if self.steps else 0.0
            start = max(time.monotonic(), previous_end)
            ids = {item.seq.seq_id for item in step.scheduled}
            self.steps.append(SimulatedStep(ids, start, start + self.step_s))
            self._due[id(step)] = start + self.step_s
        return step

    def is_ready(self, pending) -> bool:
        return time.monotonic() >= self._due.get(id(pending), 0.0)

    def wait(self, pending) -> None:
        delay = self._due.get(id(pending), 0.0) - time.monotonic()
        if delay > 0:
            time.sleep(delay)

    def collect(self, pending):
        self.wait(pending)
        self._due.pop(id(pending), None)
        return self._worker.collect(pending)

    def step_running_at(self, when: float) -> int:
        """Index of the step on the device at ``when`` (ValueError: none was)."""
        for index, step in enumerate(self.steps):
            if step.start <= when < step.end:
                return index
        raise ValueError(f"no step ran at {when}")

    def first_step_of(self, seq_id: str) -> int:
        """Index of the first step that computed tokens of ``seq_id``."""
        return next(i for i, step in enumerate(self.steps) if seq_id in step.seq_ids)


SIMULATED_STEP_S = 0.05


def _simulated(core_class):
    """``core_class`` whose engine's device takes ``SIMULATED_STEP_S`` per step."""

    class Simulated(core_class):
        def __init__(self, engine, **kwargs):
            engine.pipeline.worker = SlowDevice(engine.pipeline.worker, SIMULATED_STEP_S)
            super().__init__(engine, **kwargs)

    Simulated.__name__ = Simulated.__qualname__ = f"Simulated{core_class.__name__}"
    return Simulated


def _tracing_classes():
    from jaxpaged.engine_core.request_trace import EagerTracingEngineCore, TracingEngineCore

    return _simulated(TracingEngineCore), _simulated(EagerTracingEngineCore)


# For ``scripts/trace_request_life.py --simulated-device`` (a CPU demonstration; spawned core
# processes import them by name).
SimulatedTracingEngineCore, SimulatedEagerTracingEngineCore = _tracing_classes()
