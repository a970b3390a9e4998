"""Compose files as runner Environments: what maps, what is refused (with the service and
field named), and runner manifests (environment.yaml) with warm pools."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner_harness import _plan, compose
from runner_harness.compose import ComposeError


def write(tmp_path: Path, text: str, name: str = "compose.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_the_fields_the_issue_names_map(tmp_path: Path) -> None:
    (tmp_path / "vars.env").write_text("# comment\nFROM_FILE=1\nQUOTED='a b'\n")
    project = compose.load(
        write(
            tmp_path,
            """
services:
  web:
    image: local/busybox:1.35
    network_mode: none
    depends_on: [db]
  db:
    image: "${DB_IMAGE:-local/python:3.11}"
    network_mode: none
    x-default: true
    working_dir: /srv
    mem_limit: 512m
    cpus: 1.5
    pids_limit: 100
    user: "1000:1000"
    env_file: vars.env
    environment:
      A: "1"
      FROM_HOST:
      BOOL: true
    volumes: ["./data:/data:ro"]
    command: tail -f /dev/null
    x-runner: {pool: 3, spec: {resources: {ephemeralStorage: 1Gi}}}
""",
        ),
        env={"FROM_HOST": "host value"},
    )
    assert project.default == "db"
    assert [s.name for s in project.services] == ["db", "web"]  # depends_on first
    db = project.by_name()["db"]
    assert db.spec == {
        "image": "local/python:3.11",
        "env": {"FROM_FILE": "1", "QUOTED": "a b", "A": "1", "FROM_HOST": "host value", "BOOL": "true"},
        "workdir": "/srv",
        "mountWorkspace": False,
        "user": "1000:1000",
        "resources": {"memory": 512 << 20, "cpu": "1.5", "pids": 100, "ephemeralStorage": "1Gi"},
    }
    assert db.pool == 3 and db.main is None
    assert db.mounts == [{"source": str(tmp_path / "data"), "target": "/data", "readOnly": True}]


def test_main_process_healthcheck_and_deploy_limits(tmp_path: Path) -> None:
    project = compose.load(
        write(
            tmp_path,
            """
services:
  default:
    image: x
    network_mode: none
    entrypoint: ["python3", "-m"]
    command: http.server 8000
    init: true
    stop_grace_period: 1s
    deploy: {resources: {limits: {memory: 1g, cpus: "0.5"}, reservations: {memory: 100m}}}
    healthcheck: {test: "curl -f localhost:8000", interval: 1m30s, timeout: 500ms, retries: 2, start_period: 10s}
""",
        )
    )
    svc = project.services[0]
    assert svc.main == ["python3", "-m", "http.server", "8000"]
    assert svc.spec["resources"] == {"memory": 1 << 30, "cpu": "0.5"}
    assert svc.healthcheck == compose.Healthcheck(
        test=["/bin/sh", "-c", "curl -f localhost:8000"], interval=90.0, timeout=0.5, retries=2, start_period=10.0
    )


@pytest.mark.parametrize(
    "service, message",
    [
        ("build: .", "build: is not supported: runner runs prebuilt images"),
        ("image: x", "no network_mode: Docker would put the service on a network"),
        ("image: x\n    network_mode: host", "network_mode: 'host' is not supported"),
        ("image: x\n    network_mode: none\n    ports: ['8080:80']", "ports: is not supported"),
        ("image: x\n    network_mode: none\n    privileged: true", "privileged: true is not supported"),
        ("image: x\n    network_mode: none\n    cap_add: [SYS_ADMIN]", "cap_add: is not supported"),
        ("image: x\n    network_mode: none\n    read_only: true", "read_only: true is not supported"),
        ("image: x\n    network_mode: none\n    user: app", "user: 'app': runner needs numeric ids"),
        ("image: x\n    network_mode: none\n    volumes: [data:/data]", "names a volume"),
        ("image: x\n    network_mode: none\n    security_opt: [seccomp=unconfined]", "security_opt"),
        ("image: x\n    network_mode: none\n    mem_limit: lots", "mem_limit: 'lots' is not a size"),
        ("image: x\n    network_mode: none\n    pids_limit: -1", "pids_limit: -1"),
        ("image: x\n    network_mode: none\n    frobnicate: 1", "frobnicate: is not supported by runner"),
        ("image: x\n    network_mode: none\n    container_name: fixed", "container_name: is not supported"),
        ("image: x\n    network_mode: none\n    deploy: {resources: {reservations: {devices: [{capabilities: [gpu]}]}}}", "no devices"),
    ],
)
def test_what_runner_cannot_express_is_refused_naming_service_and_field(tmp_path: Path, service: str, message: str) -> None:
    path = write(tmp_path, "services:\n  default:\n    %s\n" % service)
    with pytest.raises(ComposeError) as refused:
        compose.load(path)
    assert "service 'default'" in str(refused.value) and message in str(refused.value), str(refused.value)


def test_project_level_refusals(tmp_path: Path) -> None:
    with pytest.raises(ComposeError, match="no 'default' service"):
        compose.load(write(tmp_path, "services:\n  a: {image: x, network_mode: none}\n"))
    with pytest.raises(ComposeError, match="top-level volumes"):
        compose.load(write(tmp_path, "services:\n  default: {image: x, network_mode: none}\nvolumes: {v: {}}\n"))
    with pytest.raises(ComposeError, match="cycle"):
        compose.load(write(tmp_path, "services:\n  default: {image: x, network_mode: none, depends_on: [b]}\n  b: {image: x, network_mode: none, depends_on: [default]}\n"))
    with pytest.raises(ComposeError, match="x-default: true on several"):
        compose.load(write(tmp_path, "services:\n  a: {image: x, network_mode: none, x-default: true}\n  b: {image: x, network_mode: none, x-default: true}\n"))


def test_x_runner_network_replaces_network_mode(tmp_path: Path) -> None:
    project = compose.load(
        write(tmp_path, "services:\n  default:\n    image: x\n    x-runner: {spec: {network: bridge, egress: {allow: [pypi.org:443]}}}\n")
    )
    assert project.services[0].spec["network"] == "bridge"
    assert project.services[0].spec["egress"] == {"allow": ["pypi.org:443"]}


def test_interpolation() -> None:
    env = {"A": "1", "EMPTY": ""}
    assert compose.interpolate("$A ${A} ${B:-d} ${EMPTY:-e} ${EMPTY-f} $$A ${B}", env) == "1 1 d e  $A "


def test_runner_manifest_sandboxes_and_pools(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """apiVersion: runner/v1alpha1
kind: Environment
metadata: {name: tools}
spec: {image: local/busybox:1.35, mounts: [{source: ./fixtures, target: /fixtures, readOnly: true}]}
---
apiVersion: runner/v1alpha1
kind: Environment
metadata: {name: default}
spec: {image: local/python:3.11}
---
apiVersion: runner/v1alpha1
kind: WarmPool
metadata: {name: p}
spec: {environment: default, size: 2}
""",
        "environment.yaml",
    )
    plan = _plan.load_file(path)
    assert plan.default == "default"
    assert {s.name: s.pool for s in plan.services} == {"tools": 0, "default": 2}
    assert plan.services[0].spec["mounts"][0]["source"] == str(tmp_path / "fixtures")
    bad = write(tmp_path, "apiVersion: runner/v1alpha1\nkind: Job\nmetadata: {name: j}\nspec: {}\n", "job.yaml")
    with pytest.raises(_plan.ConfigError, match="kind 'Job'"):
        _plan.load_file(bad)
    with pytest.raises(_plan.ConfigError, match="does not build images"):
        _plan.load_file(str(tmp_path / "Dockerfile"))


def test_no_config_needs_an_image(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_plan.IMAGE_ENV, raising=False)
    with pytest.raises(_plan.ConfigError, match="RUNNER_SANDBOX_IMAGE"):
        _plan.default_plan()
    monkeypatch.setenv(_plan.IMAGE_ENV, "local/busybox:1.35")
    assert _plan.default_plan().services[0].spec == {"image": "local/busybox:1.35"}
