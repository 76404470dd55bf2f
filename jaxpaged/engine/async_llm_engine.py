"""``AsyncLLMEngine``: an ``LLMEngine`` stepped by one background thread, for the server.

``LLMEngine.step`` is blocking JAX work, so it runs in a dedicated thread, never on the event
loop. Requests and aborts from any thread go into one FIFO of operations that the engine
thread applies *between* steps, so the engine itself is only ever touched by that thread. Each
step's outputs reach the per-request ``asyncio.Queue``s through one
``loop.call_soon_threadsafe`` call per step.

Lifecycle of a request::

    stream = await engine.add_request(request_id, prompt, params)  # accepted (or raises)
    try:
        async for output in stream:       # cumulative RequestOutputs, the last one finished
            ...
    finally:
        stream.close()                    # aborts the request unless it finished

If ``step`` raises, the loop dies: every open stream and every pending ``add_request`` fails
with ``EngineDeadError``, later calls raise it at once, and ``is_dead`` turns True (``/health``
answers 503).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import AsyncIterator

from jaxpaged.outputs import RequestOutput

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop has stopped after an error; no request can be served any more."""


class QueueFullError(RuntimeError):
    """The waiting queue already holds ``max_num_queued_requests`` requests (HTTP 429)."""


class RequestStream:
    """The outputs of one request as an async iterator (consumed on the event loop)."""

    def __init__(self, request_id: str, engine: AsyncLLMEngine):
        self.request_id = request_id
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False
        self._closed = False

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def close(self) -> None:
        """Abort the request unless it has finished; idempotent, safe from any thread."""
        if not self._closed:
            self._closed = True
            if not self.finished:
                self._engine.abort(self.request_id)


class AsyncLLMEngine:
    """Runs ``engine.step()`` in a background thread and streams outputs to asyncio callers.

    Args:
        engine: the ``LLMEngine`` to drive; from ``start()`` on, only the engine thread touches
            it.
        max_num_queued_requests: most requests that may wait in the scheduler's queue; a new
            request arriving when that many wait is rejected with ``QueueFullError`` (HTTP 429).
            Requests added between two steps all count, so a burst larger than this limit is
            partly shed even if free batch slots would have taken it. None means unbounded
            (vLLM's behaviour). Must be >= 0.
        metrics: optional ``jaxpaged.metrics.ServerMetrics`` fed from the engine thread.

    Raises:
        ValueError: for a negative ``max_num_queued_requests``.
    """

    def __init__(self, engine, *, max_num_queued_requests: int | None = None, metrics=None):
        if max_num_queued_requests is not None and max_num_queued_requests < 0:
            raise ValueError(
                f"max_num_queued_requests must be >= 0 or None, got {max_num_queued_requests}"
            )
        self.engine = engine
        self.max_num_queued_requests = max_num_queued_requests
        self.metrics = metrics
        self.num_steps = 0  # engine steps run so far (written by the engine thread only)
        self.dead_error: BaseException | None = None  # what killed the loop
        self._ops: collections.deque[tuple] = collections.deque()
        self._ops_lock = threading.Lock()
        self._wakeup = threading.Event()
        self._stopping = False
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------------------- lifecycle
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread; outputs are delivered on ``loop`` (default: the running
        loop)."""
        if self._thread is not None:
            raise RuntimeError("the engine loop is already started")
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="jaxpaged-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float | None = 60.0) -> None:
        """Stop the engine thread after its current step and wait for it; requests still
        running are aborted and their streams fail with ``EngineDeadError``."""
        with self._ops_lock:
            self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def is_dead(self) -> bool:
        """True once the loop stopped because of an error."""
        return self.dead_error is not None

    # ------------------------------------------------------------------------------ requests
    async def add_request(
        self,
        request_id: str,
        prompt,
        params,
        *,
        arrival_time: float | None = None,
        lora_request=None,
    ) -> RequestStream:
        """Queue a request and return its output stream once the engine has accepted it.

        ``prompt`` and ``params`` are what ``LLMEngine.add_request`` takes. The request is
        applied between two steps, so this waits for at most one step.

        Raises:
            ValueError: the engine rejected the prompt or parameters.
            QueueFullError: the waiting queue is at ``max_num_queued_requests``.
            EngineDeadError: the loop has died (or dies before the request is applied).
        """
        if self._loop is None:
            raise RuntimeError("call start() before add_request()")
        stream = RequestStream(request_id, self)
        accepted = self._loop.create_future()
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self._submit(
            ("add", request_id, prompt, params, arrival_time, stream, accepted, lora_request)
        )
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)  # the add is ahead of this in the FIFO, so it is undone
            raise
        return stream

    async def generate(self, request_id: str, prompt, params) -> AsyncIterator[RequestOutput]:
        """vLLM's shape: an async generator of cumulative outputs; closing it aborts."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    async def run_between_steps(self, fn):
        """``fn(llm_engine)`` on the engine thread between two steps; its result (or error).

        For engine state the loop owns, e.g. loading a LoRA adapter (``add_lora``)."""
        if self._loop is None:
            raise RuntimeError("call start() before run_between_steps()")
        done = self._loop.create_future()
        self._submit(("call", fn, done))
        return await done

    async def add_lora(self, lora_request) -> bool:
        """``LLMEngine.add_lora`` between steps (vLLM's ``AsyncLLM.add_lora``)."""
        return await self.run_between_steps(lambda engine: engine.add_lora(lora_request))

    async def remove_lora(self, lora_int_id: int) -> bool:
        """``LLMEngine.remove_lora`` between steps (vLLM's ``AsyncLLM.remove_lora``)."""
        return await self.run_between_steps(lambda engine: engine.remove_lora(lora_int_id))

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if unknown or finished); thread-safe, applied between steps."""
        try:
            self._submit(("abort", request_id))
        except EngineDeadError:
            pass  # nothing runs any more

    def _submit(self, op: tuple) -> None:
        with self._ops_lock:
            if self.dead_error is not None:
                raise EngineDeadError(f"the engine loop has died: {self.dead_error!r}")
            if self._stopping:
                raise EngineDeadError("the engine loop was shut down")
            self._ops.append(op)
        self._wakeup.set()

    # --------------------------------------------------------------------- the engine thread
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                if not engine.has_unfinished_requests():
                    self._wakeup.wait()
                self._wakeup.clear()
                if self._stopping:
                    for request_id in self._streams:  # leave the engine clean for reuse
                        engine.abort_request(request_id)
                    self._fail_all(EngineDeadError("the engine loop was shut down"))
                    return
                self._apply_ops()
                if not engine.has_unfinished_requests():
                    continue
                step_start = time.monotonic()
                outputs = engine.step()
                self.num_steps += 1
                self._deliver(outputs)
                if self.metrics is not None:
                    self.metrics.observe_step(engine, outputs, step_start, time.monotonic())
        except BaseException as error:  # any failure kills the loop; report it to every caller
            logger.exception("engine loop died")
            self._die(error)

    def _apply_ops(self) -> None:
        with self._ops_lock:
            ops, self._ops = self._ops, collections.deque()
        if not ops:
            return
        engine = self.engine
        resolutions = []
        aborted: list[RequestOutput] = []
        for op in ops:
            if op[0] == "abort":
                self._streams.pop(op[1], None)
                output = engine.abort_request(op[1])
                if output is not None:
                    aborted.append(output)
                continue
            if op[0] == "call":
                _, fn, done = op
                self._loop.call_soon_threadsafe(_settle, done, *_call(fn, engine))
                continue
            _, request_id, prompt, params, arrival_time, stream, accepted, lora = op
            limit = self.max_num_queued_requests
            if limit is not None and engine.scheduler.num_waiting >= limit:
                error = QueueFullError(
                    f"the waiting queue is full: {engine.scheduler.num_waiting} requests wait "
                    f"and max_num_queued_requests is {limit}; retry later"
                )
                resolutions.append((accepted, error))
                continue
            try:
                engine.add_request(
                    request_id, prompt, params, arrival_time=arrival_time, lora_request=lora
                )
            except Exception as error:  # ValueError (400) or a bug (500): this request only
                resolutions.append((accepted, error))
                continue
            self._streams[request_id] = stream
            resolutions.append((accepted, None))
            if self.metrics is not None:
                self.metrics.observe_added(request_id, arrival_time)
        if self.metrics is not None:
            for output in aborted:
                self.metrics.observe_aborted(output.request_id)
            self.metrics.observe_engine_state(engine)
        self._loop.call_soon_threadsafe(_resolve_all, resolutions)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        items = []
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            items.append((stream, output))
        if items:
            self._loop.call_soon_threadsafe(_put_all, items)

    def _die(self, error: BaseException) -> None:
        with self._ops_lock:
            self.dead_error = error
        self._fail_all(EngineDeadError(f"the engine loop has died: {error!r}"))

    def _fail_all(self, dead: EngineDeadError) -> None:
        with self._ops_lock:
            ops, self._ops = self._ops, collections.deque()
        resolutions = [(op[6], dead) for op in ops if op[0] == "add"]
        resolutions += [(op[2], dead) for op in ops if op[0] == "call"]
        items = [(stream, dead) for stream in self._streams.values()]
        self._streams.clear()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(_resolve_all, resolutions)
            self._loop.call_soon_threadsafe(_put_all, items)


def _call(fn, engine) -> tuple:
    try:
        return fn(engine), None
    except Exception as error:  # the caller's error, not the loop's
        return None, error


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


def _resolve_all(resolutions: list[tuple[asyncio.Future, BaseException | None]]) -> None:
    for future, error in resolutions:
        if future.done():  # the caller was cancelled; its abort follows in the FIFO
            continue
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)


def _put_all(items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    for stream, item in items:
        stream._put(item)
