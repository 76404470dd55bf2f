"""Sizing JAX's GPU pool from gpu_memory_utilization (decision logic; no GPU needed)."""

from __future__ import annotations

import logging

import jax
import pytest

from jaxpaged.worker import memory_pool
from jaxpaged.worker.memory_pool import PoolAction, PoolState, decide_pool_action

GiB = 2**30
CARD = 140 * GiB


def _gpu(pool_fraction: float) -> PoolState:
    return PoolState(True, platform="gpu", pool_bytes=int(pool_fraction * CARD), total_bytes=CARD)


@pytest.fixture
def restore_client_options():
    before = jax.config.jax_pjrt_client_create_options
    yield
    jax.config.update("jax_pjrt_client_create_options", before)


@pytest.mark.parametrize(
    "state, action",
    [
        (PoolState(False), PoolAction.SET),
        (PoolState(False, user_memory_fraction=0.5), PoolAction.KEPT_USER_OPTION),
        (PoolState(True, platform="cpu"), PoolAction.NOT_GPU),
        (_gpu(0.9), PoolAction.ALREADY_SIZED),
        (_gpu(0.895), PoolAction.ALREADY_SIZED),  # allocator rounding
        (_gpu(0.75), PoolAction.TOO_SMALL),  # JAX's default pool
    ],
)
def test_decision_follows_backend_state_and_pool_size(state, action):
    assert decide_pool_action(state, 0.9) is action


def test_before_the_backend_starts_the_pool_option_is_set(restore_client_options):
    jax.config.update("jax_pjrt_client_create_options", {"visible_devices": [0]})
    action = memory_pool.configure_memory_pool(0.85, is_initialized=lambda: False)
    assert action is PoolAction.SET
    assert jax.config.jax_pjrt_client_create_options == {
        "visible_devices": [0],
        "memory_fraction": 0.85,
    }


def test_a_users_own_memory_fraction_is_kept(restore_client_options):
    jax.config.update("jax_pjrt_client_create_options", "memory_fraction:0.5")
    action = memory_pool.configure_memory_pool(0.9, is_initialized=lambda: False)
    assert action is PoolAction.KEPT_USER_OPTION
    assert jax.config.jax_pjrt_client_create_options == "memory_fraction:0.5"


def test_a_started_gpu_with_a_small_pool_warns_with_sizes_and_fixes(monkeypatch, caplog):
    monkeypatch.setattr(memory_pool, "_started_state", lambda: _gpu(0.75))
    with caplog.at_level(logging.WARNING, logger=memory_pool.__name__):
        action = memory_pool.configure_memory_pool(0.9, is_initialized=lambda: True)
    assert action is PoolAction.TOO_SMALL
    (message,) = caplog.messages
    assert "105.0 GiB" in message and "75%" in message and "140.0 GiB" in message
    assert "gpu_memory_utilization=0.9" in message
    assert "XLA_CLIENT_MEM_FRACTION=0.9" in message and "before any other JAX" in message


def test_on_this_cpu_process_nothing_changes(restore_client_options):
    jax.devices()  # the backend is started
    assert memory_pool.backends_initialized()
    before = jax.config.jax_pjrt_client_create_options
    assert memory_pool.configure_memory_pool(0.9) is PoolAction.NOT_GPU
    assert jax.config.jax_pjrt_client_create_options == before
