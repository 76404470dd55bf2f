"""Fixtures of the OpenAI-server tests (the ``server`` itself lives in tests/conftest.py)."""

from __future__ import annotations

import pytest

from tests.live_server import API_KEY


@pytest.fixture(scope="session")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="session")
def greedy_reference(stories_llm):
    """``greedy_reference(prompts, max_tokens)`` -> RequestOutputs of ``LLM.generate``."""
    from jaxpaged import SamplingParams

    def run(prompts, max_tokens, **kwargs):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)
        return stories_llm.generate(prompts, params, use_tqdm=False)

    return run
