"""When the engine core schedules the next step under async scheduling ("late scheduling").

With async scheduling, ``LLMEngine.step`` schedules step N + 1, launches it behind step N and
then waits for step N's tokens. The core loop drains its input socket only between two calls,
so it used to schedule N + 1 right after N began on the device: a request that arrived while N
ran missed N + 1 and waited for N + 2, one whole step more. vLLM's batch queue
(``EngineCore.step_with_batch_queue``, two batches in flight) has the same order.

Instead, once ``step`` returns (N on the device, N + 1 not yet scheduled) the core keeps
draining its input socket and calls ``step`` only at the deadline::

    deadline = device start of N + predicted duration of N - host lead - margin

- predicted duration: the shortest device time among the last ``history`` steps (a step is
  rarely shorter than all of them, so the device is rarely left idle). A step's device time is
  measured when the host was already waiting for its tokens (``StepTimes.previous_waited``), or
  when the core saw it finish while waiting here (within one poll, about 1 ms).
- host lead: the second longest time, among the last ``history`` steps, from entering ``step``
  to launching its step (scheduling, block moves, input packing, dispatch); the second, so
  that one hiccup of the host (a garbage collection, another process on the core) does not
  shrink the window for ``history`` steps.
- margin: slack for the host's jitter, ``max(margin_s, margin_fraction * predicted duration)``.

While waiting, the core polls the device about once a millisecond: if step N is done before
the deadline (a misprediction), it schedules at once, so the device waits at most one poll plus
the host lead. A request that arrives before the deadline is in step N + 1; after it, in N + 2.
There is no deadline after a step whose predecessor's tokens were ready before the host looked
for them: the host, not the device, set the pace then (or the last deadline was late), so the
device has no time to spare and the next step is scheduled at once.

The core waits only when an arrival could join step N + 1 (``EngineCore.next_step_deadline``):
nothing waits or is swapped out (an arrival would queue behind them, first come first served)
and fewer than ``max_num_seqs`` requests run. Synchronous engines never wait: their ``step``
runs the step it schedules, so the core drains its socket right before each step anyway.
"""

from __future__ import annotations

import collections

from jaxpaged.engine.async_scheduling import StepTimes

DEFAULT_HISTORY = 16
DEFAULT_MARGIN_S = 0.001
DEFAULT_MARGIN_FRACTION = 0.05
# Never wait longer than this after a step began (a guard against a wrong measurement).
DEFAULT_MAX_WAIT_S = 0.5


class AdmissionWindow:
    """The deadline for scheduling the next step, from the measured times of the last ones.

    Args:
        history: steps whose device times and host leads are remembered, >= 1.
        margin_s, margin_fraction: the deadline leaves ``max(margin_s, margin_fraction *
            predicted duration)`` seconds besides the host lead; both >= 0.
        max_wait_s: the deadline is at most this many seconds after the running step began.

    Raises:
        ValueError: an argument out of range.
    """

    def __init__(
        self,
        *,
        history: int = DEFAULT_HISTORY,
        margin_s: float = DEFAULT_MARGIN_S,
        margin_fraction: float = DEFAULT_MARGIN_FRACTION,
        max_wait_s: float = DEFAULT_MAX_WAIT_S,
    ):
        if history < 1:
            raise ValueError(f"history must be at least 1, got {history}")
        if min(margin_s, margin_fraction, max_wait_s) < 0:
            raise ValueError(
                "margin_s, margin_fraction and max_wait_s must be >= 0, got "
                f"{margin_s}, {margin_fraction}, {max_wait_s}"
            )
        self.margin_s = margin_s
        self.margin_fraction = margin_fraction
        self.max_wait_s = max_wait_s
        self._durations: collections.deque[float] = collections.deque(maxlen=history)
        self._leads: collections.deque[float] = collections.deque(maxlen=history)
        # Device start (time.monotonic()) of the step in flight; None: none, or already measured.
        self._running_start: float | None = None
        # Whether the host waited for the last step's tokens (the device set the pace).
        self._device_bound = False

    def observe(self, times: StepTimes | None) -> None:
        """Record one ``LLMEngine.step`` (``engine.step_times``; None: it ran synchronously)."""
        if times is None:
            self._running_start = None
            return
        start = self._running_start
        if start is not None and times.previous_ready is not None and times.previous_waited:
            self._durations.append(times.previous_ready - start)
        self._leads.append(times.dispatched - times.started)
        self._running_start = times.device_start if times.has_device_work else None
        self._device_bound = times.previous_waited

    def observe_finished(self, now: float) -> None:
        """The core saw the step in flight finished at ``now`` (an upper bound of its end)."""
        if self._running_start is not None:
            self._durations.append(now - self._running_start)
            self._running_start = None

    def deadline(self) -> float | None:
        """``time.monotonic()`` by which the next step must be scheduled; None: at once (no step
        in flight, nothing measured yet, or the host did not wait for the last step)."""
        if self._running_start is None or not self._durations or not self._device_bound:
            return None
        duration = min(self._durations)
        margin = max(self.margin_s, self.margin_fraction * duration)
        leads = sorted(self._leads)
        lead = leads[-2] if len(leads) > 1 else leads[-1] if leads else 0.0
        wait = duration - lead - margin
        return self._running_start + min(wait, self.max_wait_s)

    def predicted_duration(self) -> float | None:
        """Seconds the step in flight is expected to take at least (None: nothing measured)."""
        return min(self._durations) if self._durations else None
