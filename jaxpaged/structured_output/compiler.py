"""Grammar compilation off the engine loop: a thread pool, and a cache by constraint key.

Compiling a grammar against a tokenizer walks the whole vocabulary (tens of milliseconds for a
JSON schema on a 128k vocabulary); the engine loop only submits and, when a request first
samples, picks up the result. Equal constraints (``StructuredOutputsParams.cache_key``: the
kind, its text and the JSON options) share one compiled grammar, whichever request asked
first. The cache keeps at most ``max_entries`` grammars, dropping the least recently used.
"""

from __future__ import annotations

import collections
import concurrent.futures


class GrammarCompiler:
    """Submit compilations to a thread pool; reuse them by key.

    Args:
        compile_fn: ``grammar -> compiled grammar`` (``XGrammarBackend.compile``).
        max_workers: compile threads.
        max_entries: compiled grammars kept (LRU).
    """

    def __init__(self, compile_fn, *, max_workers: int = 1, max_entries: int = 1024):
        self._compile = compile_fn
        self._pool = None
        self._max_workers = max_workers
        self._max_entries = max_entries
        self._cache: collections.OrderedDict[tuple, concurrent.futures.Future] = (
            collections.OrderedDict()
        )
        self.num_compiled = 0  # compilations submitted (cache misses)

    def submit(self, key: tuple, grammar) -> concurrent.futures.Future:
        """The future compiled grammar of ``key`` (compiling ``grammar`` on a miss)."""
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
            return future
        if self._pool is None:  # started on first use: engines without grammars hold no thread
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self._max_workers, thread_name_prefix="jaxpaged-grammar"
            )
        future = self._pool.submit(self._compile, grammar)
        self.num_compiled += 1
        self._cache[key] = future
        while len(self._cache) > self._max_entries:
            self._cache.popitem(last=False)
        return future

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
