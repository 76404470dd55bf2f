"""The API process's side of the split: start the engine core, send requests, stream outputs.

vLLM v1's ``AsyncMPClient`` and ``AsyncLLM`` (``vllm/v1/engine/core_client.py``,
``async_llm.py``) in our terms. ``EngineCoreClient.spawn`` starts the core process
(``core.run_engine_core``) and waits until its engine is built; ``start()`` (on the server's
event loop) starts a receive task, which routes the core's deltas through each request's
``ClientRequestState`` (detokenization, stop strings) into its ``RequestStream``, and a watch
task. Lifecycle of a request::

    stream = await client.add_request(request_id, prompt, params)  # acked by the core
    try:
        async for output in stream:       # cumulative RequestOutputs, the last one finished
            ...
    finally:
        stream.close()                    # aborts the request in the core unless finished

Core death: the process exits (a core whose loop raised names the error on its status pipe
and in a ``dead`` message), or sends nothing (not even
its heartbeat) for ``heartbeat_timeout_s``. Then every open stream and pending call fails with
``EngineDeadError``, later calls raise it at once, and ``is_dead`` turns True (``/health`` 503).

One core is one ``CoreConnection`` with its count of outstanding requests, so that several
cores behind one client (``--data-parallel-size``) need only a choice of connection per request.

Several API processes over one core (``--api-server-count N``): the parent starts the core with
``start_core_process(num_clients=N)``; API process ``i`` reaches it through
``EngineCoreClient.connect(..., client_index=i)``. Such a client does not own the core: it
watches the core's pid (a pidfd) instead of a child process, and its ``shutdown`` leaves the
core running (the parent stops it).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import shutil
import time
from collections.abc import Callable

import zmq

from jaxpaged.beam_search import BeamSearchParams
from jaxpaged.engine.client_outputs import ClientRequestState
from jaxpaged.engine.core import QueueFullError
from jaxpaged.engine.core_messages import (
    Kind,
    decode,
    decode_output,
    lora_to_wire,
    params_to_wire,
    scheduler_stats,
)
from jaxpaged.engine.core_process import (
    CoreConnection,
    RemoteCoreProcess,
    client_sockets,
    start_core_process,
)
from jaxpaged.lora.request import LoRARequest
from jaxpaged.metrics import ServerMetrics
from jaxpaged.outputs import RequestOutput
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams, verify_for_model
from jaxpaged.sequence import EngineSleepingError, check_prompt_vocab

logger = logging.getLogger(__name__)

__all__ = [
    "CoreConnection",
    "EngineCoreClient",
    "EngineDeadError",
    "QueueFullError",
    "RequestStream",
    "start_core_process",
]

# How often the watch task looks at the core process (seconds).
_WATCH_INTERVAL_S = 0.1
# How long an exited core's last messages may take to be read before its death is declared.
_DRAIN_TIMEOUT_S = 5.0


class EngineDeadError(RuntimeError):
    """The engine core has died; no request can be served any more."""


class RequestStream:
    """The outputs of one request as an async iterator (consumed on the event loop).

    Outputs are cumulative (``RequestState.update``), so a stream holds only the newest one: if
    the consumer falls behind (a slow client, or an event loop busy with many streams at
    saturation), the steps it missed arrive merged into one output instead of queueing up,
    as vLLM v1's ``RequestOutputCollector`` does. An error is raised after the newest output.
    """

    def __init__(self, request_id: str, client: EngineCoreClient):
        self.request_id = request_id
        self._client = client
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self.finished = False
        self._closed = False

    def _put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self._error = item
        else:
            self._latest = item  # includes any unread older output
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        if self._latest is None and self._error is None:
            await self._ready.wait()
        self._ready.clear()
        item, self._latest = self._latest, None
        if item is None:
            self.finished = True
            raise self._error
        if item.finished:
            self.finished = True
        return item

    def close(self) -> None:
        """Abort the request unless it has finished; idempotent."""
        if not self._closed:
            self._closed = True
            if not self.finished:
                self._client.abort(self.request_id)


class EngineCoreClient:
    """Requests in, ``RequestStream``s out, over one engine-core process (see module doc).

    Build it with ``EngineCoreClient.spawn``; call ``await start()`` on the serving loop.

    Args:
        connection: the started core.
        context / output_socket / ipc_dir: what ``spawn`` made (the client closes them).
        tokenizer: the API process's tokenizer, or None (``skip_tokenizer_init``).
        heartbeat_timeout_s: silence after which the core counts as dead (it is then killed).
        metrics: optional ``jaxpaged.metrics.ServerMetrics`` fed from each step's outputs.
        client_index: this API process's index among the core's clients (``connect``).
        owns_core: whether this client started the core (``spawn``), and so stops it.
    """

    def __init__(
        self,
        connection: CoreConnection,
        *,
        context,
        output_socket,
        ipc_dir: str,
        tokenizer,
        heartbeat_timeout_s: float,
        metrics=None,
        client_index: int = 0,
        owns_core: bool = True,
    ):
        self.core = connection
        self.client_index = client_index
        self.owns_core = owns_core
        # Called with a request's id when this client forgets it (finished, aborted or lost
        # with a dead core): the data-parallel client's balancer counts outstanding requests.
        self.on_forget: Callable[[str], None] | None = None
        self.tokenizer = tokenizer
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.metrics = metrics
        self.dead_error: str | None = None
        self.num_steps = 0  # steps whose outputs arrived
        # The core's stats after the last step whose outputs arrived (None before the first).
        self.last_stats: dict | None = None
        self._context = context
        self._output = output_socket
        self._ipc_dir = ipc_dir
        self._requests: dict[str, tuple[ClientRequestState, RequestStream]] = {}
        self._acks: dict[str, asyncio.Future] = {}
        self._utility: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self.loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------------- lifecycle
    @classmethod
    def spawn(
        cls,
        engine_args,
        *,
        tokenizer=None,
        max_num_queued_requests: int | None = None,
        core_class: str = "jaxpaged.engine.core:EngineCore",
        heartbeat_timeout_s: float = 10.0,
        metrics=None,
        cuda_visible_devices: str | None = None,
    ) -> EngineCoreClient:
        """Start the core process and wait (blocking) until its engine is built.

        Args:
            engine_args: ``EngineArgs`` of the engine the core builds.
            cuda_visible_devices: the core's GPUs (``run_engine_core``); None: all.
            max_num_queued_requests: the core's bound on waiting requests (429 beyond).
            core_class: ``module:Class`` of the core (tests give an ``EngineCore`` subclass).

        Raises:
            ValueError: ``max_num_queued_requests`` or ``heartbeat_timeout_s`` out of range.
            RuntimeError: the core failed to build its engine (its message) or exited.
        """
        if not heartbeat_timeout_s > 0:
            raise ValueError(f"heartbeat_timeout_s must be > 0, got {heartbeat_timeout_s}")
        started = start_core_process(
            engine_args,
            core_class=core_class,
            max_num_queued_requests=max_num_queued_requests,
            cuda_visible_devices=cuda_visible_devices,
        )
        input_socket, context, output_socket = client_sockets(
            started.input_address, started.output_addresses[0]
        )
        connection = CoreConnection(
            0, started.process, input_socket, started.info, status_pipe=started.status_pipe
        )
        return cls(
            connection,
            context=context,
            output_socket=output_socket,
            ipc_dir=started.ipc_dir,
            tokenizer=tokenizer,
            heartbeat_timeout_s=heartbeat_timeout_s,
            metrics=metrics,
        )

    @classmethod
    def connect(
        cls,
        *,
        input_address: str,
        output_address: str,
        info: dict,
        client_index: int,
        tokenizer=None,
        heartbeat_timeout_s: float = 10.0,
    ) -> EngineCoreClient:
        """A client of a core another process started (``start_core_process``), as API
        process ``client_index`` of several (``--api-server-count``).

        Args:
            input_address / output_address: the core's input address and this client's
                output address (``StartedCore``).
            info: the core's ``EngineCore.info()`` (its ``pid`` is watched).

        Raises:
            ValueError: ``client_index`` < 0 or ``heartbeat_timeout_s`` <= 0.
            ProcessLookupError: the core is already gone.
        """
        if client_index < 0:
            raise ValueError(f"client_index must be >= 0, got {client_index}")
        if not heartbeat_timeout_s > 0:
            raise ValueError(f"heartbeat_timeout_s must be > 0, got {heartbeat_timeout_s}")
        process = RemoteCoreProcess(info["pid"])
        input_socket, context, output_socket = client_sockets(input_address, output_address)
        return cls(
            CoreConnection(0, process, input_socket, info),
            context=context,
            output_socket=output_socket,
            ipc_dir="",
            tokenizer=tokenizer,
            heartbeat_timeout_s=heartbeat_timeout_s,
            client_index=client_index,
            owns_core=False,
        )

    def attach_metrics(self, make_metrics: Callable[[int], ServerMetrics]) -> list[ServerMetrics]:
        """Feed ``make_metrics(0)`` (engine index 0) from every step; returns it in a list."""
        self.metrics = make_metrics(0)
        return [self.metrics]

    @property
    def info(self) -> dict:
        """``EngineCore.info()``: max_model_len, vocab_size, max_logprobs, num_blocks, ..."""
        return self.core.info

    async def start(self) -> None:
        """Start the receive and watch tasks on the running loop (``self.loop``)."""
        self.loop = asyncio.get_running_loop()
        self.core.last_seen = time.monotonic()
        self._tasks = [
            asyncio.create_task(self._receive(), name="jaxpaged-core-receive"),
            asyncio.create_task(self._watch(), name="jaxpaged-core-watch"),
        ]

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the core (after its current step; only if this client owns it) and the tasks;
        open streams fail."""
        process = self.core.process
        if not self.owns_core:
            self._die("the API server was shut down", expected=True)
            for task in self._tasks:
                task.cancel()
            self.core.close()
            process.close()
            self._output.close()
            return
        if process.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                self.core.send(Kind.SHUTDOWN, None)
            await asyncio.to_thread(process.join, timeout)
            if process.is_alive():
                process.kill()
                await asyncio.to_thread(process.join, 5)
        self._die("the engine core was shut down", expected=True)
        for task in self._tasks:
            task.cancel()
        self.core.close()
        self._output.close()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    def engine_health(self) -> list[bool]:
        """Per engine index (one here): alive."""
        return [not self.is_dead]

    # ------------------------------------------------------------------------- requests
    async def add_request(
        self,
        request_id: str,
        prompt: dict,
        params: SamplingParams | BeamSearchParams,
        *,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Send a tokenized request to the core; return its stream once the core accepted it.

        Args:
            prompt: ``{"prompt_token_ids": [...], "prompt": text or None}``.
            lora_request: the LoRA adapter to run with (None: the base model); the core
                registers it on first use.

        Raises:
            ValueError: the core refused the prompt or parameters (400).
            QueueFullError: the core's waiting queue is at ``max_num_queued_requests`` (429).
            EngineDeadError: the core is dead (or dies before answering).
        """
        self._check_alive()
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        ids = list(prompt["prompt_token_ids"])
        # The core checks these too; checking them here also keeps an id that no message can
        # carry (JSON allows any integer: 2**70 fails msgpack's encode) from becoming a 500.
        check_prompt_vocab(ids, self.info["vocab_size"])
        if isinstance(params, BeamSearchParams):  # the core checks it; its beams come at the end
            state_params = beam_search_view(params)
        else:
            verify_for_model(
                params, vocab_size=self.info["vocab_size"], max_logprobs=self.info["max_logprobs"]
            )
            state_params = params
        state = ClientRequestState(
            request_id, prompt.get("prompt"), ids, state_params, self.tokenizer
        )
        stream = RequestStream(request_id, self)
        accepted = asyncio.get_running_loop().create_future()
        self._acks[request_id] = accepted
        self._requests[request_id] = (state, stream)
        self.core.outstanding.add(request_id)
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        wire = [
            request_id,
            ids,
            params_to_wire(params),
            arrival_time,
            lora_to_wire(lora_request),
            self.client_index,
        ]
        # Before the send: the receive task may read the ack and the first step's outputs
        # before this coroutine resumes, and those outputs must count.
        if self.metrics is not None:
            self.metrics.observe_added(request_id, arrival_time)
        try:
            self.core.send(Kind.ADD, wire)
            await accepted
        except asyncio.CancelledError:
            if self.metrics is not None:
                self.metrics.forget(request_id)
            self.abort(request_id)  # the add is ahead of the abort in the core's queue
            raise
        except BaseException:
            if self.metrics is not None:
                self.metrics.forget(request_id)
            self._forget(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Forget the request here and abort it in the core (no-op if unknown)."""
        if self._forget(request_id) is None or self.is_dead:
            return
        with contextlib.suppress(zmq.ZMQError):
            self.core.send(Kind.ABORT, [self.client_index, [request_id]])
        if self.metrics is not None:
            self.metrics.observe_aborted(request_id)

    def _forget(self, request_id: str):
        self.core.outstanding.discard(request_id)
        self._acks.pop(request_id, None)
        forgotten = self._requests.pop(request_id, None)
        if forgotten is not None and self.on_forget is not None:
            self.on_forget(request_id)
        return forgotten

    async def call_utility(self, name: str, *args, timeout: float = 30.0):
        """Call ``EngineCore.<name>(*args)`` in the core (between steps) and return the result.

        Raises:
            RuntimeError: the call failed in the core (its message).
            EngineDeadError: the core is dead.
            TimeoutError: no answer within ``timeout`` seconds.
        """
        self._check_alive()
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._utility[call_id] = future
        self.core.send(Kind.UTILITY, [self.client_index, call_id, name, list(args)])
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            self._utility.pop(call_id, None)

    async def get_stats(self) -> dict:
        """The core's ``EngineCore.get_stats()``."""
        return await self.call_utility("get_stats")

    # ------------------------------------------------------------------------------ LoRA
    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register an adapter in the core between steps (vLLM's ``AsyncLLM.add_lora``);
        False if it is already registered.

        Raises:
            ValueError: the core refused it (LoRA off, id or name taken, a bad adapter).
        """
        try:
            return await self.call_utility("add_lora", lora_to_wire(lora_request))
        except RuntimeError as error:
            prefix = f"{ValueError.__name__}: "
            message = str(error)
            if isinstance(error, EngineDeadError) or not message.startswith(prefix):
                raise
            raise ValueError(message[len(prefix) :]) from None

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Unregister an adapter in the core (vLLM's ``AsyncLLM.remove_lora``); False if
        unknown."""
        return await self.call_utility("remove_lora", lora_int_id)

    async def list_loras(self) -> set[int]:
        """Ids of the adapters registered in the core (vLLM's ``AsyncLLM.list_loras``)."""
        return set(await self.call_utility("list_loras"))

    # ------------------------------------------------------------------------ sleep mode
    async def sleep(self, level: int = 1) -> None:
        """Put the core's engine to sleep (``LLMEngine.sleep``) between its steps.

        Raises:
            ValueError: no enable_sleep_mode, or a bad level.
            RuntimeError: requests are unfinished (or the core died).
        """
        await self._call_raising_value_errors("sleep", int(level))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake the core's engine (``LLMEngine.wake_up``; not sleeping: a no-op).

        Raises:
            ValueError: no enable_sleep_mode, or an unknown tag.
        """
        await self._call_raising_value_errors("wake_up", tags)

    async def is_sleeping(self) -> bool:
        """``LLMEngine.is_sleeping`` of the core's engine."""
        return bool(await self.call_utility("is_sleeping"))

    async def _call_raising_value_errors(self, name: str, *args):
        """``call_utility``, with the core's ``ValueError`` raised as one (bad input) and its
        other failures as ``RuntimeError`` s."""
        try:
            return await self.call_utility(name, *args)
        except RuntimeError as error:
            prefix, message = f"{ValueError.__name__}: ", str(error)
            if isinstance(error, EngineDeadError) or not message.startswith(prefix):
                raise
            raise ValueError(message[len(prefix) :]) from None

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine core has died: {self.dead_error}")

    # ------------------------------------------------------------------- receive and watch
    async def _receive(self) -> None:
        while True:
            frame = await self._output.recv(copy=False)
            self.core.last_seen = time.monotonic()
            kind, payload = decode(frame.buffer)
            if kind is Kind.OUTPUTS:
                self._on_outputs(*payload)
            elif kind is Kind.STATS:
                self.last_stats = payload
                self._observe_engine(payload)
            elif kind is Kind.ACKS:
                for request_id, error in payload:
                    future = self._acks.pop(request_id, None)
                    if future is None or future.done():
                        continue
                    if error is None:
                        future.set_result(None)
                    else:
                        future.set_exception(_rebuild_error(*error))
            elif kind is Kind.UTILITY:
                call_id, result, error = payload
                future = self._utility.get(call_id)
                if future is not None and not future.done():
                    if error is None:
                        future.set_result(result)
                    else:
                        future.set_exception(RuntimeError(error))
            elif kind is Kind.DEAD:
                self._die(payload)

    def _on_outputs(self, outputs: list, stats: dict) -> None:
        now = time.monotonic()
        self.num_steps += 1
        self.last_stats = stats
        delivered = []
        for wire in outputs:
            delta = decode_output(wire)
            entry = self._requests.get(delta.request_id)
            if entry is None:
                continue  # aborted here already
            state, stream = entry
            output = state.update(delta)
            stream._put(output)
            delivered.append(output)
            if state.finished:
                if state.needs_core_abort:
                    self.core.send(Kind.ABORT, [self.client_index, [delta.request_id]])
                self._forget(delta.request_id)
        if self.metrics is not None:
            self.metrics.observe_step(
                scheduler_stats(stats), delivered, stats["step_start"], now, stats["scheduled"]
            )
            self._observe_lora(stats)

    def _observe_engine(self, stats: dict) -> None:
        """The engine's gauges and counters from a ``stats`` message (no step: no tokens)."""
        if self.metrics is not None and self.metrics.observes_engine:
            self.metrics.observe_engine_state(scheduler_stats(stats))
            self._observe_lora(stats)

    def _observe_lora(self, stats: dict) -> None:
        if "running_lora_adapters" in stats:  # jaxpaged.lora.metrics.lora_stats
            self.metrics.observe_lora_adapters(
                stats["running_lora_adapters"], stats["waiting_lora_adapters"]
            )

    async def _watch(self) -> None:
        process = self.core.process
        while self.dead_error is None:
            await asyncio.sleep(_WATCH_INTERVAL_S)
            if not process.is_alive():
                # The core flushed its sends before exiting: let the receive task read them in
                # order (acks before outputs before "dead"), then take the reason it left on its
                # status pipe (the only one left by a core killed mid-send).
                await self._drain_output()
                self._die(self.core.exit_reason())
            elif time.monotonic() - self.core.last_seen > self.heartbeat_timeout_s:
                self._die(f"the engine core did not answer for {self.heartbeat_timeout_s} s")
                process.kill()

    async def _drain_output(self) -> None:
        """Wait (up to ``_DRAIN_TIMEOUT_S``) until the receive task has read every message
        waiting on the output socket, seen empty twice ``_WATCH_INTERVAL_S`` apart."""
        deadline = time.monotonic() + _DRAIN_TIMEOUT_S
        empty_checks = 0
        while self.dead_error is None and empty_checks < 2 and time.monotonic() < deadline:
            pending = self._output.getsockopt(zmq.EVENTS) & zmq.POLLIN
            empty_checks = 0 if pending else empty_checks + 1
            await asyncio.sleep(_WATCH_INTERVAL_S / 2 if pending else _WATCH_INTERVAL_S)

    def _die(self, message: str, *, expected: bool = False) -> None:
        if self.dead_error is not None:
            return
        self.dead_error = message
        if not expected:
            logger.error("engine core died: %s", message)
        dead = EngineDeadError(f"the engine core has died: {message}")
        for future in [*self._acks.values(), *self._utility.values()]:
            if not future.done():
                future.set_exception(dead)
        for request_id, (_, stream) in self._requests.items():
            stream._put(dead)
            if self.on_forget is not None:
                self.on_forget(request_id)
        self._acks.clear()
        self._requests.clear()
        self.core.outstanding.clear()


class RequestRefusedError(ValueError):
    """The core refused a request's prompt or parameters (HTTP 400); ``parameter`` names the
    field when the core's error did (``SamplingParamsError``)."""

    def __init__(self, message: str, parameter: str | None = None):
        super().__init__(message)
        self.parameter = parameter


def _rebuild_error(name: str, message: str, parameter: str | None) -> Exception:
    """The core's refusal as the exception the server maps to a status (400, 429, or 503 for
    a sleeping engine)."""
    if name == QueueFullError.__name__:
        return QueueFullError(message)
    if name == EngineSleepingError.__name__:
        return EngineSleepingError(message)
    return RequestRefusedError(message, parameter)


def beam_search_view(params: BeamSearchParams) -> SamplingParams:
    """The ``SamplingParams`` the API process's output state reads for a beam search: one
    completion per beam, sent once at the end, detokenized without special tokens (its
    temperature is never used here)."""
    return SamplingParams(
        n=params.beam_width,
        max_tokens=params.max_tokens,
        ignore_eos=params.ignore_eos,
        include_stop_str_in_output=params.include_stop_str_in_output,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
