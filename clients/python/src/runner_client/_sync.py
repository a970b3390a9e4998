"""The synchronous flavour: `Client`, `Session`, `Jobs`, over `http.client` (TCP, TLS, or a
unix socket). Thread-safe: each call takes its own connection from a small keep-alive pool."""

from __future__ import annotations

import http.client
import os
import pathlib
import socket as _socket
import ssl
import threading
import time
from types import TracebackType
from typing import IO, Any, Dict, Iterator, List, Mapping, Optional, Sequence, Type, TypeVar, Union

from . import _core, _tar
from ._core import Command, Endpoint, Environment, ManifestInput, Op, PathLike, Request, Response
from .errors import NotFound, RunnerError, TransportError, WaitTimeout
from .terminal import Terminal, open_terminal, watch_events
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

__all__ = ["Client", "Session", "Sessions", "Jobs", "Pools", "ExecStream", "SyncTransport"]

T = TypeVar("T")

# Failures of a kept-alive connection the server closed while it idled: the request never
# reached it, so it is sent again once on a new connection.
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, ConnectionAbortedError)
_CHUNK = 64 << 10
_POOL_SIZE = 8


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: Optional[float]) -> None:
        super().__init__("localhost", timeout=timeout)
        self._socket_path = path

    def connect(self) -> None:
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self._socket_path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class SyncTransport:
    """HTTP/1.1 to one server with a keep-alive pool of connections."""

    def __init__(self, endpoint: Endpoint, token: Optional[str], timeout: Optional[float]) -> None:
        self.endpoint = endpoint
        self._token = token
        self._timeout = timeout
        self._idle: List[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self._closed = False

    def _connection(self) -> http.client.HTTPConnection:
        e = self.endpoint
        if e.scheme == "unix":
            return _UnixConnection(e.socket_path, self._timeout)
        if e.scheme == "https":
            return http.client.HTTPSConnection(
                e.host, e.port, timeout=self._timeout, context=ssl.create_default_context()
            )
        return http.client.HTTPConnection(e.host, e.port, timeout=self._timeout)

    def _take(self) -> "tuple[http.client.HTTPConnection, bool]":
        with self._lock:
            if self._closed:
                raise TransportError("the client is closed")
            if self._idle:
                return self._idle.pop(), True
        return self._connection(), False

    def _give_back(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < _POOL_SIZE:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _send(self, request: Request) -> "tuple[http.client.HTTPConnection, http.client.HTTPResponse]":
        """Send a request; its connection and the response (headers read, body not)."""
        file_body = request.body if request.body is not None and not isinstance(request.body, bytes) else None
        start = file_body.tell() if file_body is not None else 0
        for attempt in (1, 2):
            conn, reused = self._take()
            try:
                return conn, self._exchange(conn, request)
            except _STALE as e:
                conn.close()
                if reused and attempt == 1:
                    if file_body is not None:
                        file_body.seek(start)
                    continue
                raise TransportError("%s: the connection failed: %s" % (self.endpoint, e)) from None
            except TransportError:
                conn.close()
                raise
            except _socket.timeout:
                conn.close()
                raise TransportError("%s: no answer within %ss" % (self.endpoint, self._timeout)) from None
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                raise TransportError("%s: %s" % (self.endpoint, str(e) or type(e).__name__)) from None
            except BaseException:
                conn.close()
                raise
        raise AssertionError("unreachable")

    def _exchange(self, conn: http.client.HTTPConnection, request: Request) -> http.client.HTTPResponse:
        headers = request.headers(self.endpoint, self._token)
        # Host is ours (http.client would name the unix socket's placeholder host).
        conn.putrequest(
            request.method, self.endpoint.prefix + request.path, skip_host=True, skip_accept_encoding=True
        )
        for name, value in headers.items():
            conn.putheader(name, value)
        try:
            conn.endheaders()
            body = request.body
            if isinstance(body, (bytes, bytearray)):
                conn.send(body)
            elif body is not None:
                left = request.body_length()
                while left > 0:
                    chunk = body.read(min(_CHUNK, left))
                    if not chunk:
                        raise ValueError("the request body ended %d bytes early" % left)
                    conn.send(chunk)
                    left -= len(chunk)
        except (BrokenPipeError, ConnectionResetError) as sending:
            # The server may have answered (a 413) and closed before taking the whole body:
            # its answer is worth more than the broken pipe.
            try:
                return conn.getresponse()
            except Exception:
                raise sending from None
        return conn.getresponse()

    def _finish(self, conn: http.client.HTTPConnection, response: http.client.HTTPResponse) -> None:
        """After the whole body was read: back to the pool, unless the server closes it."""
        if response.will_close:
            conn.close()
        else:
            self._give_back(conn)

    def request(self, request: Request) -> Response:
        conn, raw = self._send(request)
        try:
            body = raw.read()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise TransportError("%s: reading the answer: %s" % (self.endpoint, e)) from None
        except BaseException:
            conn.close()
            raise
        self._finish(conn, raw)
        return Response(raw.status, {k.lower(): v for k, v in raw.getheaders()}, body)

    def call(self, op: Op[T]) -> T:
        response = self.request(op.request)
        _core.raise_for(response)
        return op.parse(response)

    def open(self, request: Request) -> "_OpenResponse":
        """A request whose answer is read piece by piece; an error status raises here."""
        conn, raw = self._send(request)
        opened = _OpenResponse(self, conn, raw)
        if raw.status >= 300:
            body = opened.read_all()
            _core.raise_for(Response(raw.status, {k.lower(): v for k, v in raw.getheaders()}, body))
        return opened


class _OpenResponse:
    def __init__(self, transport: SyncTransport, conn: http.client.HTTPConnection, raw: http.client.HTTPResponse):
        self._transport = transport
        self._conn: Optional[http.client.HTTPConnection] = conn
        self._raw = raw

    def read1(self) -> bytes:
        """Some bytes as they arrive; b"" at the end."""
        if self._conn is None:
            return b""
        try:
            data = self._raw.read1(_CHUNK)
        except (OSError, http.client.HTTPException) as e:
            self.close()
            raise TransportError("%s: reading the answer: %s" % (self._transport.endpoint, e)) from None
        if not data:
            # The end. (http.client's read1 does not mark a Content-Length body as done when
            # it ends; closing the response does, and keeps the connection usable.)
            self._raw.close()
            conn, self._conn = self._conn, None
            self._transport._finish(conn, self._raw)
        return data

    def read_all(self) -> bytes:
        parts: List[bytes] = []
        while True:
            data = self.read1()
            if not data:
                return b"".join(parts)
            parts.append(data)

    def close(self) -> None:
        """Stop reading: the connection is dropped (its unread rest is not worth reading)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class ExecStream(Iterator[StreamEvent]):
    """A running command's events (`stdout`, `stderr`, then `exit`) as they happen. Iterate
    it; `exit` holds the last event once seen. Closing it (or leaving its `with`) before the
    end drops the connection."""

    def __init__(self, response: _OpenResponse) -> None:
        self._response = response
        self._decoder = _core.EventDecoder()
        self._pending: List[StreamEvent] = []
        self._done = False

    @property
    def exit(self) -> Optional[StreamEvent]:
        return self._decoder.exit

    def __iter__(self) -> "ExecStream":
        return self

    def __next__(self) -> StreamEvent:
        while not self._pending:
            if self._done:
                raise StopIteration
            data = self._response.read1()
            if data:
                self._pending.extend(self._decoder.feed(data))
            else:
                self._done = True
                self._pending.extend(self._decoder.finish())
        return self._pending.pop(0)

    def wait(self) -> StreamEvent:
        """Read to the end; the exit event."""
        for _ in self:
            pass
        assert self._decoder.exit is not None
        return self._decoder.exit

    def close(self) -> None:
        self._done = True
        self._pending.clear()
        self._response.close()

    def __enter__(self) -> "ExecStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Session:
    """A live sandbox. Use it in `with` to have it deleted however the block ends."""

    def __init__(self, transport: SyncTransport, info: SessionInfo) -> None:
        self._t = transport
        self.id = info.id
        self.info = info
        """As the server described the session when this object was made (see `refresh`)."""

    def __repr__(self) -> str:
        return "Session(%r, backend=%r)" % (self.id, self.info.backend)

    def refresh(self) -> SessionInfo:
        """The session as the server sees it now."""
        self.info = self._t.call(_core.get_session(self.id))
        return self.info

    def set_egress(self, allow: Sequence[str]) -> SessionInfo:
        """Replace what the sandbox may reach off its bridge network (`egress.allow` entries:
        addresses, CIDRs, domains, each optionally with `:port`). At once; connections to what
        is no longer allowed are cut. A session on no bridge network raises Conflict."""
        self.info = self._t.call(_core.set_egress(self.id, allow))
        return self.info

    def pause(self) -> SessionInfo:
        """Freeze the sandbox's processes (they keep their memory, use no CPU). Calls to a
        paused session raise Conflict unless it was created with `auto_resume=True`."""
        self.info = self._t.call(_core.pause_session(self.id))
        return self.info

    def resume(self) -> SessionInfo:
        """Thaw a paused session: its processes go on where they were."""
        self.info = self._t.call(_core.resume_session(self.id))
        return self.info

    def snapshot(self, name: str, *, replace: bool = False, workspace: bool = False) -> Dict[str, Any]:
        """Make the sandbox's filesystem changes the image `snapshot:NAME` (not its mounts;
        its workspace too with `workspace=True`: what starts from the snapshot finds those
        files in its workspace); a name that exists raises Conflict unless `replace`."""
        return self._t.call(_core.snapshot_session(self.id, name, replace, workspace))

    def checkpoint(self, name: str, *, replace: bool = False) -> Dict[str, Any]:
        """Checkpoint the sandbox (CRIU): its processes, memory, files and workspace, restorable
        as new sessions with `client.sessions.restore(name)`; a name that exists raises
        Conflict unless `replace`."""
        return self._t.call(_core.checkpoint_session(self.id, name, replace))

    def fork(self, count: int = 1) -> List["Session"]:
        """`count` new sessions (1 to 100), each a copy of this one as it is now: shell and
        Python variables, running processes, files and workspace. They diverge from then on."""
        return [Session(self._t, info) for info in self._t.call(_core.fork_session(self.id, count))]

    def exec(
        self,
        command: Command,
        *,
        stdin: Union[str, bytes, None] = None,
        timeout: Optional[float] = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
    ) -> ExecResult:
        """Run a command (an argv list, or a string for `/bin/sh -c`) to its end."""
        return self._t.call(_core.exec_(self.id, command, stdin, timeout, env, cwd))

    def stream(self, command: Command, *, timeout: Optional[float] = None) -> ExecStream:
        """Run a command; iterate its events as they happen (no stdin, env or cwd)."""
        return ExecStream(self._t.open(_core.stream(self.id, command, timeout)))

    def shell(
        self, command: str, *, timeout: Optional[float] = None, check: bool = False, name: Optional[str] = None
    ) -> ShellResult:
        """Run in the session's stateful shell (cwd, exports and functions persist between
        calls). `check=True`: a failure raises `CommandFailed` (with its output)."""
        return self._t.call(_core.shell(self.id, command, timeout, check, name))

    def python(self, code: str, *, timeout: Optional[float] = None) -> PythonResult:
        """Run code in the session's persistent interpreter (containerd sessions only)."""
        return self._t.call(_core.python(self.id, code, timeout))

    def vars(self) -> List[PythonVar]:
        """The interpreter's variables."""
        return self._t.call(_core.python_vars(self.id))

    def var(self, name: str) -> Any:
        """One variable's value: as JSON when it is serializable, else `{"repr": ...}`."""
        return self._t.call(_core.python_var(self.id, name))

    def read_file(self, path: str) -> bytes:
        """A workspace file's bytes (`path` is relative to the workspace)."""
        return self._t.call(_core.read_file(self.id, path))

    def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return self.read_file(path).decode(encoding)

    def write_file(self, path: str, data: Union[bytes, str]) -> None:
        """Write a workspace file (str as UTF-8); missing parents are made."""
        self._t.call(_core.write_file(self.id, path, data))

    def mkdir(self, path: str) -> None:
        """Make a workspace directory and its parents."""
        self._t.call(_core.make_dir(self.id, path))

    def list_files(self, path: str = "") -> List[FileEntry]:
        """A workspace directory's entries (the workspace itself by default)."""
        return self._t.call(_core.list_files(self.id, path))

    def upload(self, local: PathLike, path: str = "") -> UploadReport:
        """Copy a local directory's contents (or one file) into the workspace directory `path`
        (the workspace by default), as one tar.gz."""
        body, length = _tar.pack(local)
        with body:
            return self._t.call(_core.upload(self.id, path, body, length))

    def upload_tar(self, data: Union[bytes, IO[bytes]], path: str = "", *, length: Optional[int] = None) -> UploadReport:
        """Extract a tar (plain or gzipped; bytes, or a file with its `length`) into `path`."""
        return self._t.call(_core.upload(self.id, path, data, length))

    def download(self, path: str = "") -> bytes:
        """A tar of a workspace directory or file."""
        return self._t.call(_core.download(self.id, path))

    def watch(self, path: str = "", *, recursive: bool = True) -> "Iterator[Dict[str, Any]]":
        """The workspace's changes as they happen: dicts with `type` (ready, create, modify,
        delete, move, overflow) and `path` (or `from`/`to`). Close the generator to stop."""
        query = {"path": path or None, "recursive": "true" if recursive else "false"}
        request = Request("GET", _core._session_path(self.id, "files", "watch", query=query), accept="application/x-ndjson")
        return watch_events(self._t.open(request))

    def metrics(self) -> Dict[str, Any]:
        """What the sandbox uses now (cpuSeconds, cpuCores, memoryBytes, memoryPeakBytes, pids,
        I/O and network bytes); `NotSupported` for a host session."""
        return self._t.call(Op(Request("GET", _core._session_path(self.id, "metrics")), _core.json_of))

    def terminal(self, command: Optional[Command] = None, **options: Any) -> "Terminal":
        """A command (default: the image's shell) on a terminal in the sandbox; see
        `runner_client.terminal` (rows, cols, env, cwd)."""
        return open_terminal(self._t.endpoint, self._t._token, self.id, command, **options)

    def delete(self) -> None:
        """End the session and remove everything it owned."""
        self._t.call(_core.delete_session(self.id))

    def __enter__(self) -> "Session":
        return self

    def __exit__(
        self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        _close_session(self.delete, exc is not None)


def _close_session(delete: Any, failing: bool) -> None:
    """The end of a session's `with`: delete it. A session already gone is fine; when the block
    failed, its exception wins over a failed delete."""
    try:
        delete()
    except NotFound:
        pass
    except RunnerError:
        if not failing:
            raise


class Sessions:
    """`client.sessions`: create, find and list sessions."""

    def __init__(self, transport: SyncTransport) -> None:
        self._t = transport

    def create(
        self,
        environment: Optional[Environment] = None,
        *,
        manifest: Optional[PathLike] = None,
        environment_name: Optional[str] = None,
        workspace: Optional[str] = None,
        static_assets: Optional[Sequence[Mapping[str, Any]]] = None,
        mounts: Optional[Sequence[Mapping[str, Any]]] = None,
        backend: Optional[str] = None,
        auto_resume: bool = False,
        idle_pause_seconds: Optional[float] = None,
        pool: Optional[bool] = None,
    ) -> Session:
        """Start a session in `environment` (a whole Environment document, its spec, e.g.
        `{"backend": "host"}`, or the name of one in the server's env dir), or in the
        Environment of the manifest file `manifest` (`environment_name` picks one of several).
        Its setup must succeed. A ready warm-pool member that fits is claimed unless
        `pool=False` (a session meant to be checkpointed or forked: a member cannot be)."""
        body = _core.session_body(environment, manifest, environment_name, workspace, static_assets, mounts, backend)
        # autoResume: a call to the paused session resumes it; idlePauseSeconds: it pauses
        # itself once idle that long (containerd sessions).
        _core.pause_options(body, auto_resume, idle_pause_seconds)
        if pool is not None:
            # False: a sandbox of its own even when a warm pool fits (one to checkpoint or fork).
            body["pool"] = bool(pool)
        return Session(self._t, self._t.call(_core.create_session(body)))

    def restore(
        self, checkpoint: str, *, auto_resume: bool = False, idle_pause_seconds: Optional[float] = None
    ) -> Session:
        """A new session restored from `checkpoint` (`Session.checkpoint`): its Environment,
        files, workspace, processes and memory are the checkpoint's."""
        body = _core.restore_body(checkpoint, auto_resume, idle_pause_seconds)
        return Session(self._t, self._t.call(_core.create_session(body)))

    def checkpoints(self) -> List[Dict[str, Any]]:
        """Every checkpoint: name, source session, bytes on disk, when it was made."""
        return self._t.call(_core.list_checkpoints())

    def remove_checkpoint(self, name: str) -> None:
        self._t.call(_core.delete_checkpoint(name))

    def get(self, session_id: str) -> Session:
        """An existing session (`NotFound` when there is none)."""
        return Session(self._t, self._t.call(_core.get_session(session_id)))

    def list(self) -> List[SessionInfo]:
        return self._t.call(_core.list_sessions())


class Pools:
    """`client.pools`: warm pools, made and removed over HTTP."""

    def __init__(self, transport: SyncTransport) -> None:
        self._t = transport

    def create(
        self,
        name: str,
        environment: Environment,
        *,
        size: Optional[int] = None,
        workspace: bool = True,
        static_assets: bool = False,
        snapshot: Optional[str] = None,
    ) -> Pool:
        """Make (or resize) the pool `name` of `environment` (as for a session) and fill it;
        sessions of that Environment then start from its members. Default size 2. With
        `snapshot`, members start from that snapshot instead of the Environment's image and
        serve sessions whose image is `snapshot:NAME` (with the Environment's other settings)."""
        return self._t.call(_core.create_pool(name, environment, size, workspace, static_assets, snapshot))

    def list(self) -> List[Pool]:
        return self._t.call(_core.list_pools())

    def delete(self, name: str) -> List[str]:
        """Remove the pool and its unclaimed members; their ids."""
        return self._t.call(_core.delete_pool(name))


class Jobs:
    """`client.jobs`: submit manifests, follow and remove their Jobs."""

    def __init__(self, transport: SyncTransport) -> None:
        self._t = transport

    def apply(self, manifest: ManifestInput, *, replace: bool = False) -> List[str]:
        """Submit a manifest — its text (YAML or JSON), a `pathlib.Path` to its file, or a list
        of documents; its Jobs start detached. The names created. A name that exists is a
        `Conflict` (Kubernetes' AlreadyExists) unless `replace` (a finished job of that name
        is then replaced, its record and logs with it)."""
        return self._t.call(_core.apply(manifest, replace))

    def apply_file(self, path: PathLike, *, replace: bool = False) -> List[str]:
        """Submit a manifest file. Relative paths in it resolve on the server, against its
        working directory."""
        return self.apply(_as_path(path), replace=replace)

    def list(self, label_selector: Union[str, Mapping[str, str], None] = None) -> List[Job]:
        """Every Job, or those whose labels match (`"suite=x"` or `{"suite": "x"}`)."""
        return self._t.call(_core.list_jobs(label_selector))

    def get(self, name: str) -> Job:
        return self._t.call(_core.get_job(name))

    def wait(self, name: str, timeout: Optional[float] = None, *, poll_interval: float = 0.5) -> Job:
        """Poll until the Job has Succeeded or Failed; it. `WaitTimeout` after `timeout`
        seconds (with the last state seen)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = min(0.05, poll_interval)
        while True:
            job = self.get(name)
            if job.finished:
                return job
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout("job %s is still %s after %ss" % (name, job.phase, timeout), job)
            pause = delay if deadline is None else max(0.0, min(delay, deadline - time.monotonic()))
            time.sleep(pause)
            delay = min(delay * 2, poll_interval)

    def logs(self, name: str) -> str:
        """The Job's stdout (the last attempt of every index)."""
        return self._t.call(_core.job_logs(name))

    def delete(self, name: str) -> None:
        """Stop the Job and delete it with its logs."""
        self._t.call(_core.delete_job(name))


def _as_path(path: PathLike) -> "os.PathLike[str]":
    return pathlib.Path(os.fspath(path))


class Client:
    """A `runner serve` server.

    `url`: `http://HOST:PORT` or `unix:PATH` (as the server prints it; default `$RUNNER_URL`,
    else http://127.0.0.1:8080), or `socket`: a unix socket's path. `token`: the bearer token
    (default `$RUNNER_TOKEN`). `timeout`: seconds any one read may wait (default: no limit,
    as commands may run long).
    """

    def __init__(
        self,
        url: Optional[str] = None,
        *,
        token: Optional[str] = None,
        socket: Optional[PathLike] = None,
        timeout: Optional[float] = None,
    ) -> None:
        self.endpoint = _core.endpoint(url, socket)
        self._t = SyncTransport(self.endpoint, _core.token(token), timeout)
        self.sessions = Sessions(self._t)
        self.jobs = Jobs(self._t)
        self.pools = Pools(self._t)

    def __repr__(self) -> str:
        return "Client(%r)" % str(self.endpoint)

    def health(self) -> Dict[str, Any]:
        """`/healthz` (needs no token)."""
        return self._t.call(_core.health())

    def session(
        self,
        environment: Optional[Environment] = None,
        *,
        manifest: Optional[PathLike] = None,
        environment_name: Optional[str] = None,
        workspace: Optional[str] = None,
        static_assets: Optional[Sequence[Mapping[str, Any]]] = None,
        mounts: Optional[Sequence[Mapping[str, Any]]] = None,
        backend: Optional[str] = None,
        auto_resume: bool = False,
        idle_pause_seconds: Optional[float] = None,
        pool: Optional[bool] = None,
    ) -> Session:
        """`sessions.create`: `with client.session({...}) as s:` deletes it at the end."""
        return self.sessions.create(
            environment,
            manifest=manifest,
            environment_name=environment_name,
            workspace=workspace,
            static_assets=static_assets,
            mounts=mounts,
            backend=backend,
            auto_resume=auto_resume,
            idle_pause_seconds=idle_pause_seconds,
            pool=pool,
        )

    def close(self) -> None:
        """Close the kept-alive connections (sessions live on, on the server)."""
        self._t.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
