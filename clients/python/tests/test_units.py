"""The parts that need no server: errors, addresses, manifests, the NDJSON decoder."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

import runner_client
from runner_client import (
    BadRequest,
    CommandFailed,
    Conflict,
    NotFound,
    NotSupported,
    RunnerError,
    ServerError,
    TooLarge,
    TransportError,
    Unauthorized,
    Unavailable,
    Unprocessable,
    environment_from_manifest,
    load_documents,
)
from runner_client import _core
from runner_client.errors import error_for
from runner_client.manifest import dump_documents, parse_documents


@pytest.mark.parametrize(
    "status, cls",
    [
        (400, BadRequest),
        (401, Unauthorized),
        (404, NotFound),
        (409, Conflict),
        (413, TooLarge),
        (422, Unprocessable),
        (500, ServerError),
        (501, NotSupported),
        (503, Unavailable),
        (502, ServerError),
        (418, RunnerError),
    ],
)
def test_error_classes(status: int, cls: type) -> None:
    e = error_for(status, {"error": "what went wrong"})
    assert type(e) is cls
    assert (e.status, e.message, e.body) == (status, "what went wrong", {"error": "what went wrong"})
    assert str(e) == "%d: what went wrong" % status


def test_command_failed() -> None:
    body = {"error": "command failed with exit code 3", "output": "out\n", "exitCode": 3, "timedOut": False}
    e = error_for(422, body)
    assert isinstance(e, CommandFailed) and isinstance(e, Unprocessable)
    assert (e.output, e.exit_code, e.timed_out) == ("out\n", 3, False)
    assert type(error_for(422, {"error": "setup failed"})) is Unprocessable


def test_error_without_json() -> None:
    e = error_for(502, "Bad Gateway\n")
    assert isinstance(e, ServerError) and e.message == "Bad Gateway"
    assert error_for(500, "").message == "HTTP 500"


def test_endpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RUNNER_URL", raising=False)
    e = _core.endpoint(None, None)
    assert (e.scheme, e.host, e.port, e.host_header) == ("http", "127.0.0.1", 8080, "127.0.0.1:8080")
    e = _core.endpoint("http://127.0.0.1:9000/prefix/", None)
    assert (e.port, e.prefix) == (9000, "/prefix")
    e = _core.endpoint("unix:/run/runner.sock", None)
    assert (e.scheme, e.socket_path, str(e)) == ("unix", "/run/runner.sock", "unix:/run/runner.sock")
    assert _core.endpoint("unix:///run/r.sock", None).socket_path == "/run/r.sock"
    assert _core.endpoint(None, Path("/x.sock")).socket_path == "/x.sock"
    assert _core.endpoint("http://[::1]:8080", None).host_header == "[::1]:8080"
    monkeypatch.setenv("RUNNER_URL", "unix:/from/env.sock")
    assert _core.endpoint(None, None).socket_path == "/from/env.sock"
    for bad in ("127.0.0.1:8080", "ftp://x", "unix:", "http://h:1/?q=1"):
        with pytest.raises(ValueError):
            _core.endpoint(bad, None)


def test_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNNER_TOKEN", "  from-env\n")
    assert _core.token(None) == "from-env"
    assert _core.token("given") == "given"
    monkeypatch.delenv("RUNNER_TOKEN")
    assert _core.token(None) is None
    with pytest.raises(ValueError):
        _core.token("two\nlines")


def test_request_headers() -> None:
    request = _core.exec_("s-1", ["echo", "hi"], None, 2, None, None).request
    headers = request.headers(_core.endpoint("unix:/x", None), "tok")
    assert headers["Authorization"] == "Bearer tok"
    assert headers["Host"] == "localhost"
    assert headers["Content-Length"] == str(len(request.body or b""))
    assert json.loads(request.body or b"") == {"command": ["echo", "hi"], "timeoutSeconds": 2.0}
    assert request.path == "/v1/sessions/s-1/exec"
    assert _core.read_file("s/1", "a b/c?.txt").request.path == "/v1/sessions/s%2F1/files?path=a+b%2Fc%3F.txt"
    assert _core.list_jobs({"a": "1", "b": "2"}).request.path == "/v1/jobs?labelSelector=a%3D1%2Cb%3D2"
    snap = _core.snapshot_session("s-1", "prepared", False, True).request
    assert snap.path == "/v1/sessions/s-1/snapshot"
    assert json.loads(snap.body or b"") == {"name": "prepared", "replace": False, "workspace": True}
    with pytest.raises(TypeError):
        _core.exec_("s", [1], None, None, None, None)  # type: ignore[list-item]
    with pytest.raises(TypeError):
        _core.shell("s", ["not", "a", "string"], None, False, None)  # type: ignore[arg-type]


def test_event_decoder() -> None:
    d = _core.EventDecoder()
    assert d.feed(b'{"type":"stdout","da') == []
    events = d.feed(b'ta":"a\\n"}\n{"type":"stderr","data":"b"}\n{"type":"exit","exitCode":0,"signal":null,"timedOut":false}')
    assert [(e.type, e.data) for e in events] == [("stdout", "a\n"), ("stderr", "b")]
    last = d.finish()
    assert [e.type for e in last] == ["exit"] and d.exit is not None and d.exit.exit_code == 0
    cut = _core.EventDecoder()
    cut.feed(b'{"type":"stdout","data":"x"}\n')
    with pytest.raises(TransportError):
        cut.finish()


YAML = """\
# comment
apiVersion: runner/v1alpha1
kind: Environment
metadata: {name: a}
spec:
  backend: host
  user: 1000:1000
  env: {A: on, B: yes, C: 010, D: 2024-01-02, E: "x"}
  resources: {memory: 512Mi, cpu: 0.5}
  number: 010
  hex: 0x1F
  flag: true
  nothing: ~
---
---
apiVersion: runner/v1alpha1
kind: Environment
metadata: {name: b}
spec: {backend: host}
"""


def test_yaml_manifest_follows_yaml_1_2(tmp_path: Path) -> None:
    docs = parse_documents(YAML)
    assert len(docs) == 2  # the empty document is dropped
    spec = docs[0]["spec"]
    assert spec["user"] == "1000:1000"  # not YAML 1.1's base-60 integer
    assert spec["env"] == {"A": "on", "B": "yes", "C": 10, "D": "2024-01-02", "E": "x"}
    assert (spec["number"], spec["hex"], spec["flag"], spec["nothing"]) == (10, 31, True, None)
    assert spec["resources"] == {"memory": "512Mi", "cpu": 0.5}
    path = tmp_path / "m.yaml"
    path.write_text(YAML)
    assert environment_from_manifest(path, "b")["metadata"] == {"name": "b"}
    with pytest.raises(ValueError, match="2 Environments"):
        environment_from_manifest(path)
    assert len(load_documents(path)) == 2


def test_json_manifests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = [{"kind": "Environment", "metadata": {"name": "j"}, "spec": {}}, {"kind": "Job"}]
    monkeypatch.setitem(sys.modules, "yaml", None)  # JSON needs no PyYAML
    assert parse_documents(json.dumps(docs)) == docs
    assert parse_documents(dump_documents(docs)) == docs
    assert parse_documents(json.dumps(docs[0])) == [docs[0]]
    path = tmp_path / "one.json"
    path.write_text(json.dumps(docs))
    assert environment_from_manifest(path)["metadata"]["name"] == "j"
    with pytest.raises(ValueError, match="PyYAML"):
        parse_documents("kind: Environment\n")
    with pytest.raises(ValueError, match="no Environment"):
        environment_from_manifest(_write(tmp_path / "jobs.json", [{"kind": "Job"}]))


def _write(path: Path, docs: object) -> Path:
    path.write_text(json.dumps(docs))
    return path


def test_session_body(tmp_path: Path) -> None:
    assert _core.session_body({"backend": "host"}, None, None, None, None, None, None) == {
        "environment": {"backend": "host"}
    }
    body = _core.session_body("named", None, None, "/w", [{"source": "a", "target": "b"}], None, "host")
    assert body == {
        "environment": "named",
        "workspace": "/w",
        "staticAssets": [{"source": "a", "target": "b"}],
        "backend": "host",
    }
    with pytest.raises(ValueError):
        _core.session_body(None, None, None, None, None, None, None)
    with pytest.raises(ValueError):
        _core.session_body({"backend": "host"}, tmp_path / "m.yaml", None, None, None, None, None)
    with pytest.raises(ValueError):
        _core.session_body({"backend": "host"}, None, "name", None, None, None, None)


def test_pause_and_snapshot_requests() -> None:
    body = _core.pause_options({"environment": "e"}, True, 30)
    assert body == {"environment": "e", "autoResume": True, "idlePauseSeconds": 30.0}
    assert _core.pause_options({}, False, None) == {}
    with pytest.raises(TypeError):
        _core.pause_options({}, False, "soon")  # type: ignore[arg-type]
    assert (_core.pause_session("s-1").request.method, _core.pause_session("s-1").request.path) == (
        "POST",
        "/v1/sessions/s-1/pause",
    )
    assert _core.resume_session("s-1").request.path == "/v1/sessions/s-1/resume"
    snap = _core.snapshot_session("s-1", "deps", True).request
    assert (snap.path, json.loads(snap.body)) == ("/v1/sessions/s-1/snapshot", {"name": "deps", "replace": True})


def test_checkpoint_requests() -> None:
    ck = _core.checkpoint_session("s-1", "c", False).request
    assert (ck.method, ck.path, json.loads(ck.body)) == ("POST", "/v1/sessions/s-1/checkpoint", {"name": "c", "replace": False})
    fork = _core.fork_session("s-1", 3).request
    assert (fork.path, json.loads(fork.body)) == ("/v1/sessions/s-1/fork", {"count": 3})
    with pytest.raises(TypeError):
        _core.fork_session("s-1", True)
    assert _core.restore_body("c", True, None) == {"fromCheckpoint": "c", "autoResume": True}
    assert _core.delete_checkpoint("a/b").request.path == "/v1/checkpoints/a%2Fb"


def test_public_names() -> None:
    for name in runner_client.__all__:
        assert hasattr(runner_client, name), name
    assert (Path(runner_client.__file__).parent / "py.typed").exists()


class _ClosingServer:
    """Answers each connection's first request, then closes it without saying so: a kept-alive
    connection the server dropped while it idled."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.connections = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return "http://127.0.0.1:%d" % self.sock.getsockname()[1]

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    data += chunk
                body = b'{"status":"ok"}'
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                time.sleep(0.05)

    def close(self) -> None:
        self.sock.close()


def test_dropped_keep_alive_connection_is_retried() -> None:
    server = _ClosingServer()
    try:
        with runner_client.Client(server.url, token="t") as client:
            for _ in range(3):
                assert client.health() == {"status": "ok"}
                time.sleep(0.1)  # the server has closed the connection the client keeps

        async def main() -> None:
            async with runner_client.AsyncClient(server.url, token="t") as client:
                for _ in range(3):
                    assert await client.health() == {"status": "ok"}
                    await asyncio.sleep(0.1)

        asyncio.run(main())
        assert server.connections == 6
    finally:
        server.close()
