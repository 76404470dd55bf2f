"""JAX's GPU memory pool, sized from ``gpu_memory_utilization`` at engine construction.

JAX's GPU client preallocates a pool (75% of the card by default) when its backend first
starts, and the KV cache can only use memory inside that pool. The pool's size is a client
option (``memory_fraction``) read once, when the client is created: from the environment
(``XLA_CLIENT_MEM_FRACTION``, formerly ``XLA_PYTHON_CLIENT_MEM_FRACTION``) or from the
``jax_pjrt_client_create_options`` config option, which JAX merges over the environment's
options (``jax._src.xla_bridge.make_pjrt_c_api_client``). So ``configure_memory_pool``:

- backend not started yet: sets ``memory_fraction = gpu_memory_utilization`` through that config
  option (no environment variable involved), unless the user already put a ``memory_fraction``
  there, which is kept;
- backend already started (some JAX operation ran first): nothing can change the pool any more;
  on a GPU whose pool is smaller than ``gpu_memory_utilization`` of the card, a warning names the
  pool, the card and what to do.

JAX has no public "has the backend started?" query; ``backends_initialized`` reads JAX's own
``xla_bridge.backends_are_initialized`` (the check ``jax.distributed.initialize`` makes).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Callable

import jax

logger = logging.getLogger(__name__)

_CREATE_OPTIONS = "jax_pjrt_client_create_options"
# A pool within this share of the requested size counts as the requested size (rounding of the
# allocator's limit).
_POOL_TOLERANCE = 0.01


class PoolAction(enum.Enum):
    """What ``configure_memory_pool`` did."""

    SET = "set"  # the pool will be gpu_memory_utilization of the card
    KEPT_USER_OPTION = "kept_user_option"  # memory_fraction already in jax's client options
    ALREADY_SIZED = "already_sized"  # backend started; its pool is large enough
    TOO_SMALL = "too_small"  # backend started with a smaller pool: warned
    NOT_GPU = "not_gpu"  # backend started without a GPU (CPU): there is no pool


@dataclasses.dataclass(frozen=True)
class PoolState:
    """The facts the decision reads; ``pool_bytes`` / ``total_bytes`` only for a started GPU."""

    backends_initialized: bool
    user_memory_fraction: float | None = None  # from jax_pjrt_client_create_options
    platform: str | None = None  # jax.default_backend() once started
    pool_bytes: int | None = None  # bytes_limit of the first device's memory_stats()
    total_bytes: int | None = None  # the card's physical memory (CUDA driver)


def decide_pool_action(state: PoolState, gpu_memory_utilization: float) -> PoolAction:
    """The pure decision of ``configure_memory_pool`` (tested without a GPU)."""
    if not state.backends_initialized:
        if state.user_memory_fraction is not None:
            return PoolAction.KEPT_USER_OPTION
        return PoolAction.SET
    if state.platform != "gpu" or state.pool_bytes is None:
        return PoolAction.NOT_GPU
    total = state.total_bytes or state.pool_bytes
    if state.pool_bytes >= (gpu_memory_utilization - _POOL_TOLERANCE) * total:
        return PoolAction.ALREADY_SIZED
    return PoolAction.TOO_SMALL


def too_small_message(state: PoolState, gpu_memory_utilization: float) -> str:
    """The warning for ``PoolAction.TOO_SMALL``: pool and card in GiB, and the two fixes."""
    pool, total = state.pool_bytes or 0, state.total_bytes or state.pool_bytes or 1
    return (
        f"JAX's GPU memory pool was already created with {pool / 2**30:.1f} GiB "
        f"({100 * pool / total:.0f}% of the {total / 2**30:.1f} GiB card) before this engine was "
        f"built, so gpu_memory_utilization={gpu_memory_utilization} cannot take effect and the "
        "KV cache is limited to that pool. Build the LLM before any other JAX operation in the "
        "process (in a notebook: restart the kernel and construct it first), or start Python "
        f"with XLA_CLIENT_MEM_FRACTION={gpu_memory_utilization}."
    )


def backends_initialized() -> bool:
    """True once JAX created its backends (the first device query or operation does)."""
    from jax._src import xla_bridge  # no public equivalent in jax 0.11.2

    return xla_bridge.backends_are_initialized()


def _user_memory_fraction() -> float | None:
    options = getattr(jax.config, _CREATE_OPTIONS)
    if isinstance(options, dict) and "memory_fraction" in options:
        return float(options["memory_fraction"])
    if isinstance(options, str) and "memory_fraction:" in options:
        for item in options.split(";"):
            key, _, value = item.partition(":")
            if key == "memory_fraction":
                return float(value)
    return None


def _started_state() -> PoolState:
    from jaxpaged.worker.kv_cache import device_memory_bytes

    platform = jax.default_backend()
    if platform != "gpu":
        return PoolState(True, platform=platform)
    device = jax.local_devices()[0]
    stats = device.memory_stats() or {}
    pool = stats.get("bytes_limit")
    return PoolState(
        True, platform=platform, pool_bytes=pool, total_bytes=device_memory_bytes(device)
    )


def configure_memory_pool(
    gpu_memory_utilization: float,
    *,
    is_initialized: Callable[[], bool] = backends_initialized,
) -> PoolAction:
    """Size JAX's GPU pool to ``gpu_memory_utilization`` of the card, or warn that it is too late.

    Called once at engine construction, before any device is touched (module docstring).

    Args:
        gpu_memory_utilization: fraction in (0, 1] of each GPU's memory for the engine.
        is_initialized: the "backend started?" probe (tests pass a fake).

    Returns:
        The ``PoolAction`` taken; ``TOO_SMALL`` also logs a warning (``too_small_message``).
    """
    if not is_initialized():
        state = PoolState(False, user_memory_fraction=_user_memory_fraction())
    else:
        state = _started_state()
    action = decide_pool_action(state, gpu_memory_utilization)
    if action is PoolAction.SET:
        options = getattr(jax.config, _CREATE_OPTIONS)
        merged = dict(_parse_options(options))
        merged["memory_fraction"] = float(gpu_memory_utilization)
        jax.config.update(_CREATE_OPTIONS, merged)
    elif action is PoolAction.KEPT_USER_OPTION:
        logger.info(
            "keeping memory_fraction=%s from jax_pjrt_client_create_options "
            "(gpu_memory_utilization=%s does not size JAX's pool)",
            state.user_memory_fraction,
            gpu_memory_utilization,
        )
    elif action is PoolAction.TOO_SMALL:
        logger.warning(too_small_message(state, gpu_memory_utilization))
    return action


def _parse_options(options) -> dict:
    if isinstance(options, dict):
        return options
    if isinstance(options, str) and options:
        return dict(item.split(":", 1) for item in options.split(";"))
    return {}
