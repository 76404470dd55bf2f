"""Late scheduling (``engine_core/admission.py``): under async scheduling, a request that reaches the
engine core while step N runs on the device is in step N + 1, not N + 2.

The core's loop runs in a thread on the session's stories260k engine, whose device is simulated
to take 0.2 s a step (``SlowDevice``), so "while step N runs" is a wide, known interval."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import zmq

from jaxpaged import SamplingParams
from jaxpaged.engine.async_scheduling import StepTimes
from jaxpaged.engine.deltas import delta_finished
from jaxpaged.engine_core import core as core_module
from jaxpaged.engine_core.admission import AdmissionWindow
from jaxpaged.engine_core.core import EngineCore
from jaxpaged.engine_core.core_messages import Kind, decode, encode, params_to_wire
from tests.engine_core.slow_device import SlowDevice

STEP_S = 0.2


class EagerCore(EngineCore):
    """The core as it was: schedules step N + 1 as soon as step N is launched."""

    late_scheduling = False


def _warm_up(engine) -> None:
    """Compile the step shapes of the test first (a step that compiles takes a second, which
    would count as host lead in the core's measurements)."""
    ids = {"prompt_token_ids": [1, *range(5, 12)]}
    engine.add_request("warm-a", ids, SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    engine.step()
    engine.add_request("warm-b", ids, SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


@pytest.fixture
def slow_async_engine(stories_llm):
    engine = stories_llm.llm_engine
    worker, was_async = engine.pipeline.worker, engine.async_scheduling
    engine.async_scheduling = True
    _warm_up(engine)
    engine.pipeline.worker = SlowDevice(worker, STEP_S)
    try:
        yield engine
    finally:
        engine.pipeline.worker, engine.async_scheduling = worker, was_async


class LoopThread:
    """``core._loop`` in a thread, fed and drained over inproc sockets."""

    def __init__(self, core: EngineCore):
        self.context = zmq.Context.instance()
        name = uuid.uuid4().hex
        inputs = self.context.socket(zmq.PULL)
        inputs.bind(f"inproc://in-{name}")
        self.results = self.context.socket(zmq.PULL)
        self.results.bind(f"inproc://out-{name}")
        output = self.context.socket(zmq.PUSH)
        output.connect(f"inproc://out-{name}")
        self.send_socket = self.context.socket(zmq.PUSH)
        self.send_socket.connect(f"inproc://in-{name}")
        self._sockets = [inputs, output]
        self.thread = threading.Thread(
            target=core_module._loop, args=(core, inputs, [output]), daemon=True
        )
        self.thread.start()

    def add(self, request_id: str, num_prompt_tokens: int, max_tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        ids = [1, *range(5, 4 + num_prompt_tokens)]
        sent = time.monotonic()
        payload = [request_id, ids, params_to_wire(params), sent, None, 0]
        self.send_socket.send(encode(Kind.ADD, payload))
        return sent

    def wait_finished(self, request_ids: set[str], timeout_s: float = 30.0) -> None:
        pending = set(request_ids)
        deadline = time.monotonic() + timeout_s
        while pending:
            assert self.results.poll(int(1000 * (deadline - time.monotonic()))), pending
            kind, payload = decode(self.results.recv())
            if kind is Kind.ACKS:
                assert all(error is None for _, error in payload), payload
            elif kind is Kind.OUTPUTS:
                pending -= {wire[0] for wire in payload[0] if delta_finished(wire)}

    def stop(self) -> None:
        self.send_socket.send(encode(Kind.SHUTDOWN, None))
        self.thread.join(10)
        assert not self.thread.is_alive()
        for socket in [*self._sockets, self.send_socket, self.results]:
            socket.close(linger=0)


@pytest.mark.parametrize(
    "core_class, expected_lag", [(EngineCore, 1), (EagerCore, 2)], ids=["late", "eager"]
)
def test_a_request_arriving_while_step_n_runs_is_in_step_n_plus_1(
    slow_async_engine, core_class, expected_lag
):
    device = slow_async_engine.pipeline.worker
    core = core_class(slow_async_engine)
    loop = LoopThread(core)
    try:
        loop.add("a", 8, max_tokens=12)
        while len(device.steps) < 3:  # "a" decodes; the core has measured a step
            time.sleep(0.01)
        # 40 ms into a step the device has begun (far from both of its ends).
        step = device.steps[-1]
        time.sleep(max(0.0, step.start + 0.04 - time.monotonic()))
        sent = loop.add("b", 8, max_tokens=2)
        loop.wait_finished({"a", "b"})
    finally:
        loop.stop()
    running = device.step_running_at(sent)
    assert device.first_step_of("b") == running + expected_lag
    # Scheduling late left the device idle for no more than host jitter between a's steps.
    a_steps = [s for s in device.steps if "a" in s.seq_ids]
    gaps = [b.start - a.end for a, b in zip(a_steps, a_steps[1:], strict=False)]
    assert max(gaps) < 0.05 * STEP_S, gaps
    stats = core.check_idle()
    assert stats["num_unfinished_requests"] == 0
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"]


def _times(started, dispatched, previous_ready=None, waited=False, work=True):
    return StepTimes(started, dispatched, work, previous_ready, waited)


def test_the_deadline_is_the_step_start_plus_its_shortest_measured_time_less_the_host_lead():
    window = AdmissionWindow(history=4, margin_s=0.001, margin_fraction=0.0)
    window.observe(_times(0.0, 0.003))  # step 0 starts at 0.003 (host lead 3 ms)
    assert window.deadline() is None  # nothing measured yet
    # Step 1 launched at 0.004 (lead 4 ms), step 0 done at 0.103 while the host waited.
    window.observe(_times(0.0, 0.004, previous_ready=0.103, waited=True))
    assert window.predicted_duration() == pytest.approx(0.1)
    # Step 1 began when step 0 ended: 0.103 + 0.100 - 0.003 (second longest lead) - 0.001.
    assert window.deadline() == pytest.approx(0.199)
    # One 50 ms hiccup of the host is ignored (the second longest lead is 4 ms).
    window.observe(_times(0.15, 0.2, previous_ready=0.203, waited=True))
    assert window.deadline() == pytest.approx(0.203 + 0.1 - 0.004 - 0.001)
    # The core saw step 2 end after 60 ms: the shorter time wins; nothing is in flight now.
    window.observe_finished(0.263)
    assert window.predicted_duration() == pytest.approx(0.06)
    assert window.deadline() is None
    # Step 3's predecessor was done before the host looked for it: the host set the pace, so
    # step 4 is scheduled at once (and step 2 gave no second measurement).
    window.observe(_times(0.3, 0.301, previous_ready=0.302, waited=False))
    assert window.deadline() is None
    assert window.predicted_duration() == pytest.approx(0.06)
    window.observe(_times(0.36, 0.362, previous_ready=0.361, waited=True))
    assert window.deadline() == pytest.approx(0.362 + 0.06 - 0.004 - 0.001)


def test_the_deadline_forgets_old_steps_and_is_capped():
    window = AdmissionWindow(history=2, margin_s=0.0, margin_fraction=0.05, max_wait_s=0.5)
    window.observe(_times(0.0, 0.0))
    start = 0.0
    for duration in (0.01, 0.2, 0.3):  # the 10 ms step leaves the history of two
        window.observe(_times(start + duration, start + duration, start + duration, True))
        start += duration
    assert window.predicted_duration() == pytest.approx(0.2)
    assert window.deadline() == pytest.approx(start + 0.2 - 0.01)  # 5% margin
    window.max_wait_s = 0.05
    assert window.deadline() == pytest.approx(start + 0.05)  # capped
    window.observe(None)  # a synchronous step: nothing in flight to wait for
    assert window.deadline() is None
    with pytest.raises(ValueError, match="history"):
        AdmissionWindow(history=0)


def test_the_core_does_not_wait_when_an_arrival_could_not_join_the_next_step(stories_llm):
    engine = stories_llm.llm_engine
    was_async = engine.async_scheduling
    engine.async_scheduling = True
    core = EngineCore(engine)
    params = params_to_wire(SamplingParams(max_tokens=4, ignore_eos=True))
    try:
        assert core.next_step_deadline() is None  # nothing in flight
        limit = engine.scheduler.max_num_seqs
        for i in range(limit + 1):  # one more than there are seats
            assert core.add_request(f"w{i}", [1, 2, 3], params, 0.0) is None
        core.step()
        core.step()
        # A step is in flight and measured, but a request still waits for a seat.
        assert engine.scheduler.num_waiting == 1
        assert core.next_step_deadline() is None
        while core.has_work():
            core.step()
    finally:
        engine.async_scheduling = was_async
    assert core.check_idle()["num_unfinished_requests"] == 0
