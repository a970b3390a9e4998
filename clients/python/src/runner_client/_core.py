"""What the sync and asyncio flavours share: where the server is, how each call is asked
(`Op`: a request and how to read its answer) and how answers become objects or exceptions.
The flavours differ only in how bytes move (`_sync.SyncTransport`, `_aio.AsyncTransport`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Dict, Generic, List, Mapping, Optional, Sequence, TypeVar, Union, cast
from urllib.parse import quote, unquote, urlencode, urlsplit

from . import manifest as _manifest
from .errors import RunnerError, TransportError, error_for
from .models import (
    ExecResult,
    FileEntry,
    Job,
    Pool,
    PythonResult,
    PythonVar,
    SessionInfo,
    ShellResult,
    StreamEvent,
    UploadReport,
)

T = TypeVar("T")

TOKEN_ENV = "RUNNER_TOKEN"
URL_ENV = "RUNNER_URL"
DEFAULT_URL = "http://127.0.0.1:8080"
USER_AGENT = "runner-client-python/0.1"

Command = Union[str, Sequence[str]]
"""An argv list, or a string run by `/bin/sh -c`."""
Environment = Union[str, Mapping[str, Any]]
"""A whole Environment document, its `spec` object, or the name of one in the server's env dir."""
PathLike = Union[str, "os.PathLike[str]"]


@dataclass(frozen=True)
class Endpoint:
    """A server: TCP (`http://host:port`, `https://...`) or a unix socket."""

    scheme: str  # "http", "https" or "unix"
    host: str = "127.0.0.1"
    port: int = 80
    socket_path: str = ""
    prefix: str = ""  # a path prefix (a reverse proxy's), without a trailing slash

    @property
    def host_header(self) -> str:
        if self.scheme == "unix":
            return "localhost"
        default = 443 if self.scheme == "https" else 80
        host = "[%s]" % self.host if ":" in self.host else self.host
        return host if self.port == default else "%s:%d" % (host, self.port)

    def __str__(self) -> str:
        if self.scheme == "unix":
            return "unix:" + self.socket_path
        return "%s://%s%s" % (self.scheme, self.host_header, self.prefix)


def endpoint(url: Optional[str], socket: Optional[PathLike]) -> Endpoint:
    """The server from `socket`, or `url` (`http://127.0.0.1:8080`, `unix:/path/to.sock`,
    as `runner serve` prints it), or `$RUNNER_URL`, or http://127.0.0.1:8080."""
    if socket is not None:
        if url is not None:
            raise ValueError("give url or socket, not both")
        return Endpoint("unix", socket_path=os.fspath(socket))
    url = url or os.environ.get(URL_ENV) or DEFAULT_URL
    if url.startswith("unix:"):
        path = url[len("unix:") :]
        if path.startswith("//"):  # unix:///path
            path = path[2:]
        if not path:
            raise ValueError("%r: no socket path" % url)
        return Endpoint("unix", socket_path=unquote(path))
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("%r: expected http://HOST:PORT, https://HOST:PORT or unix:PATH" % url)
    if parts.query or parts.fragment:
        raise ValueError("%r: a server URL has no query or fragment" % url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return Endpoint(parts.scheme, host=parts.hostname, port=port, prefix=parts.path.rstrip("/"))


def token(given: Optional[str]) -> Optional[str]:
    """The bearer token: the argument, else `$RUNNER_TOKEN` (surrounding whitespace dropped,
    as the server drops it from its token file)."""
    value = given if given is not None else os.environ.get(TOKEN_ENV)
    if value is None:
        return None
    value = value.strip()
    if "\n" in value or "\r" in value:
        raise ValueError("the token must be one line")
    return value or None


@dataclass
class Request:
    method: str
    path: str
    """From the API's root, with the query string."""
    body: Union[bytes, IO[bytes], None] = None
    length: Optional[int] = None
    """The length of a file body (bytes bodies know theirs)."""
    content_type: Optional[str] = None
    accept: str = "application/json"

    def body_length(self) -> int:
        if self.body is None:
            return 0
        if isinstance(self.body, (bytes, bytearray)):
            return len(self.body)
        if self.length is None:
            raise ValueError("a file body needs its length")
        return self.length

    def headers(self, endpoint: Endpoint, token: Optional[str]) -> Dict[str, str]:
        h = {
            "Host": endpoint.host_header,
            "User-Agent": USER_AGENT,
            "Accept": self.accept,
        }
        if token:
            h["Authorization"] = "Bearer " + token
        if self.body is not None or self.method in ("POST", "PUT"):
            h["Content-Length"] = str(self.body_length())
        if self.content_type:
            h["Content-Type"] = self.content_type
        return h


@dataclass
class Response:
    status: int
    headers: Dict[str, str] = field(default_factory=dict)
    """Lower-case names."""
    body: bytes = b""


def decode_body(headers: Mapping[str, str], body: bytes) -> Any:
    """JSON when the body is JSON, else its text."""
    text = body.decode("utf-8", "replace")
    if "json" in headers.get("content-type", "") or text.lstrip().startswith(("{", "[")):
        try:
            return json.loads(text)
        except ValueError:
            pass
    return text


def raise_for(response: Response) -> None:
    """The server's error, as its exception."""
    if response.status >= 400:
        raise error_for(response.status, decode_body(response.headers, response.body))
    if response.status < 200 or response.status >= 300:
        raise RunnerError(response.status, "unexpected HTTP %d" % response.status, response.body)


def json_of(response: Response) -> Any:
    try:
        return json.loads(response.body.decode("utf-8"))
    except ValueError as e:
        raise TransportError("the server answered HTTP %d with a body that is not JSON: %s" % (response.status, e))


@dataclass
class Op(Generic[T]):
    """One call: what to send, and what the (successful) answer means."""

    request: Request
    parse: Callable[[Response], T]


def _json_request(method: str, path: str, body: Any) -> Request:
    return Request(method, path, json.dumps(body).encode("utf-8"), content_type="application/json")


def _path(*segments: str, query: Optional[Mapping[str, Optional[str]]] = None) -> str:
    path = "/" + "/".join(quote(s, safe="") for s in segments)
    q = {k: v for k, v in (query or {}).items() if v is not None}
    return path + ("?" + urlencode(q) if q else "")


def _nothing(_: Response) -> None:
    return None


def _session_path(session_id: str, *rest: str, query: Optional[Mapping[str, Optional[str]]] = None) -> str:
    return _path("v1", "sessions", session_id, *rest, query=query)


def _seconds(timeout: Optional[float]) -> Optional[float]:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError("a timeout is a number of seconds")
    return float(timeout)


# --- the calls -------------------------------------------------------------------------------


def health() -> Op[Dict[str, Any]]:
    return Op(Request("GET", "/healthz"), json_of)


def session_body(
    environment: Optional[Environment],
    manifest: Optional[PathLike],
    environment_name: Optional[str],
    workspace: Optional[str],
    static_assets: Optional[Sequence[Mapping[str, Any]]],
    mounts: Optional[Sequence[Mapping[str, Any]]],
    backend: Optional[str],
) -> Dict[str, Any]:
    """The body of `POST /v1/sessions`. A manifest file is read here: its Environment document
    is sent whole (the server takes one)."""
    if (environment is None) == (manifest is None):
        raise ValueError("give an environment or a manifest file (one of them)")
    if manifest is not None:
        env: Any = _manifest.environment_from_manifest(manifest, environment_name)
    elif environment_name is not None:
        raise ValueError("environment_name picks an Environment of a manifest file: give manifest=")
    elif isinstance(environment, str):
        env = environment
    elif isinstance(environment, Mapping):
        env = dict(environment)
    else:
        raise TypeError("environment: a mapping (a document or its spec) or the name of one")
    body: Dict[str, Any] = {"environment": env}
    if workspace is not None:
        body["workspace"] = os.fspath(workspace)
    if static_assets:
        body["staticAssets"] = [dict(a) for a in static_assets]
    if mounts:
        body["mounts"] = [dict(m) for m in mounts]
    if backend is not None:
        body["backend"] = backend
    return body


def create_session(body: Mapping[str, Any]) -> Op[SessionInfo]:
    return Op(_json_request("POST", "/v1/sessions", body), lambda r: SessionInfo.from_json(json_of(r)))


def list_sessions() -> Op[List[SessionInfo]]:
    return Op(Request("GET", "/v1/sessions"), lambda r: [SessionInfo.from_json(d) for d in json_of(r)])


def get_session(session_id: str) -> Op[SessionInfo]:
    return Op(Request("GET", _session_path(session_id)), lambda r: SessionInfo.from_json(json_of(r)))


def set_egress(session_id: str, allow: Sequence[str]) -> Op[SessionInfo]:
    if isinstance(allow, str):
        raise TypeError("allow: a list of egress.allow entries, not one string")
    body = {"egress": {"allow": [str(a) for a in allow]}}
    return Op(_json_request("PATCH", _session_path(session_id), body), lambda r: SessionInfo.from_json(json_of(r)))


def delete_session(session_id: str) -> Op[None]:
    return Op(Request("DELETE", _session_path(session_id)), _nothing)


def pause_options(body: Dict[str, Any], auto_resume: bool, idle_pause_seconds: Optional[float]) -> Dict[str, Any]:
    """`autoResume` and `idlePauseSeconds` of a session's body."""
    if auto_resume:
        body["autoResume"] = True
    if idle_pause_seconds is not None:
        body["idlePauseSeconds"] = _seconds(idle_pause_seconds)
    return body


def pause_session(session_id: str) -> Op[SessionInfo]:
    return Op(Request("POST", _session_path(session_id, "pause")), lambda r: SessionInfo.from_json(json_of(r)))


def resume_session(session_id: str) -> Op[SessionInfo]:
    return Op(Request("POST", _session_path(session_id, "resume")), lambda r: SessionInfo.from_json(json_of(r)))


def snapshot_session(session_id: str, name: str, replace: bool, workspace: bool = False) -> Op[Dict[str, Any]]:
    body: Dict[str, Any] = {"name": name, "replace": bool(replace)}
    if workspace:
        body["workspace"] = True
    return Op(_json_request("POST", _session_path(session_id, "snapshot"), body), json_of)


def checkpoint_session(session_id: str, name: str, replace: bool) -> Op[Dict[str, Any]]:
    body = {"name": name, "replace": bool(replace)}
    return Op(_json_request("POST", _session_path(session_id, "checkpoint"), body), json_of)


def fork_session(session_id: str, count: int) -> Op[List[SessionInfo]]:
    if isinstance(count, bool) or not isinstance(count, int):
        raise TypeError("count: an int")
    return Op(
        _json_request("POST", _session_path(session_id, "fork"), {"count": count}),
        lambda r: [SessionInfo.from_json(d) for d in json_of(r)["sessions"]],
    )


def restore_body(checkpoint: str, auto_resume: bool, idle_pause_seconds: Optional[float]) -> Dict[str, Any]:
    """The body of `POST /v1/sessions` restoring a checkpoint."""
    if not isinstance(checkpoint, str):
        raise TypeError("checkpoint: the checkpoint's name")
    return pause_options({"fromCheckpoint": checkpoint}, auto_resume, idle_pause_seconds)


def list_checkpoints() -> Op[List[Dict[str, Any]]]:
    return Op(Request("GET", "/v1/checkpoints"), json_of)


def delete_checkpoint(name: str) -> Op[None]:
    return Op(Request("DELETE", "/v1/checkpoints/" + quote(name, safe="")), _nothing)


def _command(command: Command) -> Union[str, List[str]]:
    if isinstance(command, str):
        return command
    if isinstance(command, (bytes, bytearray)):
        raise TypeError("command: a string or a list of strings, not bytes")
    argv = list(command)
    if not all(isinstance(a, str) for a in argv):
        raise TypeError("command: every argument must be a string")
    return argv


def exec_(
    session_id: str,
    command: Command,
    stdin: Union[str, bytes, None],
    timeout: Optional[float],
    env: Optional[Mapping[str, str]],
    cwd: Optional[str],
) -> Op[ExecResult]:
    body: Dict[str, Any] = {"command": _command(command)}
    if stdin is not None:
        body["stdin"] = stdin.decode("utf-8") if isinstance(stdin, bytes) else stdin
    if timeout is not None:
        body["timeoutSeconds"] = _seconds(timeout)
    if env:
        body["env"] = {str(k): str(v) for k, v in env.items()}
    if cwd is not None:
        body["cwd"] = cwd
    return Op(
        _json_request("POST", _session_path(session_id, "exec"), body),
        lambda r: ExecResult.from_json(json_of(r)),
    )


def stream(session_id: str, command: Command, timeout: Optional[float]) -> Request:
    body: Dict[str, Any] = {"command": _command(command)}
    if timeout is not None:
        body["timeoutSeconds"] = _seconds(timeout)
    request = _json_request("POST", _session_path(session_id, "exec", "stream"), body)
    request.accept = "application/x-ndjson"
    return request


def shell(
    session_id: str, command: str, timeout: Optional[float], check: bool, name: Optional[str]
) -> Op[ShellResult]:
    if not isinstance(command, str):
        raise TypeError("a shell command is a string")
    body: Dict[str, Any] = {"command": command, "check": "raise" if check else "ignore"}
    if timeout is not None:
        body["timeoutSeconds"] = _seconds(timeout)
    if name is not None:
        body["name"] = name
    return Op(
        _json_request("POST", _session_path(session_id, "shell"), body),
        lambda r: ShellResult.from_json(json_of(r)),
    )


def python(session_id: str, code: str, timeout: Optional[float]) -> Op[PythonResult]:
    body: Dict[str, Any] = {"code": code}
    if timeout is not None:
        body["timeoutSeconds"] = _seconds(timeout)
    return Op(
        _json_request("POST", _session_path(session_id, "python"), body),
        lambda r: PythonResult.from_json(json_of(r)),
    )


def python_vars(session_id: str) -> Op[List[PythonVar]]:
    return Op(
        Request("GET", _session_path(session_id, "python", "vars")),
        lambda r: [PythonVar.from_json(d) for d in json_of(r)],
    )


def python_var(session_id: str, name: str) -> Op[Any]:
    return Op(
        Request("GET", _session_path(session_id, "python", "vars", name)),
        lambda r: json_of(r).get("value"),
    )


def read_file(session_id: str, path: str) -> Op[bytes]:
    request = Request("GET", _session_path(session_id, "files", query={"path": path}))
    request.accept = "application/octet-stream"
    return Op(request, lambda r: r.body)


def write_file(session_id: str, path: str, data: Union[bytes, str]) -> Op[None]:
    if isinstance(data, str):
        data = data.encode("utf-8")
    if not isinstance(data, (bytes, bytearray)):
        raise TypeError("file data: bytes or str")
    return Op(
        Request(
            "PUT",
            _session_path(session_id, "files", query={"path": path}),
            bytes(data),
            content_type="application/octet-stream",
        ),
        _nothing,
    )


def make_dir(session_id: str, path: str) -> Op[None]:
    return Op(Request("POST", _session_path(session_id, "files", "mkdir", query={"path": path})), _nothing)


def list_files(session_id: str, path: str) -> Op[List[FileEntry]]:
    query = {"path": path} if path else None
    return Op(
        Request("GET", _session_path(session_id, "files", "list", query=query)),
        lambda r: [FileEntry.from_json(d) for d in json_of(r)],
    )


def upload(session_id: str, path: str, body: Union[bytes, IO[bytes]], length: Optional[int]) -> Op[UploadReport]:
    query = {"path": path} if path else None
    return Op(
        Request(
            "POST",
            _session_path(session_id, "files", "upload", query=query),
            body,
            length=length,
            content_type="application/x-tar",
        ),
        lambda r: UploadReport.from_json(json_of(r)),
    )


def download(session_id: str, path: str) -> Op[bytes]:
    query = {"path": path} if path else None
    request = Request("GET", _session_path(session_id, "files", "download", query=query))
    request.accept = "application/x-tar"
    return Op(request, lambda r: r.body)


def create_pool(
    name: str,
    environment: Environment,
    size: Optional[int],
    workspace: bool,
    static_assets: bool,
    snapshot: Optional[str] = None,
) -> Op[Pool]:
    if not isinstance(name, str) or not name:
        raise ValueError("a pool needs a name")
    if isinstance(environment, Mapping):
        env: Any = dict(environment)
    elif isinstance(environment, str):
        env = environment
    else:
        raise TypeError("environment: a mapping (a document or its spec) or the name of one")
    body: Dict[str, Any] = {"name": name, "environment": env, "workspace": workspace}
    if size is not None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError("a pool's size is a whole number of members")
        body["size"] = size
    if static_assets:
        body["staticAssets"] = True
    if snapshot is not None:
        if not isinstance(snapshot, str) or not snapshot:
            raise ValueError("snapshot: the name of a snapshot (as sessions.snapshots() lists them)")
        body["snapshot"] = snapshot
    return Op(_json_request("POST", "/v1/pools", body), lambda r: Pool.from_json(json_of(r)))


def list_pools() -> Op[List[Pool]]:
    return Op(Request("GET", "/v1/pools"), lambda r: [Pool.from_json(d) for d in json_of(r)])


def delete_pool(name: str) -> Op[List[str]]:
    return Op(
        Request("DELETE", _path("v1", "pools", name)),
        lambda r: [str(n) for n in json_of(r).get("removed", [])],
    )


ManifestInput = Union[str, bytes, "os.PathLike[str]", Sequence[Mapping[str, Any]]]
"""Manifest text (YAML or JSON), a manifest file (a `pathlib.Path`), or documents."""


def manifest_text(manifest: ManifestInput) -> bytes:
    if isinstance(manifest, bytes):
        return manifest
    if isinstance(manifest, str):
        return manifest.encode("utf-8")
    if isinstance(manifest, os.PathLike):
        with open(manifest, "rb") as f:
            return f.read()
    if isinstance(manifest, Sequence) and all(isinstance(d, Mapping) for d in manifest):
        return _manifest.dump_documents(cast(Sequence[Mapping[str, Any]], manifest)).encode("utf-8")
    raise TypeError("a manifest: its text, a pathlib.Path to its file, or a list of documents")


def apply(manifest: ManifestInput, replace: bool = False) -> Op[List[str]]:
    path = _path("v1", "jobs", query={"replace": "true"} if replace else None)
    return Op(
        Request("POST", path, manifest_text(manifest), content_type="application/yaml"),
        lambda r: [str(n) for n in json_of(r).get("created", [])],
    )


def label_selector(selector: Union[str, Mapping[str, str], None]) -> Optional[str]:
    if selector is None or isinstance(selector, str):
        return selector or None
    return ",".join("%s=%s" % (k, v) for k, v in selector.items()) or None


def list_jobs(selector: Union[str, Mapping[str, str], None]) -> Op[List[Job]]:
    return Op(
        Request("GET", _path("v1", "jobs", query={"labelSelector": label_selector(selector)})),
        lambda r: [Job.from_json(d) for d in json_of(r)],
    )


def get_job(name: str) -> Op[Job]:
    return Op(Request("GET", _path("v1", "jobs", name)), lambda r: Job.from_json(json_of(r)))


def job_logs(name: str) -> Op[str]:
    request = Request("GET", _path("v1", "jobs", name, "logs"))
    request.accept = "text/plain"
    return Op(request, lambda r: r.body.decode("utf-8", "replace"))


def delete_job(name: str) -> Op[None]:
    return Op(Request("DELETE", _path("v1", "jobs", name)), _nothing)


# --- exec/stream ------------------------------------------------------------------------------


class EventDecoder:
    """NDJSON bytes in (in any pieces), events out."""

    def __init__(self) -> None:
        self._buffer = b""
        self.exit: Optional[StreamEvent] = None

    def feed(self, data: bytes) -> List[StreamEvent]:
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        return [e for e in (self._event(line) for line in lines) if e is not None]

    def finish(self) -> List[StreamEvent]:
        """The end of the stream: a last unterminated line, and a check that `exit` came."""
        rest, self._buffer = self._buffer, b""
        events = [e for e in [self._event(rest)] if e is not None]
        if self.exit is None:
            raise TransportError("the command's stream ended before its exit event")
        return events

    def _event(self, line: bytes) -> Optional[StreamEvent]:
        if not line.strip():
            return None
        try:
            event = StreamEvent.from_json(json.loads(line.decode("utf-8")))
        except ValueError as e:
            raise TransportError("a stream line that is not an event: %s" % e) from None
        if event.type == "exit":
            self.exit = event
        return event
