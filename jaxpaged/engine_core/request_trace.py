"""A request's life in the engine core, step by step: arrival -> add -> first scheduled step ->
first token out (docs/benchmarks.md, "First tokens sooner").

``TracingEngineCore`` is an ``EngineCore`` that records, on the core's host clock
(``time.monotonic()``, one clock for the processes of a host):

- per request: ``arrival`` (the API process's ``arrival_time``), ``received`` (the core loop
  took the add message), ``added`` (in the scheduler's queue), ``scheduled_call`` (the core
  step that scheduled its first tokens) and ``first_token_call`` (the core step that sent its
  first output), and ``first_token_sent`` (when that step's outputs left);
- per core step ``k`` (one ``LLMEngine.step`` call, which schedules device step ``k``):
  ``started``, ``dispatched``, ``ended``, the device step's start (``device_start``) and, from
  the next call, its end (``device_end``; exact when the host was waiting for it), and what it
  computed (sequences, prefill and decode tokens).

With async scheduling, call ``k`` sends the tokens of device step ``k - 1``; synchronously, of
step ``k``. ``summarize`` turns a trace into the per-request life: which device step was running
when the request arrived (``running_step``), ``lag`` = scheduled step - running step
(2 when the core scheduled step N + 1 before a request arriving during step N could join it,
1 when late scheduling let it join), and the time spent in each segment.

Fetch a trace with the ``request_trace`` utility call (``scripts/trace_request_life.py`` does).
"""

from __future__ import annotations

import time

from jaxpaged.engine.deltas import delta_finished
from jaxpaged.engine_core.core import ACK_DEFERRED, EngineCore

# Most requests and steps kept (the oldest are dropped beyond).
MAX_RECORDS = 200_000


class TracingEngineCore(EngineCore):
    """``EngineCore`` that records every request's and every step's times (see module doc)."""

    UTILITY_METHODS = (*EngineCore.UTILITY_METHODS, "request_trace", "clear_request_trace")

    def __init__(self, engine, **kwargs):
        super().__init__(engine, **kwargs)
        self.requests: dict[str, dict] = {}
        self.steps: list[dict] = []

    def add_request(self, request_id, prompt_token_ids, params, arrival_time, *args, **kwargs):
        received = time.monotonic()
        error = super().add_request(
            request_id, prompt_token_ids, params, arrival_time, *args, **kwargs
        )
        if error in (None, ACK_DEFERRED) and len(self.requests) < MAX_RECORDS:
            self.requests[request_id] = {
                "arrival": arrival_time,
                "received": received,
                "added": time.monotonic(),
                "prompt_len": len(prompt_token_ids),
                "scheduled_call": None,
                "first_token_call": None,
                "first_token_sent": None,
                "finished_call": None,
            }
        return error

    def step(self) -> list:
        index = self.num_steps
        history = self.engine.step_history
        recorded = history.num_recorded
        result = super().step()
        ended = time.monotonic()
        outputs, stats = result
        for request_id in stats["scheduled"]:
            record = self.requests.get(request_id)
            if record is not None and record["scheduled_call"] is None:
                record["scheduled_call"] = index
        for wire in outputs:
            record = self.requests.get(wire[0])
            if record is None:
                continue
            if record["first_token_call"] is None:
                record["first_token_call"], record["first_token_sent"] = index, ended
            if delta_finished(wire):
                record["finished_call"] = index
        if len(self.steps) < MAX_RECORDS:
            self.steps.append(self._step_record(index, stats["step_start"], ended, recorded))
        return result

    def _step_record(self, index: int, started: float, ended: float, recorded: int) -> dict:
        times = self.engine.step_times
        record = {"call": index, "started": started, "ended": ended, "async": times is not None}
        step = self.engine.step_history.last()
        if self.engine.step_history.num_recorded > recorded and step is not None:
            record |= {
                "num_seqs": step.num_seqs,
                "prefill_tokens": step.num_prefill_tokens,
                "decode_tokens": step.num_decode_tokens,
            }
        if times is not None:
            record |= {
                "dispatched": times.dispatched,
                "device_work": times.has_device_work,
                "device_start": times.device_start,
            }
            if self.steps and times.previous_ready is not None:  # the previous step's end
                self.steps[-1]["device_end"] = times.previous_ready
                self.steps[-1]["device_end_exact"] = times.previous_waited
        return record

    def request_trace(self) -> dict:
        """``{"requests": {id: record}, "steps": [record, ...]}`` (see the module doc)."""
        return {"requests": self.requests, "steps": self.steps}

    def clear_request_trace(self) -> bool:
        """Forget what was recorded (a benchmark's warm-up)."""
        self.requests, self.steps = {}, []
        return True


class EagerTracingEngineCore(TracingEngineCore):
    """The same, scheduling step N + 1 as soon as step N is launched (the core before late
    scheduling): the baseline a trace compares against."""

    late_scheduling = False


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def request_lives(trace: dict) -> list[dict]:
    """One row per request that got a token: its times (ms from reaching the core) and steps.

    Keys: ``request_id``, ``prompt_len``, ``api_to_core_ms`` (arrival -> received), ``add_ms``
    (received -> added), ``to_schedule_ms`` (added -> the scheduling call began),
    ``to_first_token_ms`` (that call began -> first token sent), ``core_ttft_ms`` (received ->
    first token sent), ``ttft_ms`` (arrival -> first token sent), ``running_step`` (the device step running at its ``arrival``: the API
    process's arrival time, or the send time of ``scripts/trace_request_life.py``; None: the
    device was idle), ``scheduled_step``, ``lag`` (scheduled - running step),
    ``first_token_call``, and ``prefill_tokens_in_step`` (all prefill tokens of its step).
    """
    steps = {step["call"]: step for step in trace["steps"]}
    device = sorted(
        (s["device_start"], s["device_end"], s["call"])
        for s in trace["steps"]
        if s.get("device_work") and "device_end" in s
    )
    lives = []
    for request_id, r in trace["requests"].items():
        if r["first_token_call"] is None or r["scheduled_call"] is None:
            continue
        running = next((call for start, end, call in device if start <= r["arrival"] < end), None)
        scheduled = steps.get(r["scheduled_call"], {})
        started = scheduled.get("started", r["added"])
        lives.append(
            {
                "request_id": request_id,
                "prompt_len": r["prompt_len"],
                "api_to_core_ms": 1000 * (r["received"] - r["arrival"]),
                "add_ms": 1000 * (r["added"] - r["received"]),
                "to_schedule_ms": 1000 * (started - r["added"]),
                "to_first_token_ms": 1000 * (r["first_token_sent"] - started),
                "core_ttft_ms": 1000 * (r["first_token_sent"] - r["received"]),
                "ttft_ms": 1000 * (r["first_token_sent"] - r["arrival"]),
                "running_step": running,
                "scheduled_step": r["scheduled_call"],
                "lag": None if running is None else r["scheduled_call"] - running,
                "first_token_call": r["first_token_call"],
                "prefill_tokens_in_step": scheduled.get("prefill_tokens"),
            }
        )
    return lives


SEGMENTS = (
    "api_to_core_ms",
    "add_ms",
    "to_schedule_ms",
    "to_first_token_ms",
    "core_ttft_ms",
    "ttft_ms",
)


def summarize(trace: dict) -> dict:
    """Percentiles (50, 90, 99) of each segment of ``request_lives``, the count of each lag,
    and device-step statistics: ``{"num_requests", "segments": {name: {"p50", "p90", "p99",
    "mean"}}, "lags": {lag: count}, "device_step_ms": {...} (also split into decode-only steps
    and steps with prefill tokens), "steps_with_prefill", "num_device_steps",
    "prefill_tokens_per_prefill_step_p50/p99/max", "device_idle_fraction"}``. The
    idle fraction is a lower bound: a step that finished before the host looked for its tokens
    ends, in the trace, when the host looked."""
    lives = request_lives(trace)
    segments = {}
    for name in SEGMENTS:
        values = [life[name] for life in lives]
        segments[name] = {
            "p50": _percentile(values, 50),
            "p90": _percentile(values, 90),
            "p99": _percentile(values, 99),
            "mean": sum(values) / len(values) if values else float("nan"),
        }
    lags: dict[str, int] = {}
    for life in lives:
        key = "device idle" if life["lag"] is None else str(life["lag"])
        lags[key] = lags.get(key, 0) + 1
    device = [s for s in trace["steps"] if s.get("device_work") and "device_end" in s]
    exact = [s for s in device if s.get("device_end_exact")]
    durations = [1000 * (s["device_end"] - s["device_start"]) for s in exact]
    by_kind: dict[str, list[float]] = {"decode_only": [], "with_prefill": []}
    for step, duration in zip(exact, durations, strict=True):
        by_kind["with_prefill" if step.get("prefill_tokens") else "decode_only"].append(duration)
    idle = sum(
        max(0.0, b["device_start"] - a["device_end"])
        for a, b in zip(device, device[1:], strict=False)
    )
    span = device[-1]["device_end"] - device[0]["device_start"] if device else 0.0
    return {
        "num_requests": len(lives),
        "segments": segments,
        "lags": dict(sorted(lags.items())),
        "device_step_ms": {
            "p50": _percentile(durations, 50),
            "p99": _percentile(durations, 99),
            "num_exact": len(durations),
            **{
                f"{kind}_p50/p99/n": [_percentile(v, 50), _percentile(v, 99), len(v)]
                for kind, v in by_kind.items()
            },
        },
        "steps_with_prefill": sum(1 for s in device if s.get("prefill_tokens")),
        "num_device_steps": len(device),
        "prefill_tokens_per_prefill_step_p50/p99/max": [
            _percentile(p := [s["prefill_tokens"] for s in device if s.get("prefill_tokens")], 50),
            _percentile(p, 99),
            max(p, default=0),
        ],
        "device_idle_fraction": idle / span if span > 0 else 0.0,
    }


def format_lives(lives: list[dict], limit: int = 10) -> str:
    """The ``limit`` slowest lives (by ``core_ttft_ms``) as an aligned table."""
    header = (
        f"{'request':>12} {'prompt':>6} {'api->core':>9} {'add':>6} {'->sched':>8} "
        f"{'->token':>8} {'core ttft':>9} {'running':>7} {'sched':>6} {'lag':>4} {'prefill':>7}"
    )
    rows = [header]
    for life in sorted(lives, key=lambda x: -x["core_ttft_ms"])[:limit]:
        rows.append(
            f"{life['request_id'][-12:]:>12} {life['prompt_len']:>6} "
            f"{life['api_to_core_ms']:>9.2f} {life['add_ms']:>6.2f} "
            f"{life['to_schedule_ms']:>8.2f} {life['to_first_token_ms']:>8.2f} "
            f"{life['core_ttft_ms']:>9.2f} {str(life['running_step']):>7} "
            f"{life['scheduled_step']:>6} {str(life['lag']):>4} "
            f"{str(life['prefill_tokens_in_step']):>7}"
        )
    return "\n".join(rows)
