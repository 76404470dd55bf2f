"""Grammar compilation off the engine thread: worker threads, a time budget, and a cache bounded
by bytes.

Compiling a grammar against a tokenizer walks the whole vocabulary (tens of milliseconds for a
JSON schema on a 128k vocabulary; seconds to minutes for a hostile one), so the engine only
submits jobs here and looks at their futures between steps (``admission.py``); it never waits
for one.

- **Workers** run at a lower CPU priority than the engine thread (Linux: nice +10 on the
  worker thread; xgrammar's and llguidance's own threads inherit it), so compilation slows the
  engine as little as possible even on a machine with two cores.
- **Time budget.** A job's ``Compilation.started`` is when a worker picked it up; the caller
  decides when a job has run too long and calls ``abandon``: the job's thread cannot be stopped
  (the libraries have no cancellation), so a fresh worker takes its place and the old one exits
  when its job ends (its result is not kept). At most ``max_abandoned`` abandoned jobs may still be running; past that,
  ``submit`` refuses new work (``GrammarCompilerBusy``) rather than let hostile grammars take
  every core.
- **Threads** start on the first job and end after ``IDLE_EXIT_S`` without one, so an engine
  that sees no grammar holds none. At exit the process waits for running jobs (a library call
  still running when Python finalizes aborts the process), as ``concurrent.futures`` does.
- **Cache.** Equal constraints (``StructuredOutputsParams.cache_key``) share one compilation,
  whichever request asked first. Finished compilations are kept, least recently used dropped
  first, while their bytes (``sizeof`` of the result plus the key's text) stay within
  ``max_bytes``; one larger than that is used by the requests holding it but not kept. Failed
  compilations are not kept.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import logging
import os
import queue
import threading
import time
import weakref

logger = logging.getLogger(__name__)

# Worker threads' niceness (Linux): above the engine thread's 0, so a step wins the CPU.
WORKER_NICENESS = 10
# A worker with no job for this long ends (a new one starts with the next job).
IDLE_EXIT_S = 30.0
# Compilers whose workers must finish their jobs before the interpreter finalizes.
_LIVE: weakref.WeakSet = weakref.WeakSet()


class GrammarCompilerBusy(RuntimeError):
    """Too many compilations past their time budget are still running: the request is fine and
    may be sent again in a moment (the server's 503 with ``Retry-After``). Not a
    ``ValueError``: the client's input is not at fault."""


class Compilation(concurrent.futures.Future):
    """A submitted job's future, with when a worker started it (``time.monotonic()``; None
    while queued) and its bytes once kept in the cache."""

    def __init__(self, key: tuple):
        super().__init__()
        self.key = key
        self.started: float | None = None
        self.abandoned = False
        self.nbytes = 0


class GrammarCompiler:
    """Run compile jobs on worker threads; reuse their results by key within a byte budget.

    Args:
        sizeof: ``result -> bytes`` of a finished job's result.
        max_workers: worker threads (more are started only to replace abandoned jobs).
        max_bytes: bytes of finished results kept (keys' text included).
        max_abandoned: abandoned jobs that may still run before ``submit`` refuses work.
    """

    def __init__(
        self, sizeof, *, max_workers: int = 2, max_bytes: int = 512 << 20, max_abandoned: int = 2
    ):
        self._sizeof = sizeof
        self._max_workers = max_workers
        self._max_bytes = max_bytes
        self._max_abandoned = max_abandoned
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple, Compilation] = collections.OrderedDict()
        self._bytes = 0
        self._workers: list[threading.Thread] = []
        self._abandoned: set[Compilation] = set()
        self.num_compiled = 0  # jobs submitted (cache misses)
        self.num_running = 0  # jobs on a worker now (abandoned ones included)
        _LIVE.add(self)

    @property
    def cache_bytes(self) -> int:
        """Bytes of the compilations kept now."""
        return self._bytes

    @property
    def num_abandoned(self) -> int:
        """Abandoned jobs still running."""
        return len(self._abandoned)

    def submit(self, key: tuple, job) -> Compilation:
        """The compilation of ``key``: the cached one, or ``job()`` queued for a worker.

        Raises:
            GrammarCompilerBusy: ``max_abandoned`` abandoned jobs are still running.
        """
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            if len(self._abandoned) >= self._max_abandoned:
                raise GrammarCompilerBusy(
                    f"structured outputs: {len(self._abandoned)} grammar compilations past "
                    "their time budget are still running; retry later"
                )
            future = Compilation(key)
            self._cache[key] = future
            self.num_compiled += 1
            future.add_done_callback(self._finished)
            self._put(future, job)
        return future

    def run(self, job) -> Compilation:
        """``job()`` on a worker, outside the cache (the backend's warm-up)."""
        future = Compilation(())
        with self._lock:
            self._put(future, job)
        return future

    def _put(self, future: Compilation, job) -> None:
        """Queue a job (under the lock, which idle workers take to end: a queued job always
        has a worker)."""
        while len(self._workers) - len(self._abandoned) < self._max_workers:
            self._start_worker()
        self._queue.put((future, job))

    def abandon(self, future: Compilation) -> None:
        """Stop waiting for a running job: a new worker takes its place; the job runs on to
        its end and its result is dropped (not cached: the next request for it compiles
        anew, until ``max_abandoned`` makes ``submit`` refuse)."""
        with self._lock:
            if future.abandoned or future.done():
                return
            future.abandoned = True
            self._abandoned.add(future)
            if self._cache.get(future.key) is future:  # its result will not be kept
                del self._cache[future.key]
            self._start_worker()

    def _start_worker(self) -> None:
        thread = threading.Thread(
            target=self._work, name=f"jaxpaged-grammar-{len(self._workers)}", daemon=True
        )
        self._workers.append(thread)
        thread.start()

    def _work(self) -> None:
        _lower_priority()
        try:
            while True:
                try:
                    item = self._queue.get(timeout=IDLE_EXIT_S)
                except queue.Empty:
                    with self._lock:
                        if self._queue.empty():
                            return
                    continue
                if item is None:
                    return
                # Handed over in a list that _run empties: only _run's frame holds the job,
                # so neither an idle worker nor an ending one keeps its result alive.
                box, item = [item], None
                if self._run(box):
                    return
        finally:
            with self._lock:
                self._workers.remove(threading.current_thread())

    def _run(self, box: list) -> bool:
        """Run the job ``box`` holds (``[(future, job)]``, emptied) into its future; True when
        the job was abandoned (this worker's replacement is already working: it ends)."""
        future, job = box.pop()
        if not future.set_running_or_notify_cancel():
            return False
        future.started = time.monotonic()
        with self._lock:
            self.num_running += 1
        try:
            future.set_result(job())
        except BaseException as error:
            future.set_exception(error)
        finally:
            with self._lock:
                self.num_running -= 1
        return future.abandoned

    def _finished(self, future: Compilation) -> None:
        failed = future.cancelled() or future.exception() is not None
        if not failed:  # measured outside the lock: the engine thread may be submitting
            nbytes = self._sizeof(future.result())
            nbytes += sum(len(part) for part in future.key if isinstance(part, str))
        with self._lock:
            self._abandoned.discard(future)
            if self._cache.get(future.key) is not future:
                return  # evicted already, or never cached
            if failed or nbytes > self._max_bytes:  # the latter: used, not kept
                del self._cache[future.key]
                return
            future.nbytes = nbytes
            self._bytes += nbytes
            self._evict()

    def _evict(self) -> None:
        """Drop the least recently used finished compilations until within ``max_bytes``."""
        for key in list(self._cache):
            if self._bytes <= self._max_bytes:
                return
            future = self._cache[key]
            if future.done():
                del self._cache[key]
                self._bytes -= future.nbytes

    def shutdown(self, wait: bool = False) -> None:
        """Cancel queued jobs and let the workers end; ``wait``: until their running jobs are
        done (otherwise those finish in the background)."""
        with self._lock:
            workers = list(self._workers)
            queued = [f for f in self._cache.values() if not f.running() and not f.done()]
        for future in queued:
            future.cancel()
        for _ in workers:
            self._queue.put(None)
        if wait:
            for thread in workers:
                thread.join()


@atexit.register
def _finish_running_jobs() -> None:
    """Before the interpreter finalizes: let every worker finish its job and end."""
    for compiler in list(_LIVE):
        compiler.shutdown(wait=True)


def _lower_priority() -> None:
    """Raise this thread's niceness (Linux threads have their own); elsewhere, nothing."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICENESS)
    except (AttributeError, OSError):  # not Linux, or not permitted
        pass
