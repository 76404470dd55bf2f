"""``jaxpaged serve --api-server-count 2``: two API processes on one port over one engine core,
run as a user runs it (``python -m jaxpaged.entrypoints.openai.api_server``), on stories260k.

The core is frozen with SIGSTOP where a test needs requests to stay unfinished (a disconnect,
the core's death), so nothing depends on how fast the CPU steps.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from jaxpaged.entrypoints.openai.errors import BadRequestError
from jaxpaged.entrypoints.openai.serving_models import LoadLoRAAdapterRequest, OpenAIServingModels
from tests.conftest import SMALL_ENGINE
from tests.live_server import CHAT_TEMPLATE

PROMPTS = ["Once upon a time", "The dog ran", "Tom had a red ball", "Lily and Tom went"]


class MultiServer:
    """The parent process of ``--api-server-count 2`` on a free loopback port; the pids of its
    engine core and API servers come from its log."""

    def __init__(self, tmp_path: pathlib.Path):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        engine = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL_ENGINE.items()]
        self.log = tmp_path / "server.log"
        argv = [sys.executable, "-m", "jaxpaged.entrypoints.openai.api_server"]
        argv += ["--host", "127.0.0.1", "--port", str(self.port), "--api-server-count", "2"]
        argv += ["--dtype", "float32", *engine, "--chat-template", CHAT_TEMPLATE]
        argv += ["--uvicorn-log-level", "warning"]
        with open(self.log, "w") as log:
            self.parent = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 240
        while self.get("/health")[0] != 200:
            if self.parent.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)
        text = self.log.read_text()
        self.core_pid = int(re.search(r"engine core ready \(pid (\d+)\)", text)[1])
        self.api_pids = [int(p) for p in re.findall(r"API server \d started \(pid (\d+)\)", text)]
        assert len(self.api_pids) == 2, text

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)

    def get(self, path: str) -> tuple[int, str]:
        """``(status, body)``; ``(0, "")`` while nothing listens."""
        try:
            connection = self.connect()
            connection.request("GET", path)
            response = connection.getresponse()
            return response.status, response.read().decode()
        except OSError:
            return 0, ""

    def metrics(self) -> dict[str, float]:
        """``/metrics`` samples by name and labels, e.g. ``'jaxpaged:num_requests_running'``
        (labels dropped when the name has a single sample)."""
        status, text = self.get("/metrics")
        assert status == 200
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                samples[key] = float(value)
        return samples

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM to the parent; its exit status once it and its children are gone."""
        if self.parent.poll() is None:
            self.parent.send_signal(signal.SIGTERM)
        try:
            return self.parent.wait(timeout)
        finally:
            self.parent.kill()


def _sample(metrics: dict[str, float], name: str, **labels) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    total = 0.0
    for key, value in metrics.items():
        metric, _, rest = key.partition("{")
        if metric == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


def _server_pid_of(connection: http.client.HTTPConnection, pids: list[int]) -> int:
    """The API server (of ``pids``) holding the other end of an open ``connection``: its
    socket's inode from ``/proc/net/tcp``, then the process whose fds hold that inode."""
    client_port = connection.sock.getsockname()[1]
    inode = None
    for line in pathlib.Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[2].split(":")[1], 16) == client_port:  # rem_address is the client
            inode = fields[9]
    for pid in pids:
        for fd in pathlib.Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                if os.readlink(fd) == f"socket:[{inode}]":
                    return pid
    raise AssertionError(f"no API server holds the connection from port {client_port}")


def _post(connection, path: str, body: dict):
    connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return connection.getresponse()


def _stream_text(response) -> tuple[str, list[dict]]:
    """The text of a finished completions stream, and its error events."""
    text, errors = "", []
    for line in response.read().decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                errors.append(event["error"])
            else:
                text += event["choices"][0]["text"]
    return text, errors


@pytest.fixture(scope="module")
def multi_server(tmp_path_factory):
    running = MultiServer(tmp_path_factory.mktemp("multi"))
    yield running
    assert running.stop() == 0, running.log.read_text()[-3000:]
    for pid in [running.core_pid, *running.api_pids]:
        assert not pathlib.Path(f"/proc/{pid}").exists(), f"pid {pid} outlived the server"


def test_streams_through_both_api_servers_equal_offline_greedy(multi_server, stories_llm):
    from jaxpaged import SamplingParams

    expected = {
        p: o.outputs[0].text
        for p, o in zip(
            PROMPTS,
            stories_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16)),
            strict=True,
        )
    }
    served_by: set[int] = set()
    for _ in range(10):  # the kernel picks the accepting process: repeat until both did
        connections = [(prompt, multi_server.connect()) for prompt in PROMPTS]
        body = {"model": "stories260k", "max_tokens": 16, "temperature": 0, "stream": True}
        responses = [
            (p, c, _post(c, "/v1/completions", body | {"prompt": p})) for p, c in connections
        ]
        for prompt, connection, response in responses:
            assert response.status == 200
            assert _stream_text(response) == (expected[prompt], [])
            served_by.add(_server_pid_of(connection, multi_server.api_pids))
            connection.close()
        if len(served_by) == 2:
            break
    assert served_by == set(multi_server.api_pids)


def test_metrics_count_each_request_once_whichever_process_answers(multi_server):
    before = multi_server.metrics()
    for _ in range(6):
        connection = multi_server.connect()
        body = {"model": "stories260k", "prompt": "The dog ran", "max_tokens": 5}
        assert _post(connection, "/v1/completions", body | {"ignore_eos": True}).status == 200
        connection.close()
    scrapes = [multi_server.metrics() for _ in range(4)]  # new connections: either process
    name = "jaxpaged:request_success_total"
    for after in scrapes:
        assert _sample(after, name) - _sample(before, name) == 6
        generated = _sample(after, "jaxpaged:generation_tokens_total")
        assert generated - _sample(before, "jaxpaged:generation_tokens_total") == 30
        # Engine-level gauges come from API server 0 alone: one sample each, not summed.
        assert _sample(after, "jaxpaged:num_requests_running") == 0
        assert 0 <= _sample(after, "jaxpaged:kv_cache_usage_perc") <= 1
        assert sum(k.startswith("jaxpaged:lora_requests_info") for k in after) == 1
    assert len({json.dumps(s, sort_keys=True) for s in scrapes}) == 1


def test_client_disconnect_aborts_across_the_boundary_and_leaks_no_block(multi_server):
    before = multi_server.metrics()
    chat = {"model": "stories260k", "stream": True, "max_tokens": 100, "ignore_eos": True}
    connections = []
    for prompt in PROMPTS:
        connection = multi_server.connect()
        body = chat | {"messages": [{"role": "user", "content": prompt}]}
        response = _post(connection, "/v1/chat/completions", body)
        assert response.status == 200
        assert response.readline().startswith(b"data: ")  # the role chunk: in the core
        connections.append((connection, response))
    os.kill(multi_server.core_pid, signal.SIGSTOP)  # no request can finish meanwhile
    try:
        for connection, response in connections:
            response.close()
            connection.close()
        time.sleep(1.0)  # the API servers see the disconnects and send their aborts
    finally:
        os.kill(multi_server.core_pid, signal.SIGCONT)
    # One more request makes the core step, so API server 0 gets its state after the aborts.
    connection = multi_server.connect()
    body = {"model": "stories260k", "prompt": "The dog ran", "max_tokens": 2}
    assert _post(connection, "/v1/completions", body).status == 200
    connection.close()
    after = multi_server.metrics()
    name = "jaxpaged:request_success_total"
    assert _sample(after, name, finished_reason="abort") - _sample(
        before, name, finished_reason="abort"
    ) == len(PROMPTS)
    assert _sample(after, "jaxpaged:num_requests_running") == 0
    assert _sample(after, "jaxpaged:num_requests_waiting") == 0
    assert _sample(after, "jaxpaged:kv_cache_usage_perc") == 0  # every block back


def test_runtime_lora_loading_is_refused_with_several_api_servers():
    class _Engine:
        info = {"max_loras": 2}

    models = OpenAIServingModels(_Engine(), ["m"], "/m", 128, api_server_count=2)
    body = LoadLoRAAdapterRequest(lora_name="a", lora_path="/a")
    with pytest.raises(BadRequestError, match="--api-server-count 1"):
        import asyncio

        asyncio.run(models.load_lora_adapter(body))


def test_killing_the_engine_core_turns_health_503_and_ends_open_streams(multi_server):
    """Last in this module: it kills the module's engine core (the fixture's teardown then
    checks that SIGTERM still stops every process)."""
    chat = {"model": "stories260k", "stream": True, "max_tokens": 100, "ignore_eos": True}
    streams = []
    for prompt in PROMPTS:
        connection = multi_server.connect()
        body = chat | {"messages": [{"role": "user", "content": prompt}]}
        response = _post(connection, "/v1/chat/completions", body)
        assert response.readline().startswith(b"data: ")  # the role chunk
        streams.append(response)
    os.kill(multi_server.core_pid, signal.SIGSTOP)  # no stream can finish before the kill
    os.kill(multi_server.core_pid, signal.SIGKILL)
    start = time.monotonic()
    for response in streams:
        events = [line for line in response.read().decode().splitlines() if line]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == 503 and "engine core" in error["message"]
    assert time.monotonic() - start < 5
    for _ in range(6):  # new connections: both API servers answer
        status, body = multi_server.get("/health")
        assert status == 503 and "engine core has died" in body
    assert multi_server.parent.poll() is None  # the API servers stay up to say so
