"""Shared fixtures: the embedded stories260k checkpoint, its golden outputs, small engines."""

from __future__ import annotations

import json
import pathlib

import pytest

from jaxpaged.config import default_model_path

DATA_DIR = pathlib.Path(__file__).parent / "data"

# Small limits keep the number of compiled buckets (and CI time) low: sequence buckets
# 1, 2, 4, 8 and token buckets 16, 32, 64.
SMALL_ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64)


@pytest.fixture(scope="session")
def stories_dir() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def golden() -> dict:
    return json.loads((DATA_DIR / "stories260k" / "golden.json").read_text())


@pytest.fixture(scope="session")
def stories_llm():
    """One float32 engine on stories260k shared by the tests that only generate."""
    from jaxpaged import LLM

    return LLM(dtype="float32", **SMALL_ENGINE)


@pytest.fixture(scope="session")
def server():
    """A live OpenAI-compatible server on loopback (``tests/live_server.py``)."""
    from tests.live_server import start_test_server

    running = start_test_server()
    yield running
    running.stop()
