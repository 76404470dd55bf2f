"""The entry points' environment variables; the only module of the package that reads or sets
``os.environ``.

Read: ``JAXPAGED_API_KEY`` (the ``serve`` API key when ``--api-key`` is not given) and
``VLLM_SERVER_DEV_MODE`` (``1`` turns on ``serve --enable-dev-endpoints``, as vLLM). Set, for
child processes and JAX's GPU backend: ``XLA_PYTHON_CLIENT_MEM_FRACTION`` and
``PROMETHEUS_MULTIPROC_DIR``. Library code takes these values as arguments instead.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile


def api_key_from_env() -> str | None:
    """``JAXPAGED_API_KEY``, or None when unset or empty."""
    return os.environ.get("JAXPAGED_API_KEY") or None


def server_dev_mode_from_env() -> bool:
    """Whether ``VLLM_SERVER_DEV_MODE`` is ``1`` (vLLM's switch for its dev-mode routes)."""
    return os.environ.get("VLLM_SERVER_DEV_MODE") == "1"


def set_jax_memory_fraction(gpu_memory_utilization: float) -> None:
    """Size JAX's GPU memory pool to ``gpu_memory_utilization`` of the card.

    JAX preallocates ``XLA_PYTHON_CLIENT_MEM_FRACTION`` of the card (75% by default) when its
    GPU backend starts, and the engine's KV cache can only use memory inside that pool, so an
    entry point sets it before the first JAX operation. A value the user exported is kept.
    Library users set the variable themselves before using jax.
    """
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{gpu_memory_utilization:.4f}")


def child_env_with_memory_fraction(fraction: float) -> dict[str, str]:
    """This process's environment for a child process whose JAX GPU pool is ``fraction`` of the
    card (``XLA_PYTHON_CLIENT_MEM_FRACTION``; ``jaxpaged bench matrix --workers``)."""
    return dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=f"{fraction:.3f}")


@contextlib.contextmanager
def prometheus_multiproc_dir():
    """A fresh directory exported as ``PROMETHEUS_MULTIPROC_DIR`` for the block (removed, and
    the variable restored, after it): prometheus_client's multiprocess mode for the API
    processes of ``--api-server-count`` (children read it when they import prometheus_client,
    so it is set before they start)."""
    path = tempfile.mkdtemp(prefix="jaxpaged-prometheus-")
    previous = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    try:
        yield path
    finally:
        if previous is None:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = previous
        shutil.rmtree(path, ignore_errors=True)
