"""``jaxpaged serve --metrics-prefix vllm``: ``/metrics`` parses with prometheus_client and
carries the names inference gateways read."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

GATEWAY_GAUGES = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
)


def test_serve_with_metrics_prefix_vllm_exports_the_gateway_names(monkeypatch):
    import uvicorn

    from jaxpaged.entrypoints.cli import main
    from tests.live_server import RunningServer

    served = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: served.update(app=app))
    assert main(["serve", "--metrics-prefix", "vllm", "--max-model-len", "64"]) == 0
    running = RunningServer(served["app"])
    try:
        response = httpx.get(f"{running.url}/metrics")
    finally:
        running.stop()
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    assert not [name for name in families if not name.startswith("vllm:")]
    for name in GATEWAY_GAUGES:
        (sample,) = families[name].samples
        assert families[name].type == "gauge"
        assert sample.labels == {"model_name": "stories260k", "engine": "0"}
    (lora,) = families["vllm:lora_requests_info"].samples
    assert lora.labels == {
        "max_lora": "0",
        "running_lora_adapters": "",
        "waiting_lora_adapters": "",
    }
    assert "vllm:request_success" in families and "vllm:time_to_first_token_seconds" in families


def test_metrics_prefix_flag_refuses_other_values(capsys):
    from jaxpaged.entrypoints.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--metrics-prefix", "tgi"])
    assert "invalid choice: 'tgi'" in capsys.readouterr().err
