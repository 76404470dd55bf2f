"""The engine-core process: an ``LLMEngine`` stepped without pause, fed and drained over ZMQ.

vLLM v1's ``EngineCoreProc`` (``vllm/v1/engine/core.py``) in our terms. The loop::

    while True:
        take every waiting message (block only while no request is unfinished)
        apply adds (each acked: accepted, or the error that refused it), aborts, utility calls
        with a step in flight (async scheduling): go on taking messages until just before it
            ends (late scheduling, ``engine_core/admission.py``), so arrivals join the next step
        step the engine once, send the step's outputs and the engine's stats

Requests arrive tokenized and outputs leave as token ids (``core_messages``): the core never
detokenizes and never looks for stop strings, so its engine is built without a tokenizer.
Every request runs in DELTA mode (``best_of > n`` in FINAL_ONLY: its ranking is only final),
and the engine steps with ``token_deltas=True``: its outputs are token deltas (``engine/deltas.py``),
sent as they are and built from the sequences that advanced, at about the host cost of an offline step.

Clients: one core serves ``num_clients`` API processes (``--api-server-count``; vLLM's
``client_index``). Every client connects to the core's one input socket and binds an output
socket of its own; adds carry the client's index, and the core sends a request's acks and
outputs only to the client that added it, answers a utility call to its caller, and applies a
client's aborts only to that client's requests. Client 0 receives a message after every step
(it keeps the engine-level metrics: gauges, preemptions, prefix-cache counters); another client
only after steps with news for it.

Liveness: a thread sends a heartbeat to every client every ``HEARTBEAT_INTERVAL_S`` and ends the
process when its parent is gone. An exception in the loop is sent as a ``dead`` message to every
client, then the process exits with status 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import logging
import os
import signal
import threading
import time

import zmq

from jaxpaged.engine.deltas import delta_finished
from jaxpaged.engine_core.admission import AdmissionWindow
from jaxpaged.engine_core.core_messages import (
    HEARTBEAT_INTERVAL_S,
    Kind,
    decode,
    encode,
    lora_from_wire,
    params_from_wire,
)
from jaxpaged.lora.metrics import lora_stats
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams
from jaxpaged.sequence import EngineSleepingError, PromptError, is_token_id_list
from jaxpaged.structured_output.compiler import GrammarCompilerBusy

logger = logging.getLogger(__name__)

# How long an idle core waits for a message before looking again (milliseconds); while
# requests wait only for their grammar, it looks for compiled grammars this often.
_IDLE_POLL_MS = 100
_GRAMMAR_POLL_MS = 2

# ``EngineCore.add_request``'s answer for a request waiting for its grammar: its ack follows
# from ``grammar_acks`` once the grammar is compiled (or refused).
ACK_DEFERRED = ["deferred"]


class QueueFullError(RuntimeError):
    """The waiting queue already holds ``max_num_queued_requests`` requests (HTTP 429)."""


class EngineCore:
    """One ``LLMEngine`` and the bookkeeping of the core loop (no sockets: testable in-process).

    Args:
        engine: a built ``LLMEngine`` (its tokenizer is unused: requests come tokenized).
        max_num_queued_requests: most requests that may wait in the scheduler's queue; an add
            beyond it is refused with ``QueueFullError`` (HTTP 429). None: unbounded (vLLM).
        num_clients: API processes served, >= 1; each request belongs to the client that
            added it (``client_index`` in ``[0, num_clients)``).

    Raises:
        ValueError: ``num_clients`` < 1.
    """

    # Methods the API process may call by name (``utility`` messages); subclasses may add.
    UTILITY_METHODS = (
        "get_stats",
        "reset_prefix_cache",
        "check_idle",
        "add_lora",
        "remove_lora",
        "list_loras",
        "sleep",
        "wake_up",
        "is_sleeping",
    )

    # Take arrivals until just before the step in flight ends (engine_core/admission.py); a
    # subclass may turn it off (scripts/trace_request_life.py compares both).
    late_scheduling = True

    def __init__(self, engine, *, max_num_queued_requests: int | None = None, num_clients: int = 1):
        if num_clients < 1:
            raise ValueError(f"num_clients must be at least 1, got {num_clients}")
        self.engine = engine
        self.max_num_queued_requests = max_num_queued_requests
        self.num_clients = num_clients
        self.num_steps = 0
        # When to schedule the next step under async scheduling (engine_core/admission.py).
        self.admission = AdmissionWindow()
        self._seen_running: set[str] = set()
        # request id -> index of the client that added it (only with several clients).
        self._client_of: dict[str, int] = {}
        # request id -> client index, of adds whose ack waits for their grammar.
        self._deferred_acks: dict[str, int] = {}

    def info(self) -> dict:
        """What the API process needs to know about this engine (sent once, when ready)."""
        engine = self.engine
        return {
            "max_model_len": engine.config.scheduler_config.max_model_len,
            "vocab_size": engine.vocab_size,
            "max_logprobs": engine.config.model_config.max_logprobs,
            "num_blocks": engine.num_blocks,
            "eos_token_id": engine.eos_token_id,
            # Device LoRA slots; None: the engine was built without enable_lora.
            "max_loras": None if engine.lora_manager is None else engine.lora_manager.max_loras,
            "pid": os.getpid(),
        }

    def add_request(
        self,
        request_id: str,
        prompt_token_ids,
        params: dict,
        arrival_time: float,
        lora: list | None = None,
        client_index: int = 0,
    ):
        """Admit one tokenized request; returns None, ``[class name, message, parameter]``
        of the error that refused it (the API process re-raises it), or ``ACK_DEFERRED`` for
        a request waiting for its grammar (``grammar_acks`` answers it later, so a refused
        grammar is still an error to the API process). ``lora``: the adapter
        (``core_messages.lora_to_wire``), None for the base model; ``client_index``: the API
        process that owns it (its outputs go there)."""
        try:
            limit = self.max_num_queued_requests
            waiting = self.engine.scheduler.num_waiting + self.engine.num_waiting_for_grammar
            if limit is not None and waiting >= limit:
                raise QueueFullError(
                    f"the waiting queue is full: {waiting} requests wait and "
                    f"max_num_queued_requests is {limit}; retry later"
                )
            sampling = params_from_wire(params)  # built (and validated) once
            if isinstance(sampling, SamplingParams):  # (a beam search is final-only)
                # Stop strings are the API process's (it has the text): checked, then dropped.
                sampling.stop = []
                sampling.output_kind = RequestOutputKind.DELTA
                if (sampling.best_of or sampling.n) > sampling.n:
                    sampling.output_kind = RequestOutputKind.FINAL_ONLY  # ranked at the end
            ids = prompt_token_ids
            if not is_token_id_list(ids):  # msgpack gives ints: coerce anything else, as before
                try:
                    ids = [int(t) for t in ids]
                except (TypeError, ValueError, OverflowError) as error:  # int(inf) overflows
                    raise PromptError(f"prompt token ids must be integers: {error}") from None
            self.engine.add_request(
                request_id,
                {"prompt_token_ids": ids},
                sampling,
                arrival_time=arrival_time,
                lora_request=lora_from_wire(lora),
                wait_for_grammar=False,
            )
        except (ValueError, QueueFullError, EngineSleepingError, GrammarCompilerBusy) as error:
            return _wire_error(error)
        if self.num_clients > 1:
            self._client_of[request_id] = client_index
        if self.engine.is_waiting_for_grammar(request_id):
            self._deferred_acks[request_id] = client_index
            return ACK_DEFERRED
        return None

    def grammar_acks(self) -> list[tuple[int, list]]:
        """``(client_index, [request_id, None or error])`` for each deferred add whose grammar
        is now compiled (the request is scheduled) or refused (forgotten); never blocks."""
        acks = []
        for request_id, error in self.engine.admit_grammars():
            client = self._deferred_acks.pop(request_id, 0)
            if error is not None:
                self._client_of.pop(request_id, None)
            acks.append((client, [request_id, None if error is None else _wire_error(error)]))
        return acks

    def waiting_for_grammar(self) -> bool:
        """Whether requests wait (outside the scheduler) for their grammar."""
        return bool(self.engine.num_waiting_for_grammar)

    def abort_requests(self, request_ids, client_index: int | None = None) -> None:
        """Abort ``request_ids``; given ``client_index``, only those that client owns (a client
        never touches another's requests, even one that reused an id)."""
        for request_id in request_ids:
            if client_index is not None and self.num_clients > 1:
                if self._client_of.get(request_id) != client_index:
                    continue
            self.engine.abort_request(request_id)
            self._seen_running.discard(request_id)
            self._client_of.pop(request_id, None)
            self._deferred_acks.pop(request_id, None)

    def client_of(self, request_id: str) -> int:
        """Index of the client that added ``request_id`` (0 with one client, or if unknown)."""
        return self._client_of.get(request_id, 0)

    def has_work(self) -> bool:
        """Whether a step has something to do (requests waiting only for their grammar give
        it nothing)."""
        engine = self.engine
        return engine.get_num_unfinished_requests() > engine.num_waiting_for_grammar

    def next_step_deadline(self) -> float | None:
        """``time.monotonic()`` until which the loop may take arrivals before calling ``step``
        (late scheduling, ``engine_core/admission.py``); None: call it at once. Waiting helps only
        with a step in flight (async scheduling), nothing queued or swapped out and a free
        seat: only then could a request arriving now join the next step."""
        if not self.late_scheduling or not self.engine.async_scheduling:
            return None
        scheduler = self.engine.scheduler
        if scheduler.num_waiting or scheduler.num_swapped:
            return None
        if scheduler.num_running >= scheduler.max_num_seqs:
            return None
        if self.engine.step_in_flight_done() is not False:
            return None
        return self.admission.deadline()

    def running_step_done(self, now: float) -> bool:
        """Whether the step in flight (if any) is done on the device; never blocks."""
        done = self.engine.step_in_flight_done()
        if done:
            self.admission.observe_finished(now)
        return done is not False

    def step(self) -> list:
        """One engine step: ``[token deltas, stats]`` (``core_messages`` ``outputs``)."""
        step_start = time.monotonic()
        outputs = self.engine.step(token_deltas=True)
        self.admission.observe(self.engine.step_times)
        self.num_steps += 1
        scheduled = []
        for group in self.engine.scheduler.running:
            if group.request_id not in self._seen_running:
                self._seen_running.add(group.request_id)
                scheduled.append(group.request_id)
        for wire in outputs:  # engine/deltas.py: full or short
            if delta_finished(wire):
                self._seen_running.discard(wire[0])
        stats = self.get_stats()
        stats["scheduled"] = scheduled
        stats["step_start"] = step_start
        return [outputs, stats]

    def route(self, step: list) -> list[tuple[int, list]]:
        """Split ``step()``'s ``[outputs, stats]`` by owning client: ``(client_index,
        [outputs, stats])`` pairs, each client's own outputs and ``scheduled`` ids. Client 0
        always gets one (its metrics follow the engine's state after every step); another
        client only when it has outputs or newly scheduled requests. Finished requests are
        forgotten here."""
        outputs, stats = step
        if self.num_clients == 1:
            return [(0, step)]
        client_of = self._client_of
        per_client: dict[int, tuple[list, list]] = {0: ([], [])}
        for wire in outputs:  # engine/deltas.py: full or short
            request_id = wire[0]
            client = client_of.get(request_id, 0)
            if delta_finished(wire):
                client_of.pop(request_id, None)
            per_client.setdefault(client, ([], []))[0].append(wire)
        for request_id in stats["scheduled"]:
            per_client.setdefault(client_of.get(request_id, 0), ([], []))[1].append(request_id)
        return [
            (client, [client_outputs, stats | {"scheduled": scheduled}])
            for client, (client_outputs, scheduled) in sorted(per_client.items())
        ]

    # ------------------------------------------------------------------------ utilities
    def get_stats(self) -> dict:
        """``LLMEngine.get_stats()`` as a dict, plus ``num_steps``, ``num_unfinished_requests``
        and ``num_free_blocks`` (device blocks neither referenced nor cached-evictable-in-use)."""
        stats = dataclasses.asdict(self.engine.get_stats())
        stats["num_steps"] = self.num_steps
        stats["num_unfinished_requests"] = self.engine.get_num_unfinished_requests()
        stats["num_free_blocks"] = self.engine.kv_cache_manager.num_free_blocks
        if self.engine.lora_manager is not None:
            stats |= lora_stats(self.engine.scheduler, self.engine.lora_manager)
        return stats

    def add_lora(self, lora: list) -> bool:
        """``LLMEngine.add_lora`` of ``lora`` (``core_messages.lora_to_wire``): read and check
        the adapter; False if it is already registered.

        Raises:
            ValueError: LoRA is off, the id or name is taken, or the adapter is bad.
        """
        return self.engine.add_lora(lora_from_wire(lora))

    def remove_lora(self, lora_int_id: int) -> bool:
        """``LLMEngine.remove_lora``: False if unknown or LoRA is off."""
        return self.engine.remove_lora(int(lora_int_id))

    def list_loras(self) -> list[int]:
        """``LLMEngine.list_loras`` as a sorted list (msgpack has no sets)."""
        return sorted(self.engine.list_loras())

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def sleep(self, level: int = 1) -> bool:
        """``LLMEngine.sleep`` (server: dev-mode ``POST /sleep``); returns True.

        Raises:
            ValueError: no enable_sleep_mode, or a bad level.
            RuntimeError: requests are unfinished.
        """
        self.engine.sleep(int(level))
        return True

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """``LLMEngine.wake_up`` (server: dev-mode ``POST /wake_up``); returns True."""
        self.engine.wake_up(None if tags is None else [str(t) for t in tags])
        return True

    def is_sleeping(self) -> bool:
        """``LLMEngine.is_sleeping`` (server: dev-mode ``GET /is_sleeping``)."""
        return self.engine.is_sleeping()

    def check_idle(self) -> dict:
        """Stats after checking the block pool's invariants (raises if one is broken)."""
        self.engine.kv_cache_manager.check_invariants()
        return self.get_stats()

    def call_utility(self, name: str, args: list):
        if name not in self.UTILITY_METHODS:
            raise ValueError(f"{name!r} is not a utility of {type(self).__name__}")
        return getattr(self, name)(*args)


def freeze_gc_heap() -> None:
    """Collect once, then move every object alive now into CPython's permanent generation
    (``gc.freeze``): what a process builds at start-up (the engine, its scheduler, the
    tokenizer, the app) lives as long as the process, and a full collection then walks only
    what the serving loop allocated since. The served core and the API processes call it once
    they are ready, as vLLM's do."""
    gc.collect()
    gc.freeze()


def run_engine_core(
    engine_args,
    input_address: str,
    output_addresses: list[str],
    ready_pipe,
    *,
    core_class: str = "jaxpaged.engine_core.core:EngineCore",
    max_num_queued_requests: int | None = None,
    cuda_visible_devices: str | None = None,
) -> None:
    """The core process's target: build the engine, report ready, loop until shutdown.

    Args:
        engine_args: ``EngineArgs`` of the engine (its tokenizer is not loaded here).
        input_address: ZMQ address the core binds (PULL); every client connects a PUSH to it.
        output_addresses: one ZMQ address per client (index = ``client_index``), bound by that
            client (PULL); the core connects a PUSH to each. Connecting never waits for the
            peer: ZMQ queues what is sent until the client has bound its address.
        ready_pipe: a ``multiprocessing`` connection (the status pipe); receives the msgpack of
            ``EngineCore.info()`` once the engine is built, and a ``Kind.DEAD`` message naming
            the error if building or the loop fails. A pipe write is in the OS's buffer before
            ``os._exit``, unlike a ZMQ send still queued in its I/O thread, so the process that
            started the core always learns why it died.
        core_class: ``module:Class`` of the ``EngineCore`` (tests give a subclass).
        cuda_visible_devices: the GPUs this core may use, as indices into the ones the process
            sees (``"2,3"``; JAX's ``jax_cuda_visible_devices``); None: all of them.
    """
    # Ctrl-C reaches the whole process group: the core leaves when the process that started it
    # says so (a shutdown message), or when that process is gone (the heartbeat thread).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO)
    parent = os.getppid()
    try:
        if cuda_visible_devices is not None:  # data parallelism: this core's device group
            import jax

            jax.config.update("jax_cuda_visible_devices", cuda_visible_devices)
        from jaxpaged.engine.llm_engine import LLMEngine

        config = dataclasses.replace(engine_args, skip_tokenizer_init=True).create_engine_config()
        engine = LLMEngine(config)
        module, _, name = core_class.partition(":")
        cls = getattr(importlib.import_module(module), name)
        core = cls(
            engine,
            max_num_queued_requests=max_num_queued_requests,
            num_clients=len(output_addresses),
        )
    except BaseException as error:
        if isinstance(error, ValueError):  # the user's arguments or model: the message says it
            logger.error("engine core failed to start: %s", error)
        else:
            logger.exception("engine core failed to start")
        ready_pipe.send_bytes(encode(Kind.DEAD, f"{type(error).__name__}: {error}"))
        raise SystemExit(1) from error
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.setsockopt(zmq.RCVHWM, 0)
    inputs.bind(input_address)
    outputs = []
    for address in output_addresses:
        socket = context.socket(zmq.PUSH)
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.connect(address)
        outputs.append(socket)
    # The heartbeat has a context of its own, so that ours can be terminated (which flushes
    # what we sent) while the heartbeat thread still holds its sockets.
    threading.Thread(target=_heartbeat, args=(output_addresses, parent), daemon=True).start()
    freeze_gc_heap()
    ready_pipe.send_bytes(encode(Kind.ACKS, core.info()))
    try:
        _loop(core, inputs, outputs)
    except BaseException as error:
        logger.exception("engine core loop died")
        message = encode(Kind.DEAD, f"{type(error).__name__}: {error}")
        ready_pipe.send_bytes(message)  # reliable: read by the parent once we have exited
        for socket in outputs:
            socket.send(message)  # fast: read while the API processes wait for the exit
        _flush_and_exit(context, inputs, outputs, 1)
    _flush_and_exit(context, inputs, outputs, 0)


def _flush_and_exit(context, inputs, outputs, code: int) -> None:
    """Deliver what was sent (acks and outputs before a death too), for up to 2 s, then exit.

    ``socket.close(linger)`` only marks messages for delivery by ZMQ's I/O thread;
    ``context.term()`` waits for it. ``os._exit`` skips the daemon heartbeat thread.
    """
    inputs.close(linger=0)
    for socket in outputs:
        socket.close(linger=2000)
    context.term()
    os._exit(code)


def _loop(core: EngineCore, inputs, outputs: list) -> None:
    """Serve until a ``shutdown`` message; ``outputs[i]`` is client ``i``'s socket.

    Between two steps the loop takes every waiting message. With a step in flight (async
    scheduling) it keeps taking them until ``core.next_step_deadline()``, or until that step is
    done, so that a request arriving while step N runs is in step N + 1 (``engine_core/admission.py``).
    """
    poller = zmq.Poller()
    poller.register(inputs, zmq.POLLIN)
    while True:
        deadline = core.next_step_deadline()
        timeout = 0 if core.has_work() else _idle_poll_ms(core)
        while True:
            if not _take_messages(core, poller, inputs, outputs, timeout):
                return
            if deadline is None or not core.has_work():
                break
            now = time.monotonic()
            if now >= deadline or core.running_step_done(now):
                break
            if deadline - now < 0.001:  # zmq polls in whole milliseconds
                time.sleep(deadline - now)
                timeout = 0
            else:
                timeout = 1
        if core.has_work():
            for client, message in core.route(core.step()):
                outputs[client].send(encode(Kind.OUTPUTS, message))


def _take_messages(core: EngineCore, poller, inputs, outputs: list, timeout: int) -> bool:
    """Wait up to ``timeout`` ms for messages, apply every one waiting, send the acks; False
    on a ``shutdown`` message."""
    acks, aborts = [], []
    if poller.poll(timeout):
        while True:
            try:
                kind, payload = decode(inputs.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
            if kind is Kind.ADD:
                # payload: [request_id, ids, params, arrival_time, lora, client_index]
                answer = core.add_request(*payload)
                if answer is not ACK_DEFERRED:
                    acks.append((payload[5], [payload[0], answer]))
            elif kind is Kind.ABORT:
                aborts.append(payload)  # [client_index, [request_id, ...]]
            elif kind is Kind.UTILITY:
                client, call_id, name, args = payload
                try:
                    result, error = core.call_utility(name, args), None
                except Exception as failure:  # answered to the caller, the core lives on
                    result, error = None, f"{type(failure).__name__}: {failure}"
                outputs[client].send(encode(Kind.UTILITY, [call_id, result, error]))
            elif kind is Kind.SHUTDOWN:
                return False
    for client, request_ids in aborts:
        core.abort_requests(request_ids, client)
    acks += core.grammar_acks()
    if aborts and not core.has_work():  # no step follows: client 0's gauges need the news
        outputs[0].send(encode(Kind.STATS, core.get_stats()))
    if acks:
        if len(outputs) > 1:
            by_client: dict[int, list] = {}
            for client, ack in acks:
                by_client.setdefault(client, []).append(ack)
            for client, client_acks in by_client.items():
                outputs[client].send(encode(Kind.ACKS, client_acks))
        else:
            outputs[0].send(encode(Kind.ACKS, [ack for _, ack in acks]))
    return True


def _idle_poll_ms(core: EngineCore) -> int:
    """How long the loop waits for a message when no step is due."""
    return _GRAMMAR_POLL_MS if core.waiting_for_grammar() else _IDLE_POLL_MS


def _wire_error(error: Exception) -> list:
    """``[class name, message, parameter]``: a refusal as the API process re-raises it."""
    return [type(error).__name__, str(error), getattr(error, "parameter", None)]


def _heartbeat(addresses: list[str], parent: int) -> None:
    """Tell every client we live; leave when our parent is gone (we would be orphaned)."""
    context = zmq.Context()
    sockets = [context.socket(zmq.PUSH) for _ in addresses]
    for socket, address in zip(sockets, addresses, strict=True):
        socket.connect(address)
    frame = encode(Kind.HEARTBEAT, None)
    while True:
        if os.getppid() != parent:
            os._exit(0)
        for socket in sockets:
            # A client that is gone would fill its queue and block us: drop its beats instead.
            with contextlib.suppress(zmq.Again):
                socket.send(frame, zmq.NOBLOCK)
        time.sleep(HEARTBEAT_INTERVAL_S)
