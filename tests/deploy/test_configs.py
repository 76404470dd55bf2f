"""deploy/: the Envoy, Prometheus, Grafana and Kubernetes examples agree with each other, with
deploy/nginx.conf, with ``jaxpaged serve``'s flags and with the metric names the server exports.
(Nginx itself runs in test_nginx.py; Envoy, Prometheus, Grafana and Kubernetes are not run.)"""

from __future__ import annotations

import json
import pathlib
import re

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from jaxpaged.entrypoints.cli import _build_parser
from jaxpaged.metrics import METRICS_PREFIX_CHOICES, ServerMetrics
from scripts.launch_replicas import plan_replicas

DEPLOY = pathlib.Path(__file__).resolve().parents[2] / "deploy"
REPLICA_PORTS = [spec.port for spec in plan_replicas(3)]  # deploy/nginx.conf's upstream


def _exported_names(prefix: str) -> set[str]:
    """Sample names /metrics carries with this prefix (``_total``, ``_bucket``, ... included)."""
    text = ServerMetrics("m", prefix=prefix).render().decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def _metric_names(expr: str, prefix: str) -> set[str]:
    return set(re.findall(rf"\b{prefix}:[a-zA-Z0-9_]+", expr))


def test_envoy_balances_least_request_checks_health_and_retries_connect_failures_only():
    config = yaml.safe_load((DEPLOY / "envoy.yaml").read_text())
    (cluster,) = config["static_resources"]["clusters"]
    assert cluster["lb_policy"] == "LEAST_REQUEST"
    assert cluster["health_checks"][0]["http_health_check"]["path"] == "/health"
    endpoints = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [e["endpoint"]["address"]["socket_address"]["port_value"] for e in endpoints] == (
        REPLICA_PORTS
    )
    (listener,) = config["static_resources"]["listeners"]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    assert manager["preserve_external_request_id"] is True
    assert manager["always_set_request_id_in_response"] is True
    route = manager["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    assert route["timeout"] == "0s"  # streams are not cut
    assert set(route["retry_policy"]["retry_on"].split(",")) == {
        "connect-failure",
        "refused-stream",
    }


def test_prometheus_scrapes_each_replica():
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    static = config["scrape_configs"][0]
    assert static["metrics_path"] == "/metrics"
    targets = static["static_configs"][0]["targets"]
    assert targets == [f"127.0.0.1:{port}" for port in REPLICA_PORTS]


@pytest.mark.parametrize("prefix", METRICS_PREFIX_CHOICES)
def test_grafana_panels_query_metrics_the_server_exports(prefix):
    dashboard = json.loads((DEPLOY / "grafana" / "jaxpaged-dashboard.json").read_text())
    exported = _exported_names(prefix)
    titles = {panel["title"] for panel in dashboard["panels"]}
    assert {"KV-cache usage", "Requests running / waiting", "Tokens per second"} <= titles
    assert {"Time to first token", "Time per output token (inter-token latency)"} <= titles
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            names = _metric_names(target["expr"].replace("${prefix}", prefix), prefix)
            assert names and names <= exported, (panel["title"], names - exported)


def test_kubernetes_deployment_flags_parse_and_autoscaling_reads_exported_metrics():
    documents = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "jaxpaged.yaml").read_text()))
    by_kind = {d["kind"]: d for d in documents}
    assert set(by_kind) == {"Deployment", "Service", "HorizontalPodAutoscaler"}
    container = by_kind["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["jaxpaged", "serve"]
    args = _build_parser().parse_args(["serve", *container["args"]])
    assert (args.port, args.metrics_prefix) == (8000, "vllm")
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"

    adapter = yaml.safe_load((DEPLOY / "kubernetes" / "prometheus-adapter-values.yaml").read_text())
    exported = _exported_names("vllm")
    served_as = set()
    for rule in adapter["rules"]["custom"]:
        assert _metric_names(rule["seriesQuery"], "vllm") <= exported
        served_as.add(rule["name"]["as"])
    hpa_metrics = {
        m["pods"]["metric"]["name"] for m in by_kind["HorizontalPodAutoscaler"]["spec"]["metrics"]
    }
    assert hpa_metrics and hpa_metrics <= served_as

    keda = yaml.safe_load((DEPLOY / "kubernetes" / "keda-scaledobject.yaml").read_text())
    for trigger in keda["spec"]["triggers"]:
        names = _metric_names(trigger["metadata"]["query"], "vllm")
        assert names and names <= exported
