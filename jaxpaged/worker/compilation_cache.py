"""JAX's persistent compilation cache under a jaxpaged directory: fast restarts.

Every step bucket is an XLA executable; compiling them takes most of a cold start (about a
minute for an 8B model on an H200). JAX can store compiled executables on disk and load them in
a later process (``jax_compilation_cache_dir``). ``enable_compilation_cache`` turns it on at
engine construction with thresholds of zero, so that every bucket (and every small helper
function) is stored however quickly it compiled or however small it is.

Keying. JAX's key for an entry is a SHA-256 over the lowered module (StableHLO: shapes, dtypes,
shardings, the step's static arguments such as bucket sizes and ``max_blocks``), the jaxlib
version, the backend's platform version, the XLA flags, the compile options and the devices
(``jax._src.cache_key.get``). A changed config (another ``max_num_seqs``, ``block_size``,
``max_model_len``, dtype or model shape) lowers to other modules and so to other keys; it can never
load a wrong executable. The directory adds ``jax-<version>/<platform>-<device kind>`` on top so
that caches of different JAX installs and GPUs stay apart and can be deleted separately.

The cache is process-wide JAX state: JAX opens the directory at its first compilation after the
directory was set and keeps it for the life of the process, so a second engine in the same
process with another directory keeps using the first (a warning says so).

Security (JAX's own warning): a compilation cache is trusted code; do not share a directory
with users you do not trust.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import threading

import jax

logger = logging.getLogger(__name__)

DEFAULT_CACHE_ROOT = os.path.join("~", ".cache", "jaxpaged", "xla")

# JAX's monitoring events (jax/_src/dispatch.py, jax/_src/compiler.py): one per executable JAX
# asked for (compiled or loaded from the persistent cache), and one per persistent-cache hit.
_COMPILE_REQUEST_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def cache_subdir(platform: str, device_kind: str, jax_version: str = jax.__version__) -> str:
    """``jax-<version>/<platform>-<device kind>``, the device kind made path-safe
    (``"NVIDIA H200"`` -> ``gpu-nvidia_h200``)."""
    kind = re.sub(r"[^a-z0-9]+", "_", device_kind.lower()).strip("_") or "unknown"
    return os.path.join(f"jax-{jax_version}", f"{platform}-{kind}")


def cache_root(compilation_cache_dir: str | None) -> str:
    """``compilation_cache_dir`` (None: ``~/.cache/jaxpaged/xla``), user-expanded: the root the
    per-device directories (``resolve_cache_dir``) and the device-independent config cache
    (``models.config_cache``) live under. Needs no JAX backend."""
    return os.path.expanduser(compilation_cache_dir or DEFAULT_CACHE_ROOT)


def resolve_cache_dir(compilation_cache_dir: str | None) -> str:
    """The directory entries go to: ``cache_root(compilation_cache_dir)`` plus ``cache_subdir``
    of this process's first local device."""
    root = cache_root(compilation_cache_dir)
    device = jax.local_devices()[0]
    return os.path.join(root, cache_subdir(device.platform, device.device_kind))


def enable_compilation_cache(compilation_cache_dir: str | None) -> str:
    """Turn JAX's persistent compilation cache on for this process; returns its directory.

    Args:
        compilation_cache_dir: root directory (created if missing); None: the default
            ``~/.cache/jaxpaged/xla``.

    A directory the user already gave JAX (``jax_compilation_cache_dir``, e.g. from
    ``JAX_COMPILATION_CACHE_DIR``) wins and is returned unchanged.
    """
    current = jax.config.jax_compilation_cache_dir
    if current:
        if compilation_cache_dir is not None and current != resolve_cache_dir(
            compilation_cache_dir
        ):
            logger.warning(
                "JAX's compilation cache is already at %s in this process; "
                "compilation_cache_dir=%r is not used (JAX keeps its first directory)",
                current,
                compilation_cache_dir,
            )
        return current
    path = resolve_cache_dir(compilation_cache_dir)
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    # Store every executable: the smallest step buckets compile in well under JAX's default
    # 1 s threshold but still add up over dozens of buckets.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    logger.info("persistent compilation cache: %s", path)
    return path


@dataclasses.dataclass
class CompileCounter:
    """Counts XLA compilations while active (``with CompileCounter() as counter: ...``).

    ``requests``: executables JAX needed (a compile or a persistent-cache load each);
    ``cache_hits``: those loaded from the persistent cache; ``compiled`` = the difference, the
    number of real XLA compilations. Reads JAX's public monitoring events.
    """

    requests: int = 0
    cache_hits: int = 0
    # compile_all compiles buckets on several threads; each reports its own events.
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    @property
    def compiled(self) -> int:
        return self.requests - self.cache_hits

    def _on_duration(self, event: str, duration: float, **kwargs) -> None:
        if event == _COMPILE_REQUEST_EVENT:
            with self._lock:
                self.requests += 1

    def _on_event(self, event: str, **kwargs) -> None:
        if event == _CACHE_HIT_EVENT:
            with self._lock:
                self.cache_hits += 1

    def __enter__(self) -> CompileCounter:
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._on_duration)
        jax.monitoring.unregister_event_listener(self._on_event)
