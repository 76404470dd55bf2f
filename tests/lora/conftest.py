"""Fixtures of the LoRA tests: the three test adapters on disk and their golden tokens."""

from __future__ import annotations

import json

import pytest

from jaxpaged.lora.request import LoRARequest
from tests.lora.adapters import GOLDEN, SPECS, write_adapter


@pytest.fixture(scope="session")
def lora_golden() -> dict:
    return json.loads(GOLDEN.read_text())


@pytest.fixture(scope="session")
def lora_requests(tmp_path_factory, stories_dir) -> list[LoRARequest]:
    """``LoRARequest``s (ids 1, 2, 3) for ``tests.lora.adapters.SPECS``, written once."""
    root = tmp_path_factory.mktemp("lora")
    return [
        LoRARequest(spec.name, i + 1, write_adapter(stories_dir, root / spec.name, spec))
        for i, spec in enumerate(SPECS)
    ]
