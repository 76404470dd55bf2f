"""Start-up phases of an engine, timed and logged as one line (fast restarts).

``StartupTimer`` times the phases of ``LLMEngine.__init__`` in order (``with timer.phase(name)``)
plus the time from the process's start to the engine's construction (imports, mostly), and
``log`` writes them as one INFO line, e.g.::

    start-up 13.2 s: process start -> engine 2.4 s | backend 0.9 s | config/tokenizer 3.1 s
    (config via transformers) | weights 2.6 s | memory profiling 1.8 s | executables 1.2 s
    (2 loaded, 0 compiled, 16 loading in the background) | KV allocation 0.2 s

``prefetch_transformers`` imports transformers on a background thread while the main thread
starts JAX's backend: transformers imports PyTorch when it is installed, seconds that the engine
would otherwise wait for before it can read the model's config.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time

logger = logging.getLogger(__name__)


def process_start_time() -> float | None:
    """This process's start as a ``time.time()`` value, read from ``/proc`` (Linux; 10 ms
    resolution); None where there is no ``/proc``."""
    try:
        with open("/proc/self/stat") as f:
            # Field 22 (starttime, clock ticks since boot) follows the parenthesised name.
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + start_ticks / os.sysconf("SC_CLK_TCK")


class StartupTimer:
    """Seconds per start-up phase, in the order they ran (``phases``), plus free-form notes
    appended to a phase's entry in the log line (``note``)."""

    def __init__(self):
        self.started = time.time()
        process_start = process_start_time()
        # Before the engine: interpreter start-up and imports (None without /proc).
        self.before_engine = None if process_start is None else self.started - process_start
        self.phases: dict[str, float] = {}
        self.notes: dict[str, str] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - start

    def add(self, name: str, seconds: float, note: str = "") -> None:
        """Record a phase timed elsewhere (e.g. inside the worker)."""
        self.phases[name] = self.phases.get(name, 0.0) + seconds
        if note:
            self.note(name, note)

    def note(self, name: str, text: str) -> None:
        self.notes[name] = text

    def as_dict(self) -> dict:
        """``{"process_start_to_engine_s": ..., "<phase>_s": ..., "engine_s": ...}`` (JSON)."""
        out = {"process_start_to_engine_s": self.before_engine}
        out.update({_key(name): s for name, s in self.phases.items()})
        out["engine_s"] = time.time() - self.started
        return out

    def line(self) -> str:
        total = time.time() - self.started
        parts = []
        if self.before_engine is not None:
            total += self.before_engine
            parts.append(f"process start -> engine {self.before_engine:.1f} s")
        for name, seconds in self.phases.items():
            note = f" ({self.notes[name]})" if name in self.notes else ""
            parts.append(f"{name} {seconds:.1f} s{note}")
        return f"start-up {total:.1f} s: " + " | ".join(parts)

    def log(self) -> None:
        logger.info("%s", self.line())


def prefetch_transformers() -> threading.Thread | None:
    """Start importing transformers' config and tokenizer classes on a daemon thread (None:
    already imported). Join the thread before this process touches transformers again:
    transformers' lazy module is not safe to import from two threads at once."""
    if "transformers.configuration_utils" in sys.modules:
        return None

    def run() -> None:
        # A failure here is not the caller's error: its own import repeats the work and raises
        # whatever is real there.
        try:
            import transformers

            transformers.AutoConfig  # noqa: B018  (the lazy module imports on access)
            transformers.AutoTokenizer  # noqa: B018
        except Exception:
            logger.debug("importing transformers in the background failed", exc_info=True)

    thread = threading.Thread(target=run, name="jaxpaged-import-transformers", daemon=True)
    thread.start()
    return thread


def _key(phase: str) -> str:
    """``"config/tokenizer"`` -> ``"config_tokenizer_s"`` (JSON keys)."""
    return "".join(c if c.isalnum() else "_" for c in phase.lower()) + "_s"
