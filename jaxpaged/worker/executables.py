"""``ExecutableTable``: the step executables by bucket, each got exactly once, on whichever thread
asks first; the rest of a warm start's buckets load on one background thread.

Getting an executable means lowering the step for its bucket and compiling it, which with a warm
persistent compilation cache (``compilation_cache.py``) is a disk load and deserialization instead
of an XLA compilation: about 0.7 s per bucket for an 8B model on an H200, 12.7 s for all 18. A warm
start gets the buckets of the first steps at start-up and the rest on a background thread
(``load_in_background``); a step whose bucket is not there yet waits for it if the background
thread is getting it, and gets it itself otherwise. A key is never got twice: the first asker
*claims* it (a ``Future`` other askers wait on).

Thread safety: lowering and compiling run concurrently on several threads already at start-up
(``ModelRunner.compile_all``); the compile function must use only arguments that no step
replaces or donates (``ModelRunner`` lowers against shape/dtype/sharding specs, not the live KV
cache). ``jax.no_tracing`` is per thread, so background lowering does not trip a test that
forbids tracing on the main thread.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Hashable, Iterable
from typing import Any

logger = logging.getLogger(__name__)


class ExecutableTable:
    """Executables by key, got by ``compile_fn(key)`` once each.

    Invariant: a key is in at most one of ``compiled`` (done) and the claims (being got, with a
    ``Future`` for other askers); ``num_compilations`` counts the ``compile_fn`` calls that
    succeeded.
    """

    def __init__(self, compile_fn: Callable[[Hashable], Any]):
        self._compile_fn = compile_fn
        self.compiled: dict[Hashable, Any] = {}
        self.num_compilations = 0
        self._claims: dict[Hashable, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._background_left = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self.compiled

    def get(self, key: Hashable) -> Any:
        """The executable of ``key``: at once when there, else waits for the thread getting it,
        else gets it on this thread (a failure raises here and leaves the key unclaimed)."""
        executable = self.compiled.get(key)
        if executable is not None:
            return executable
        future, mine = self._claim(key)
        if mine:
            return self._run(key, future)
        return future.result()

    def _claim(self, key: Hashable) -> tuple[concurrent.futures.Future | None, bool]:
        """``(future, True)``: this caller gets ``key``; ``(future, False)``: another thread
        does; ``(None, False)``: it is done."""
        with self._lock:
            if key in self.compiled:
                return None, False
            future = self._claims.get(key)
            if future is not None:
                return future, False
            future = self._claims[key] = concurrent.futures.Future()
            return future, True

    def _run(self, key: Hashable, future: concurrent.futures.Future) -> Any:
        try:
            executable = self._compile_fn(key)
        except BaseException as error:
            with self._lock:
                del self._claims[key]
            future.set_exception(error)
            raise
        with self._lock:
            self.compiled[key] = executable
            self.num_compilations += 1
            del self._claims[key]
        future.set_result(executable)
        return executable

    # ----------------------------------------------------------------------------- background
    def load_in_background(self, keys: Iterable[Hashable]) -> None:
        """Get ``keys`` in order on one daemon thread, skipping those already got or claimed.

        A key that fails is logged and left unclaimed (the step that needs it gets it again
        and sees the error). At interpreter exit the thread stops after its current key.
        """
        if self._thread is not None:
            raise RuntimeError("load_in_background was already called on this table")
        keys = list(keys)
        self._background_left = len(keys)
        stop = self._stop

        def at_exit() -> None:  # captures no table: a dropped engine can be collected
            stop.set()
            thread.join()

        def run() -> None:
            try:
                for key in keys:
                    if stop.is_set():
                        return
                    future, mine = self._claim(key)
                    if mine:
                        try:
                            self._run(key, future)
                        except Exception:
                            logger.exception("getting the step executable %s failed", key)
                    with self._lock:
                        self._background_left -= 1
            finally:
                atexit.unregister(at_exit)

        thread = threading.Thread(target=run, name="jaxpaged-step-executables", daemon=True)
        self._thread = thread
        atexit.register(at_exit)
        thread.start()

    @property
    def background_left(self) -> int:
        """Keys the background thread has not reached yet (0 without one)."""
        return self._background_left

    def wait(self) -> None:
        """Return once the background thread (if any) has got every key."""
        if self._thread is not None:
            self._thread.join()
