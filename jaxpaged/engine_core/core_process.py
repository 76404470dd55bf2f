"""The engine-core process seen from an API process: start it, connect to it, watch it.

``start_core_process`` spawns ``core.run_engine_core`` for a number of clients (API processes)
and waits until its engine is built; ``CoreConnection`` is one client's handle on a core (its
input socket, info, outstanding requests, and the process to watch): a child
``multiprocessing.Process`` for the process that started it, a ``RemoteCoreProcess`` (a pidfd)
for the other API processes of ``--api-server-count``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import select
import shutil
import signal
import tempfile
import time

import zmq
import zmq.asyncio

from jaxpaged.engine_core.core import run_engine_core
from jaxpaged.engine_core.core_messages import Kind, decode, encode


class CoreConnection:
    """One engine-core process: its sockets, its info, and its outstanding requests.

    Args:
        index: the core's position among the client's cores.
        process: the ``multiprocessing.Process`` running ``run_engine_core``, or a
            ``RemoteCoreProcess`` when another process started the core.
        input_socket: sync PUSH socket connected to the core's input (never blocks: no
            high-water mark, and a connecting socket queues until the peer is there).
        info: ``EngineCore.info()`` from the core's ready message.
        status_pipe: read end of the core's status pipe (``run_engine_core``'s ``ready_pipe``),
            where a core whose loop failed leaves its ``Kind.DEAD`` message before exiting.
    """

    def __init__(self, index: int, process, input_socket, info: dict, status_pipe=None):
        self.index = index
        self.process = process
        self.status_pipe = status_pipe
        self.input_socket = input_socket
        self.info = info
        self.outstanding: set[str] = set()
        self.last_seen = time.monotonic()

    @property
    def num_outstanding(self) -> int:
        """Requests sent to this core and not finished (what a balancer compares)."""
        return len(self.outstanding)

    def send(self, kind: Kind, payload) -> None:
        self.input_socket.send(encode(kind, payload), copy=False)

    def close(self) -> None:
        """Close the input socket and the status pipe (after the process is gone)."""
        self.input_socket.close()
        if self.status_pipe is not None:
            self.status_pipe.close()
            self.status_pipe = None

    def exit_reason(self) -> str:
        """Why the (exited) core died: the error it left on its status pipe, else its exit code."""
        if self.process.exitcode is None:  # not our child (RemoteCoreProcess): no exit code
            reason = f"the engine core process (pid {self.info.get('pid')}) exited"
        else:
            reason = f"the engine core process exited with code {self.process.exitcode}"
        pipe, self.status_pipe = self.status_pipe, None
        if pipe is None:
            return reason
        try:
            return death_message(pipe) or reason
        finally:
            pipe.close()


def death_message(status_pipe) -> str | None:
    """The error an exited core left on its status pipe (the last ``Kind.DEAD`` message there;
    ``run_engine_core`` writes it before exiting), or None when it left none."""
    message = None
    try:
        while status_pipe.poll(0):
            kind, payload = decode(status_pipe.recv_bytes())
            if kind is Kind.DEAD:
                message = payload
    except (EOFError, OSError, ValueError):
        pass
    return message


class RemoteCoreProcess:
    """The engine-core process as an API process that did not start it sees it
    (``--api-server-count``): the ``multiprocessing.Process`` calls the client makes, on a
    pidfd, which turns readable when the process ends (reaped or not). Where pidfds are not
    allowed (old kernels, strict seccomp), ``os.kill(pid, 0)``: the core counts as alive until
    the parent has reaped it, which its watch loop does at once.

    Args:
        pid: the core's process id (``EngineCore.info()["pid"]``).

    Raises:
        ProcessLookupError: no process has that id (the core is already gone).
    """

    exitcode = None  # only the parent can read it

    def __init__(self, pid: int):
        self.pid = pid
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:
            raise
        except OSError:
            self._pidfd = None
            os.kill(pid, 0)  # ProcessLookupError if gone
        self._closed = False

    def is_alive(self) -> bool:
        if self._closed:
            return False
        if self._pidfd is None:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False
            return True
        ready, _, _ = select.select([self._pidfd], [], [], 0)
        return not ready

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._pidfd is not None and not self._closed:
            select.select([self._pidfd], [], [], timeout)
            return
        while self.is_alive() and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.05)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def close(self) -> None:
        if self._pidfd is not None and not self._closed:
            os.close(self._pidfd)
        self._closed = True


@dataclasses.dataclass
class StartedCore:
    """An engine-core process that ``start_core_process`` saw build its engine.

    ``status_pipe`` is the read end of its status pipe (``run_engine_core``'s ``ready_pipe``);
    ``info`` its ``EngineCore.info()``; ``input_address`` and ``output_addresses`` (one per
    client) are ZMQ ``ipc://`` addresses in ``ipc_dir``, which the starter removes at the end.
    """

    process: multiprocessing.Process
    status_pipe: object
    info: dict
    ipc_dir: str
    input_address: str
    output_addresses: list[str]


def start_core_process(
    engine_args,
    *,
    num_clients: int = 1,
    core_class: str = "jaxpaged.engine_core.core:EngineCore",
    max_num_queued_requests: int | None = None,
    cuda_visible_devices: str | None = None,
) -> StartedCore:
    """Start ``run_engine_core`` in a spawned process for ``num_clients`` API processes and
    wait (blocking) until its engine is built.

    Raises:
        ValueError: ``num_clients`` < 1 or ``max_num_queued_requests`` < 0.
        ValueError: the core refused its engine arguments or model (its message: a bad
            argument, an unreadable or impossible checkpoint).
        RuntimeError: the core failed to build its engine otherwise (its message) or exited.
    """
    if num_clients < 1:
        raise ValueError(f"num_clients must be at least 1, got {num_clients}")
    if max_num_queued_requests is not None and max_num_queued_requests < 0:
        raise ValueError(
            f"max_num_queued_requests must be >= 0 or None, got {max_num_queued_requests}"
        )
    ipc_dir = tempfile.mkdtemp(prefix="jaxpaged-core-")
    input_address = f"ipc://{os.path.join(ipc_dir, 'input')}"
    output_addresses = [f"ipc://{os.path.join(ipc_dir, f'output-{i}')}" for i in range(num_clients)]
    spawn = multiprocessing.get_context("spawn")
    reader, writer = spawn.Pipe(duplex=False)
    process = spawn.Process(
        target=run_engine_core,
        args=(engine_args, input_address, output_addresses, writer),
        kwargs=dict(
            core_class=core_class,
            max_num_queued_requests=max_num_queued_requests,
            cuda_visible_devices=cuda_visible_devices,
        ),
        name="jaxpaged-engine-core",
        daemon=True,
    )
    process.start()
    writer.close()
    try:
        frame = reader.recv_bytes()  # EOFError if the process dies before answering
        kind, payload = decode(frame)
    except EOFError:
        process.join(5)
        kind, payload = Kind.DEAD, f"the engine core exited with code {process.exitcode}"
    if kind is Kind.DEAD:
        reader.close()
        shutil.rmtree(ipc_dir, ignore_errors=True)
        if str(payload).startswith("ValueError: "):  # bad arguments or model: the user's
            raise ValueError(str(payload).removeprefix("ValueError: "))
        raise RuntimeError(f"the engine core failed to start: {payload}")
    return StartedCore(process, reader, payload, ipc_dir, input_address, output_addresses)


def client_sockets(input_address: str, output_address: str):
    """``(input PUSH connected to the core, asyncio context, output PULL bound for it)``;
    no high-water marks (never block, never drop), no linger."""
    context = zmq.asyncio.Context()
    input_socket = zmq.Context.instance().socket(zmq.PUSH)
    input_socket.setsockopt(zmq.SNDHWM, 0)
    input_socket.setsockopt(zmq.LINGER, 0)
    input_socket.connect(input_address)
    output_socket = context.socket(zmq.PULL)
    output_socket.setsockopt(zmq.RCVHWM, 0)
    output_socket.setsockopt(zmq.LINGER, 0)
    output_socket.bind(output_address)
    return input_socket, context, output_socket
