"""Several API processes in front of one engine core: ``jaxpaged serve --api-server-count N``.

vLLM's ``--api-server-count`` (``run_multi_api_server`` in ``vllm/entrypoints/cli/serve.py``) in
our terms. One Python process cannot tokenize, detokenize and stream SSE as fast as an H200
generates tokens, so N processes share that work. The process layout::

    parent (run_multi_api_server: no HTTP, no engine; binds the socket, starts and watches)
    ├── engine core         scheduler + worker + step loop (core.run_engine_core, N clients)
    ├── API server 0        FastAPI/uvicorn on the shared socket: HTTP, tokenization,
    ├── ...                 detokenization, stop strings, SSE; EngineCoreClient.connect(i)
    └── API server N-1

- One port: the parent binds and listens once; every API server accepts on that socket (the
  kernel hands each new connection to one of them), so clients see one address.
- Requests: each carries its API server's ``client_index``; the core sends its acks and outputs
  only to that server and applies a server's aborts only to its own requests (``core.py``).
- Metrics: ``jaxpaged serve`` exports ``PROMETHEUS_MULTIPROC_DIR`` (a fresh temporary directory,
  removed at the end; ``env.prometheus_multiproc_dir``) before the API servers start, and passes
  the directory here; ``/metrics`` on any of them renders all of their values (``jaxpaged.metrics``: per-request metrics summed, engine-level gauges and
  counters kept by API server 0 only).
- LoRA: ``--lora-modules`` adapters are loaded by every API server (the core registers each
  once); runtime ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` answer 400 naming
  ``--api-server-count`` (each process has its own adapter list).

Failures:

- The engine core dies: the parent logs why (its status pipe); the API servers stay up, so
  ``/health`` answers 503 and open streams end with an error, as with one API process. The
  parent waits for SIGINT/SIGTERM.
- An API server dies: the parent logs it with its exit code and shuts everything down (exit
  status 1), as vLLM does: the server is no longer whole, and its requests in the core have
  no reader; a supervisor restarts it.
- SIGINT/SIGTERM to the parent: the API servers get SIGTERM (uvicorn's graceful shutdown, at
  most ``_GRACE_S`` seconds), the core a shutdown message; whatever is left after the grace
  period is killed. Children whose parent has gone (killed with SIGKILL) leave by themselves:
  the core through its heartbeat thread, an API server through ``_leave_when_orphaned``.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from jaxpaged.engine_core.core import freeze_gc_heap
from jaxpaged.engine_core.core_messages import Kind, encode

logger = logging.getLogger(__name__)

# Seconds the API servers and the core get to leave on their own at shutdown before being killed.
_GRACE_S = 10.0
# How often an API server looks for its parent (seconds).
_ORPHAN_CHECK_S = 1.0


class _Stop(Exception):
    """SIGINT or SIGTERM reached the parent."""


def bind_server_socket(host: str | None, port: int) -> socket.socket:
    """A listening TCP socket on ``host`` (None: all interfaces) and ``port`` (0: any free
    port), inheritable, with ``SO_REUSEADDR`` (a restarted server need not wait for TIME_WAIT).

    Raises:
        OSError: the address is in use or cannot be bound.
    """
    host = host or "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # uvicorn's default backlog
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def run_multi_api_server(
    engine_args,
    config,
    *,
    multiprocess_metrics_dir: str,
    build_app: Callable[..., Any],
) -> int:
    """Serve ``engine_args`` with ``config.api_server_count`` API processes over one engine
    core until SIGINT/SIGTERM (0) or an API process dies (1); see the module docstring.

    Args:
        engine_args: ``EngineArgs`` of the engine core.
        config: the ``ServeConfig`` every API process serves (its ``host`` / ``port``,
            ``max_num_queued_requests`` for the core and ``uvicorn_log_level`` are read here).
        multiprocess_metrics_dir: an empty directory that ``PROMETHEUS_MULTIPROC_DIR`` names in
            this process's environment (the API processes inherit it and must see it before
            they import prometheus_client); its values are what ``/metrics`` renders.
        build_app: ``api_server.build_app``, the app factory each API process calls: given by
            the caller (a module-level function, pickled by name for the spawned processes) so
            that this module does not import ``api_server``, which imports it.

    Raises:
        ValueError: ``api_server_count`` < 2, or invalid engine arguments.
        OSError: the address cannot be bound.
        RuntimeError: the engine core failed to start.
    """
    from jaxpaged.engine_core.core_process import start_core_process

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    api_server_count = config.api_server_count
    if api_server_count < 2:
        raise ValueError(
            f"run_multi_api_server needs --api-server-count >= 2, got {api_server_count}"
        )
    model_config = engine_args.create_engine_config().model_config  # checks before any start
    sock = bind_server_socket(config.host, config.port)
    spawn = multiprocessing.get_context("spawn")
    servers: list[multiprocessing.Process] = []
    core = None
    # Our own handlers, also for SIGINT: a shell starts a background job with SIGINT ignored.
    previous = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        core = start_core_process(
            engine_args,
            num_clients=api_server_count,
            max_num_queued_requests=config.max_num_queued_requests,
        )
        logger.info("engine core ready (pid %d)", core.process.pid)
        tokenizer_path = None if model_config.skip_tokenizer_init else model_config.tokenizer
        for index in range(api_server_count):
            process = spawn.Process(
                target=run_api_server,
                args=(index, sock),
                kwargs=dict(
                    model=model_config.model,
                    tokenizer_path=tokenizer_path,
                    input_address=core.input_address,
                    output_address=core.output_addresses[index],
                    info=core.info,
                    metrics_dir=multiprocess_metrics_dir,
                    config=config,
                    parent_pid=os.getpid(),
                    build_app=build_app,
                ),
                name=f"jaxpaged-api-server-{index}",
            )
            process.start()
            servers.append(process)
            logger.info("API server %d started (pid %d)", index, process.pid)
        address = sock.getsockname()
        logger.info(
            "serving on http://%s:%d with %d API servers", address[0], address[1], len(servers)
        )
        return _watch(core, servers)
    except _Stop:
        logger.info("shutting down")
        return 0
    finally:
        for sig in previous:  # a second signal would interrupt the shutdown
            signal.signal(sig, signal.SIG_IGN)
        _shutdown(core, servers)
        sock.close()
        if core is not None:
            shutil.rmtree(core.ipc_dir, ignore_errors=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _raise_stop(signum, frame) -> None:
    raise _Stop


def _watch(core, servers: Sequence[multiprocessing.Process]) -> int:
    """Block until an API server exits (1); log the core's death and keep waiting."""
    watched = {process.sentinel: process for process in servers}
    watched[core.process.sentinel] = core.process
    while True:
        for sentinel in multiprocessing.connection.wait(list(watched)):
            process = watched.pop(sentinel)
            process.join(1)
            if process is core.process:
                logger.error(
                    "the engine core died (%s); the API servers answer /health with 503 "
                    "until the server is stopped",
                    _core_exit_reason(core),
                )
                continue
            logger.error(
                "%s (pid %d) exited with code %s; shutting the server down",
                process.name,
                process.pid,
                process.exitcode,
            )
            return 1


def _core_exit_reason(core) -> str:
    """The error the core left on its status pipe, else its exit code."""
    from jaxpaged.engine_core.core_process import death_message  # as start_core_process: on use

    return death_message(core.status_pipe) or f"exit code {core.process.exitcode}"


def _shutdown(core, servers: Sequence[multiprocessing.Process]) -> None:
    """SIGTERM to the API servers and a shutdown message to the core; kill what is left after
    ``_GRACE_S`` seconds."""
    for process in servers:
        if process.is_alive():
            process.terminate()
    if core is not None and core.process.is_alive():
        context = zmq.Context()
        control = context.socket(zmq.PUSH)
        control.connect(core.input_address)
        control.send(encode(Kind.SHUTDOWN, None))
        control.close(linger=1000)
        context.term()
    deadline = time.monotonic() + _GRACE_S
    for process in [*servers, *([core.process] if core is not None else [])]:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            logger.warning("%s (pid %d) did not stop; killing it", process.name, process.pid)
            process.kill()
            process.join(5)
    if core is not None:
        core.status_pipe.close()


def run_api_server(
    index: int,
    sock: socket.socket,
    *,
    model: str,
    tokenizer_path: str | None,
    input_address: str,
    output_address: str,
    info: dict,
    metrics_dir: str,
    config,
    parent_pid: int,
    build_app: Callable[..., Any],
) -> None:
    """One API process (spawned): its tokenizer, a client of the core as ``client_index``
    ``index``, and uvicorn serving the app that ``build_app`` makes of ``config`` (a
    ``ServeConfig``) on the shared ``sock`` until SIGTERM/SIGINT, or until ``parent_pid`` is no
    longer its parent."""
    # First: the parent may die while this process still loads.
    threading.Thread(target=_leave_when_orphaned, args=(parent_pid,), daemon=True).start()
    import uvicorn

    from jaxpaged.engine_core.core_client import EngineCoreClient

    tokenizer = None
    if tokenizer_path is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    client = EngineCoreClient.connect(
        input_address=input_address,
        output_address=output_address,
        info=info,
        client_index=index,
        tokenizer=tokenizer,
    )
    app = build_app(
        client,
        config,
        model=model,
        tokenizer=tokenizer,
        api_server_index=index,
        multiprocess_metrics_dir=metrics_dir,
    )
    server = uvicorn.Config(app, log_level=config.uvicorn_log_level, timeout_graceful_shutdown=5)
    freeze_gc_heap()  # the tokenizer and the app live as long as this process
    uvicorn.Server(server).run(sockets=[sock])


def _leave_when_orphaned(parent: int) -> None:
    """SIGTERM ourselves once ``parent`` is gone: uvicorn's graceful shutdown, or the default
    action (exit) before uvicorn has installed its handlers."""
    while os.getppid() == parent:
        time.sleep(_ORPHAN_CHECK_S)
    os.kill(os.getpid(), signal.SIGTERM)
