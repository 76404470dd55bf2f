"""``jaxpaged serve --data-parallel-size 2``: two engine-core processes behind one API server.
Outputs equal the offline engine's, both cores take load, a dead core leaves the
other serving and is reported on /health and in /metrics."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxpaged.engine_core.dp_client import device_group

PROMPTS = [
    f"Once upon a time there was a {w}" for w in ("cat", "dog", "girl", "boy", "tree", "sun")
]


@pytest.fixture(scope="module")
def dp_server():
    import uvicorn

    from jaxpaged.entrypoints.cli import main
    from tests.live_server import RunningServer

    served = {}
    patch = pytest.MonkeyPatch()
    patch.setattr(uvicorn, "run", lambda app, **kwargs: served.update(app=app))
    try:
        assert main(["serve", "--data-parallel-size", "2", "--max-model-len", "64"]) == 0
    finally:
        patch.undo()
    running = RunningServer(served["app"])
    yield running
    running.stop()


def _complete(url: str, prompt: str) -> str:
    body = {"model": "stories260k", "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _served_per_engine(url: str) -> dict[str, float]:
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    counts: dict[str, float] = {}
    for family in families:
        if family.name == "jaxpaged:request_success":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    engine = sample.labels["engine"]
                    counts[engine] = counts.get(engine, 0.0) + sample.value
    return counts


def test_two_engines_serve_the_offline_outputs_and_both_take_load(dp_server):
    from jaxpaged import LLM, SamplingParams

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        served = list(pool.map(lambda p: _complete(dp_server.url, p), PROMPTS))
    offline = LLM(max_model_len=64).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8))
    assert served == [o.outputs[0].text for o in offline]
    counts = _served_per_engine(dp_server.url)
    assert set(counts) == {"0", "1"} and all(counts[e] > 0 for e in counts), counts
    assert sum(counts.values()) == len(PROMPTS)


def test_a_dead_engine_leaves_the_other_serving_and_is_reported(dp_server):
    client = dp_server.engine
    client.clients[1].core.process.kill()
    client.clients[1].core.process.join(10)
    deadline = 50
    for _ in range(deadline):  # the watch task notices within a fraction of a second
        health = httpx.get(f"{dp_server.url}/health")
        if health.status_code == 200 and health.content:
            break
        time.sleep(0.1)
    assert health.status_code == 200 and health.json() == {
        "status": "degraded",
        "dead_engines": [1],
    }
    before = _served_per_engine(dp_server.url).get("0", 0.0)
    assert [_complete(dp_server.url, p) for p in PROMPTS[:3]]  # all routed to engine 0
    assert _served_per_engine(dp_server.url)["0"] == before + 3


def test_each_engine_gets_its_own_device_group():
    assert [device_group(i, 2) for i in range(3)] == ["0,1", "2,3", "4,5"]
    assert device_group(1, 1) == "1"
