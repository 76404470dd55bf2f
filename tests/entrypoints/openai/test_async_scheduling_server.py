"""The server with async scheduling: client disconnects at every point of short streams (the
abort path that meets requests whose last token is still on the device) leave the engine alive,
its blocks free, and later answers equal the offline engine's."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from jaxpaged import SamplingParams
from tests.live_server import API_KEY, MODEL_NAME, start_server

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def async_server():
    server = start_server(api_key=API_KEY, async_scheduling=True)
    yield server
    server.stop()


def _leave_after(url: str, num_chunks: int, max_tokens: int) -> None:
    body = {
        "model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True, "stream": True,
    }  # fmt: skip
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            seen = 0
            for line in response.iter_lines():
                seen += line.startswith("data: ")
                if seen >= num_chunks:
                    break


def test_disconnects_at_every_chunk_keep_the_engine_alive_and_free(async_server, stories_llm):
    cases = [(k, n) for n in (2, 3, 5) for k in range(1, n + 1)] * 2
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda case: _leave_after(async_server.url, *case), cases))
    async_server.wait_idle()
    assert not async_server.engine.is_dead
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}
    with httpx.Client(base_url=async_server.url, headers=AUTH, timeout=60) as client:
        text = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    (offline,) = stories_llm.generate(
        "Once upon a time", SamplingParams(temperature=0, max_tokens=24), use_tqdm=False
    )
    assert text == offline.outputs[0].text
    stats = async_server.wait_idle()  # checks the block pool's invariants
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"]


def test_constrained_streams_cut_mid_grammar_leave_the_engine_alive_and_free(
    async_server, stories_llm
):
    pytest.importorskip("xgrammar")
    import json

    from jaxpaged import StructuredOutputsParams

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 5},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["name", "n"],
    }
    so = {"json": schema, "disable_any_whitespace": True}

    def leave_after(num_chunks: int) -> None:
        body = {
            "model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 40,
            "temperature": 0, "stream": True, "structured_outputs": so,
        }  # fmt: skip
        with httpx.Client(base_url=async_server.url, headers=AUTH, timeout=60) as client:
            with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                seen = 0
                for line in response.iter_lines():
                    seen += line.startswith("data: ")
                    if seen >= num_chunks:
                        break

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        list(pool.map(leave_after, [1, 2, 3, 4, 5, 6] * 2))
    async_server.wait_idle()
    assert not async_server.engine.is_dead
    body = {
        "model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0,
        "structured_outputs": so,
    }  # fmt: skip
    with httpx.Client(base_url=async_server.url, headers=AUTH, timeout=60) as client:
        text = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    params = SamplingParams(
        temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(**so)
    )
    (offline,) = stories_llm.generate("Once upon a time", params, use_tqdm=False)
    assert text == offline.outputs[0].text
    assert set(json.loads(text)) == {"name", "n"}
    stats = async_server.wait_idle()
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"]
