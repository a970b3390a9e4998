"""`GET /metrics` read by an independent parser (prometheus_client's): the server's text
format must be valid Prometheus exposition, with the families the README names."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from runner_client import Client

from conftest import HOST_ENV


def scrape(url: str, token: str) -> str:
    request = urllib.request.Request(url + "/metrics", headers={"Authorization": "Bearer " + token})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return response.read().decode()


def test_metrics_parse_and_count_what_happened(tcp_url: str, token: str) -> None:
    with Client(tcp_url, token=token) as client:
        with client.session(HOST_ENV) as session:
            session.exec(["true"])
            families = {f.name: f for f in text_string_to_metric_families(scrape(tcp_url, token))}
    assert families["runner_http_request_duration_seconds"].type == "histogram"
    assert families["runner_sessions_live"].type == "gauge"
    assert families["runner_jobs"].type == "gauge"
    exec_counts = [
        s.value
        for s in families["runner_http_request_duration_seconds"].samples
        if s.name.endswith("_count") and s.labels.get("route") == "/v1/sessions/{id}/exec"
    ]
    assert exec_counts and sum(exec_counts) >= 1
    live = [s.value for s in families["runner_sessions_live"].samples if s.labels.get("backend") == "host"]
    assert live and live[0] >= 1
    phases = {s.labels["phase"] for s in families["runner_jobs"].samples}
    assert {"Pending", "Running", "Succeeded", "Failed"} <= phases


def test_metrics_need_the_token(tcp_url: str) -> None:
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(tcp_url + "/metrics", timeout=30)
    assert raised.value.code == 401
