"""Rendering a client's chat template (the request's ``chat_template``) without trusting it.

A Jinja template is a program: ``{% for i in range(99999) %}{% for j in range(99999) %}`` is
150 bytes of CPU for hours, ``{{ "x" * 10**10 }}`` is 10 GB, and transformers'
``apply_chat_template`` runs either in the API process, holding its event loop. Here a client's
template runs in a separate worker process (this file run as a script: its imports are the
standard library and jinja2, nothing of jaxpaged), inside Jinja's
``ImmutableSandboxedEnvironment`` (no attribute escapes such as ``__class__``/``__globals__``,
no mutation of the inputs), with limits:

- time: the parent waits ``timeout_s`` for the answer, then kills the worker (and starts a new
  one on the next render);
- CPU: the worker runs at background priority (``nice`` 10), behind the API process;
- memory: the worker's address space is capped (``RLIMIT_AS``), so a blow-up fails there; a
  worker that ran out of memory, or holds more than ``recycle_rss_bytes`` after a render
  (Python keeps freed small objects' arenas: 1.5 GB stayed after one template), is replaced;
- output: rendering streams (``Template.generate``) and stops past ``max_output_chars``;
- ``range``: at most ``MAX_RANGE`` items (Jinja's own sandbox raises ``OverflowError``, a 500
  before this).

Every failure is a ``TemplateLimitError`` (a ``ValueError``: the server answers 400) naming the
limit. The template sees what transformers gives it: ``messages``, ``tools``, ``documents``,
``add_generation_prompt``, the tokenizer's special tokens and ``chat_template_kwargs``, with
transformers' helpers ``raise_exception``, ``strftime_now``, the ``tojson`` filter and the
``{% generation %}`` tag (``tokenization_utils_base.apply_chat_template``).

Renders have their own queue: ``num_workers`` worker processes, each driven by one thread of
the sandbox's own pool (never the event loop's default executor, which tokenizes long prompts:
twelve hostile templates there made a plain completion wait 13 s), and at most ``max_queued``
renders waiting for a worker. Past that, ``render_async`` refuses at once
(``TemplateQueueFullError``: the server answers 503 with ``Retry-After``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import queue
import select
import subprocess
import sys
import threading
import time

MAX_RANGE = 100_000
"""Most items a template's ``range()`` may produce."""
DEFAULT_TIMEOUT_S = 2.0
"""Wall-clock budget of one render, in seconds (transformers renders real templates in ms)."""
DEFAULT_MAX_OUTPUT_CHARS = 16 * 2**20
"""Longest rendered prompt, in characters (far beyond any context window's text)."""
WORKER_MEMORY_BYTES = 2 * 2**30
"""The worker's address-space cap."""
RECYCLE_RSS_BYTES = 256 * 2**20
"""A worker holding more than this after a render is replaced (an idle one holds ~25 MB)."""
DEFAULT_NUM_WORKERS = 2
"""Worker processes rendering at once."""
DEFAULT_MAX_QUEUED = 6
"""Renders that may wait for a worker; more are refused at once."""
_STARTUP_TIMEOUT_S = 60.0  # a fresh interpreter importing jinja2, on a loaded machine


class TemplateLimitError(ValueError):
    """A client's chat template failed, broke a limit or was refused; the message says which."""


class TemplateQueueFullError(RuntimeError):
    """Every worker is busy and ``max_queued`` renders already wait: try again later (the
    server's 503). Not the template's fault, so not a ``ValueError``."""


class TemplateSandbox:
    """Worker processes rendering client templates, each one render at a time (thread-safe).

    Args:
        num_workers: worker processes (and threads driving them), >= 1.
        max_queued: renders ``render_async`` lets wait for a worker, >= 0.
        timeout_s: wall-clock budget of one render once a worker runs it, > 0.
        max_output_chars: longest rendered text, >= 1.
        memory_bytes: each worker's address-space cap.
        recycle_rss_bytes: a worker resident above this after a render is replaced.

    Raises:
        ValueError: a limit out of its range.
    """

    def __init__(
        self,
        *,
        num_workers: int = DEFAULT_NUM_WORKERS,
        max_queued: int = DEFAULT_MAX_QUEUED,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
        memory_bytes: int = WORKER_MEMORY_BYTES,
        recycle_rss_bytes: int = RECYCLE_RSS_BYTES,
    ):
        if num_workers < 1 or max_queued < 0 or not timeout_s > 0 or max_output_chars < 1:
            raise ValueError(
                f"template sandbox limits out of range: num_workers {num_workers} (>= 1), "
                f"max_queued {max_queued} (>= 0), timeout_s {timeout_s} (> 0), "
                f"max_output_chars {max_output_chars} (>= 1)"
            )
        self.num_workers = num_workers
        self.max_queued = max_queued
        self.timeout_s = timeout_s
        self._workers = [
            _Worker(max_output_chars, memory_bytes, recycle_rss_bytes) for _ in range(num_workers)
        ]
        # Last in, first out: a burst of plain renders keeps reusing one warm worker.
        self._idle: queue.LifoQueue[_Worker] = queue.LifoQueue()
        for worker in self._workers:
            self._idle.put(worker)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            num_workers, thread_name_prefix="chat-template"
        )
        self._admitted = 0  # renders submitted to the pool and not done
        self._admitted_lock = threading.Lock()

    @property
    def num_admitted(self) -> int:
        """Renders running or waiting for a worker."""
        return self._admitted

    async def render_async(self, template: str, context: dict) -> str:
        """``render`` on the sandbox's own threads, or a refusal at once when
        ``num_workers + max_queued`` renders are already admitted.

        Raises:
            TemplateQueueFullError: the queue is full.
            TemplateLimitError: as ``render``.
        """
        with self._admitted_lock:
            if self._admitted >= self.num_workers + self.max_queued:
                raise TemplateQueueFullError(
                    f"{self._admitted} chat templates are rendering or waiting (the limit is "
                    f"{self.num_workers} rendering and {self.max_queued} waiting); retry later"
                )
            self._admitted += 1
        future = self._pool.submit(self.render, template, context)
        # Released when the render ends, not when its caller goes away (a cancelled caller's
        # render still holds a worker until its deadline).
        future.add_done_callback(self._release)
        return await asyncio.wrap_future(future)

    def _release(self, _future) -> None:
        with self._admitted_lock:
            self._admitted -= 1

    def render(self, template: str, context: dict) -> str:
        """``template`` rendered with ``context`` (JSON values) by the next free worker
        (blocking until one is free).

        Raises:
            TemplateLimitError: a template error, a limit broken (time, output, memory,
                range), or a context JSON cannot carry.
        """
        try:
            request = json.dumps({"template": template, "context": context}).encode() + b"\n"
        except (TypeError, ValueError, RecursionError) as error:
            raise TemplateLimitError(f"the chat template's inputs are not JSON: {error}") from None
        worker = self._idle.get()
        try:
            return worker.render(request, self.timeout_s)
        finally:
            self._idle.put(worker)

    def worker_pids(self) -> list[int]:
        """The process ids of the running workers (for monitoring and tests)."""
        return [pid for pid in (w.pid for w in self._workers) if pid is not None]

    def close(self) -> None:
        """Stop the workers; renders still queued fail."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        for worker in self._workers:
            worker.stop()


class _Worker:
    """One worker process and the pipe protocol to it: a JSON line in, a JSON line out."""

    def __init__(self, max_output_chars: int, memory_bytes: int, recycle_rss_bytes: int):
        self._argv = [
            sys.executable, "-I", os.path.abspath(__file__), str(max_output_chars),
            str(memory_bytes),
        ]  # fmt: skip
        self._memory_bytes = memory_bytes
        self._recycle_rss_bytes = recycle_rss_bytes
        self._lock = threading.Lock()  # render() vs stop() from close()
        self._process: subprocess.Popen | None = None
        self._pending = b""

    @property
    def pid(self) -> int | None:
        process = self._process
        return None if process is None or process.poll() is not None else process.pid

    def render(self, request: bytes, timeout_s: float) -> str:
        """The answer to ``request`` within ``timeout_s`` (the worker's start not counted).

        Raises:
            TemplateLimitError: the template's error, the time or memory limit.
        """
        with self._lock:
            process = self._start()
            deadline = time.monotonic() + timeout_s
            try:
                process.stdin.write(request)
                process.stdin.flush()
                line = self._read_line(process, deadline)
            except (BrokenPipeError, OSError):
                line = None
            if line is None:
                timed_out = time.monotonic() >= deadline
                self._stop()
                if timed_out:
                    raise TemplateLimitError(
                        f"the chat template ran longer than its {timeout_s:g} s budget"
                    )
                raise TemplateLimitError(
                    "the chat template's worker died (it ran out of its "
                    f"{self._memory_bytes / 2**30:g} GiB of memory)"
                )
            answer = json.loads(line)
            if answer.get("out_of_memory") or (answer.get("rss") or 0) > self._recycle_rss_bytes:
                self._stop()  # the next render starts a fresh worker
        if "error" in answer:
            raise TemplateLimitError(answer["error"])
        return answer["text"]

    def stop(self) -> None:
        with self._lock:
            self._stop()

    def _start(self) -> subprocess.Popen:
        """The running worker, started (and waited for: its start is not the template's
        time) if there is none.

        Raises:
            TemplateLimitError: the worker did not start.
        """
        if self._process is None or self._process.poll() is not None:
            self._process = subprocess.Popen(
                self._argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
            )
            self._pending = b""
            ready = self._read_line(self._process, time.monotonic() + _STARTUP_TIMEOUT_S)
            if ready is None:
                self._stop()
                raise TemplateLimitError("the chat-template worker process did not start")
        return self._process

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            for pipe in (self._process.stdin, self._process.stdout):
                pipe.close()
            self._process = None

    def _read_line(self, process: subprocess.Popen, deadline: float) -> bytes | None:
        """One answer line, or None when the deadline passes or the worker dies."""
        fd = process.stdout.fileno()
        while b"\n" not in self._pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return None
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line


# ------------------------------------------------------------------ the worker (a script)
def _worker_main(max_output_chars: int, memory_bytes: int) -> None:  # pragma: no cover
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    # A client's program at background priority: on a busy host the API process (HTTP,
    # tokenization, streaming) gets the CPU first.
    os.nice(10)
    environment = _environment()
    sys.stdout.write('{"ready": true}\n')
    sys.stdout.flush()
    for line in sys.stdin.buffer:
        request = json.loads(line)
        try:
            answer = {"text": _render(environment, request, max_output_chars)}
        except MemoryError:
            answer = {"error": "the chat template ran out of memory", "out_of_memory": True}
        except Exception as error:  # noqa: BLE001 - every failure is the client's template's
            answer = {"error": f"the chat template failed: {type(error).__name__}: {error}"}
        request = None  # noqa: F841 - freed before the resident size is read
        answer["rss"] = _resident_bytes()
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


def _resident_bytes() -> int | None:
    """This process's resident memory (Linux ``/proc``); None elsewhere."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _render(environment, request: dict, max_output_chars: int) -> str:
    template = environment.from_string(request["template"])
    parts, size = [], 0
    for part in template.generate(**request["context"]):
        size += len(part)
        if size > max_output_chars:
            raise ValueError(f"its output passed {max_output_chars} characters")
        parts.append(part)
    return "".join(parts)


def _environment():
    """transformers' chat-template environment, with ``range`` capped."""
    from datetime import datetime

    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body (transformers marks
        assistant tokens with it)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format):
        return datetime.now().strftime(format)

    def capped_range(*args):
        items = range(*args)
        if len(items) > MAX_RANGE:
            raise ValueError(f"range() of {len(items)} items; the limit is {MAX_RANGE}")
        return items

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationTag, jinja2.ext.loopcontrols],
    )
    environment.filters["tojson"] = tojson
    environment.globals.update(
        raise_exception=raise_exception, strftime_now=strftime_now, range=capped_range
    )
    return environment


if __name__ == "__main__":  # pragma: no cover - the worker process
    _worker_main(int(sys.argv[1]), int(sys.argv[2]))
