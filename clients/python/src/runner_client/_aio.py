"""The asyncio flavour: `AsyncClient`, `AsyncSession`, `AsyncJobs` — the same calls as the sync
flavour (the same `_core.Op`s), awaited.

Why a small HTTP/1.1 client on an asyncio protocol rather than the sync transport in a
thread (`asyncio.to_thread`) per call: commands and streams may run for many minutes, and an
asyncio user typically runs many sessions at once. A thread per call would cap concurrency at
the default executor's size (a handful of threads on a small machine), and cancelling a task
(`asyncio.wait_for`, `TaskGroup`) could not stop a thread blocked in `recv`: the call would go
on holding its connection and thread. Here a cancelled call closes its connection at once, and
a thousand concurrent calls are a thousand sockets, not a thousand threads. The protocol needed
is small — requests with a known length, answers with Content-Length or chunked bodies — and
only that is implemented. Bodies over 64 KiB wait for "100 Continue", so that a refused
upload (401, 413) is not sent at all.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import ssl
import time
from types import TracebackType
from typing import (
    IO,
    Any,
    AsyncIterator,
    Awaitable,
    Dict,
    Generator,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Type,
    TypeVar,
    Union,
    cast,
)

from . import _core, _tar
from ._core import Command, Endpoint, Environment, ManifestInput, Op, PathLike, Request, Response
from .errors import NotFound, RunnerError, TransportError, WaitTimeout
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

__all__ = ["AsyncClient", "AsyncSession", "AsyncSessions", "AsyncJobs", "AsyncPools", "AsyncExecStream", "AsyncTransport"]

T = TypeVar("T")

_CHUNK = 64 << 10
_POOL_SIZE = 8
_LINE_LIMIT = 64 << 10
# Bodies up to this size go in one write with the request's head; bigger ones wait for
# "100 Continue" (at most _CONTINUE_WAIT seconds).
_SMALL_BODY = 64 << 10
_CONTINUE_WAIT = 1.0


def _is_continue(line: bytes) -> bool:
    parts = line.split(None, 2)
    return len(parts) >= 2 and parts[0].startswith(b"HTTP/") and parts[1] == b"100"


class _Stale(Exception):
    """A kept-alive connection the server had closed: the request never reached it."""


class _Connection(asyncio.Protocol):
    """One HTTP connection: an asyncio protocol with its own receive buffer.

    Not asyncio's StreamReader: once a connection fails (the server answered early, e.g. a
    401 or 413, and closed without reading the whole request body), a StreamReader raises on
    every read, even of an answer already received. Here what arrived stays readable, and
    the failure shows only when more is needed."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._eof = False
        self._error: Optional[BaseException] = None
        self._waiter: "Optional[asyncio.Future[None]]" = None
        self._paused = False
        self._drain_waiter: "Optional[asyncio.Future[None]]" = None
        self._transport: Optional[asyncio.Transport] = None
        self._closed: "Optional[asyncio.Future[None]]" = None

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._closed = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        self._wake()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return False  # close our side too

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        self._eof = True
        self._error = exc
        self._wake()
        self._paused = False
        self._wake_drain()
        if self._closed is not None and not self._closed.done():
            self._closed.set_result(None)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_drain()

    # --- for the transport ---

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _wake_drain(self) -> None:
        waiter, self._drain_waiter = self._drain_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _more(self) -> None:
        """Wait for more bytes, the end, or a failure."""
        self._waiter = asyncio.get_running_loop().create_future()
        await self._waiter

    def _lost(self) -> ConnectionResetError:
        return ConnectionResetError(str(self._error) if self._error else "the server closed the connection")

    async def readline(self) -> bytes:
        """A line with its b"\n"; what is left at the end (b"" when nothing)."""
        while True:
            i = self._buffer.find(b"\n")
            if i >= 0:
                line = bytes(self._buffer[: i + 1])
                del self._buffer[: i + 1]
                return line
            if len(self._buffer) > _LINE_LIMIT:
                raise TransportError("an answer line longer than %d bytes" % _LINE_LIMIT)
            if self._eof:
                if not self._buffer and self._error is not None:
                    raise self._lost()
                rest = bytes(self._buffer)
                self._buffer.clear()
                return rest
            await self._more()

    async def read(self, n: int) -> bytes:
        """Up to n bytes, as soon as there are some; b"" at the end."""
        while not self._buffer:
            if self._eof:
                if self._error is not None:
                    raise self._lost()
                return b""
            await self._more()
        data = bytes(self._buffer[:n])
        del self._buffer[:n]
        return data

    async def readexactly(self, n: int) -> bytes:
        parts = []
        while n > 0:
            data = await self.read(n)
            if not data:
                raise TransportError("the answer ended early")
            parts.append(data)
            n -= len(data)
        return b"".join(parts)

    def write(self, data: bytes) -> None:
        if self._eof or self._transport is None or self._transport.is_closing():
            raise self._lost()
        self._transport.write(data)

    async def drain(self) -> None:
        while self._paused:
            if self._eof:
                break
            self._drain_waiter = asyncio.get_running_loop().create_future()
            await self._drain_waiter
        if self._error is not None or (self._transport is not None and self._transport.is_closing()):
            raise self._lost()

    def usable(self) -> bool:
        return not self._eof and not self._buffer and self._transport is not None and not self._transport.is_closing()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    async def wait_closed(self) -> None:
        if self._closed is not None:
            await self._closed


class _Body:
    """A response body read piece by piece: chunked, Content-Length, or up to EOF."""

    def __init__(self, conn: _Connection, method: str, version: str, status: int, headers: Dict[str, str]) -> None:
        self._reader = conn
        self._left = 0  # bytes left in the body (length) or in the current chunk (chunked)
        self.done = False
        encoding = headers.get("transfer-encoding", "").lower()
        if method == "HEAD" or status in (204, 304):
            self._mode = "none"
            self.done = True
        elif "chunked" in encoding:
            self._mode = "chunked"
        elif "content-length" in headers:
            self._mode = "length"
            try:
                self._left = int(headers["content-length"])
            except ValueError:
                raise TransportError("a bad Content-Length: %r" % headers["content-length"]) from None
            self.done = self._left == 0
        else:
            self._mode = "eof"
        self.keep_alive = (
            version == "HTTP/1.1" and "close" not in headers.get("connection", "").lower() and self._mode != "eof"
        )

    async def read(self) -> bytes:
        """Some bytes; b"" at the end of the body."""
        if self.done:
            return b""
        reader = self._reader
        if self._mode == "length":
            data = await reader.read(min(self._left, _CHUNK))
            if not data:
                raise TransportError("the answer ended %d bytes early" % self._left)
            self._left -= len(data)
            self.done = self._left == 0
            return data
        if self._mode == "eof":
            data = await reader.read(_CHUNK)
            self.done = not data
            return data
        if self._left == 0:
            line = await reader.readline()
            try:
                self._left = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise TransportError("a bad chunk header: %r" % line[:40]) from None
            if self._left == 0:
                while True:  # trailers, up to the blank line
                    trailer = await reader.readline()
                    if trailer in (b"\r\n", b"\n"):
                        break
                    if not trailer:
                        raise TransportError("the answer ended inside its trailers")
                self.done = True
                return b""
        data = await reader.read(min(self._left, _CHUNK))
        if not data:
            raise TransportError("the answer ended inside a chunk")
        self._left -= len(data)
        if self._left == 0:
            await reader.readexactly(2)  # the chunk's CRLF
        return data


class AsyncTransport:
    """HTTP/1.1 to one server over asyncio streams, with a keep-alive pool."""

    def __init__(self, endpoint: Endpoint, token: Optional[str], timeout: Optional[float]) -> None:
        self.endpoint = endpoint
        self._token = token
        self._timeout = timeout
        self._idle: List[_Connection] = []
        self._closed = False

    async def _io(self, aw: Awaitable[T]) -> T:
        if self._timeout is None:
            return await aw
        try:
            return await asyncio.wait_for(aw, self._timeout)
        except asyncio.TimeoutError:
            raise TransportError("%s: no answer within %ss" % (self.endpoint, self._timeout)) from None

    async def _connect(self) -> _Connection:
        e = self.endpoint
        try:
            loop = asyncio.get_running_loop()
            if e.scheme == "unix":
                _, conn = await self._io(loop.create_unix_connection(_Connection, e.socket_path))
            else:
                context = ssl.create_default_context() if e.scheme == "https" else None
                _, conn = await self._io(loop.create_connection(_Connection, e.host, e.port, ssl=context))
        except OSError as err:
            raise TransportError("%s: %s" % (e, err)) from None
        return conn

    async def _take(self) -> Tuple[_Connection, bool]:
        if self._closed:
            raise TransportError("the client is closed")
        while self._idle:
            conn = self._idle.pop()
            if conn.usable():
                return conn, True
            conn.close()
        return await self._connect(), False

    def _give_back(self, conn: _Connection) -> None:
        if not self._closed and len(self._idle) < _POOL_SIZE and conn.usable():
            self._idle.append(conn)
        else:
            conn.close()

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
        for conn in idle:
            try:
                await conn.wait_closed()
            except Exception:
                pass

    async def _send(self, request: Request) -> Tuple[_Connection, int, Dict[str, str], _Body]:
        """Send a request; its connection, status, headers, and the unread body."""
        file_body = request.body if request.body is not None and not isinstance(request.body, bytes) else None
        start = file_body.tell() if file_body is not None else 0
        for attempt in (1, 2):
            conn, reused = await self._take()
            try:
                return (conn, *await self._exchange(conn, request))
            except _Stale as e:
                conn.close()
                if reused and attempt == 1:
                    if file_body is not None:
                        file_body.seek(start)
                    continue
                raise TransportError("%s: the connection failed: %s" % (self.endpoint, e.__cause__ or e)) from None
            except TransportError:
                conn.close()
                raise
            except (OSError, ValueError) as e:
                conn.close()
                raise TransportError("%s: %s" % (self.endpoint, str(e) or type(e).__name__)) from None
            except BaseException:  # cancelled: the connection's state is unknown
                conn.close()
                raise
        raise AssertionError("unreachable")

    async def _exchange(self, conn: _Connection, request: Request) -> Tuple[int, Dict[str, str], _Body]:
        headers = request.headers(self.endpoint, self._token)
        length = request.body_length()
        body = request.body
        # A server may answer before it reads the body (401, 413) and close the connection; a
        # write then fails, and asyncio stops reading, losing the answer. A small body goes in
        # the same write as the head (the server has it all when it answers); a big one waits
        # for the server's "100 Continue", so a refused upload is not sent at all.
        if body is not None and not isinstance(body, (bytes, bytearray)) and length <= _SMALL_BODY:
            body = body.read(length)  # a small file: sent with the head too
            if len(body) != length:
                raise ValueError("the request body ended %d bytes early" % (length - len(body)))
        expect = body is not None and length > _SMALL_BODY
        if expect:
            headers["Expect"] = "100-continue"
        head = ["%s %s HTTP/1.1" % (request.method, self.endpoint.prefix + request.path)]
        head += ["%s: %s" % kv for kv in headers.items()]
        data = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")
        try:
            if isinstance(body, (bytes, bytearray)) and not expect:
                conn.write(data + body)
                await self._io(conn.drain())
            else:
                conn.write(data)
                await self._io(conn.drain())
            if body is not None and expect:
                try:
                    first = await asyncio.wait_for(conn.readline(), _CONTINUE_WAIT)
                except asyncio.TimeoutError:
                    first = None  # no word from the server: send the body anyway
                if first is not None and not _is_continue(first):
                    # A final answer before the body: the body is not sent, and the
                    # connection is not reused (the server may still expect it).
                    answer = await self._read_head(conn, request, first)
                    answer[2].keep_alive = False
                    return answer
                if first is not None:
                    await self._skip_headers(conn)
            if isinstance(body, (bytes, bytearray)):
                if expect:
                    conn.write(body)
                    await self._io(conn.drain())
            elif body is not None:
                left = length
                while left > 0:
                    # A local (possibly spooled) file: short blocking reads are fine here.
                    chunk = body.read(min(_CHUNK, left))
                    if not chunk:
                        raise ValueError("the request body ended %d bytes early" % left)
                    conn.write(chunk)
                    await self._io(conn.drain())
                    left -= len(chunk)
        except (BrokenPipeError, ConnectionResetError) as sending:
            # The server may have answered and closed before taking the whole body: what it
            # answered is still in our buffer.
            try:
                return await self._read_head(conn, request)
            except Exception:
                raise _Stale(str(sending)) from sending
        return await self._read_head(conn, request)

    async def _skip_headers(self, conn: _Connection) -> None:
        while True:
            line = await self._io(conn.readline())
            if line in (b"\r\n", b"\n"):
                return
            if not line:
                raise _Stale("the server closed the connection")

    async def _read_head(
        self, conn: _Connection, request: Request, first: Optional[bytes] = None
    ) -> Tuple[int, Dict[str, str], _Body]:
        while True:
            if first is not None:
                line, first = first, None
            else:
                try:
                    line = await self._io(conn.readline())
                except ConnectionResetError as e:
                    raise _Stale(str(e)) from e
            if not line:
                raise _Stale("the server closed the connection")
            parts = line.decode("latin-1").rstrip("\r\n").split(" ", 2)
            if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
                raise TransportError("%s: not an HTTP answer: %r" % (self.endpoint, line[:80]))
            version, status = parts[0], int(parts[1])
            headers: Dict[str, str] = {}
            while True:
                h = await self._io(conn.readline())
                if h in (b"\r\n", b"\n"):
                    break
                if not h:
                    raise TransportError("%s: the answer ended inside its headers" % self.endpoint)
                name, _, value = h.decode("latin-1").partition(":")
                name, value = name.strip().lower(), value.strip()
                headers[name] = headers[name] + ", " + value if name in headers else value
            if 100 <= status < 200:  # informational: the real answer follows
                continue
            return status, headers, _Body(conn, request.method, version, status, headers)

    def _finish(self, conn: _Connection, body: _Body) -> None:
        if body.done and body.keep_alive:
            self._give_back(conn)
        else:
            conn.close()

    async def _read_all(self, conn: _Connection, body: _Body) -> bytes:
        parts = []
        try:
            while True:
                data = await self._io(body.read())
                if not data:
                    break
                parts.append(data)
        except (OSError, ValueError) as e:
            conn.close()
            raise TransportError("%s: reading the answer: %s" % (self.endpoint, str(e) or type(e).__name__)) from None
        except BaseException:
            conn.close()
            raise
        self._finish(conn, body)
        return b"".join(parts)

    async def request(self, request: Request) -> Response:
        conn, status, headers, body = await self._send(request)
        return Response(status, headers, await self._read_all(conn, body))

    async def call(self, op: Op[T]) -> T:
        response = await self.request(op.request)
        _core.raise_for(response)
        return op.parse(response)

    async def open(self, request: Request) -> "_AsyncOpenResponse":
        """A request whose answer is read piece by piece; an error status raises here."""
        conn, status, headers, body = await self._send(request)
        if status >= 300:
            _core.raise_for(Response(status, headers, await self._read_all(conn, body)))
        return _AsyncOpenResponse(self, conn, body)


class _AsyncOpenResponse:
    def __init__(self, transport: AsyncTransport, conn: _Connection, body: _Body) -> None:
        self._transport = transport
        self._conn: Optional[_Connection] = conn
        self._body = body

    async def read(self) -> bytes:
        if self._conn is None:
            return b""
        try:
            data = await self._transport._io(self._body.read())
        except (OSError, ValueError) as e:
            self.close()
            raise TransportError("%s: reading the answer: %s" % (self._transport.endpoint, e)) from None
        except BaseException:
            self.close()
            raise
        if not data:
            conn, self._conn = self._conn, None
            self._transport._finish(conn, self._body)
        return data

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class AsyncExecStream(AsyncIterator[StreamEvent]):
    """A running command's events (`stdout`, `stderr`, then `exit`) as they happen:
    `async for event in session.stream(...)`. The request is sent on the first iteration (or
    on entering `async with`, which also closes the connection if left early)."""

    def __init__(self, transport: AsyncTransport, request: Request) -> None:
        self._transport = transport
        self._request: Optional[Request] = request
        self._response: Optional[_AsyncOpenResponse] = None
        self._decoder = _core.EventDecoder()
        self._pending: List[StreamEvent] = []
        self._done = False

    @property
    def exit(self) -> Optional[StreamEvent]:
        return self._decoder.exit

    async def start(self) -> "AsyncExecStream":
        """Send the request now (errors such as `NotFound` raise here)."""
        if self._request is not None:
            request, self._request = self._request, None
            self._response = await self._transport.open(request)
        return self

    def __aiter__(self) -> "AsyncExecStream":
        return self

    async def __anext__(self) -> StreamEvent:
        await self.start()
        while not self._pending:
            if self._done or self._response is None:
                raise StopAsyncIteration
            data = await self._response.read()
            if data:
                self._pending.extend(self._decoder.feed(data))
            else:
                self._done = True
                self._pending.extend(self._decoder.finish())
        return self._pending.pop(0)

    async def wait(self) -> StreamEvent:
        """Read to the end; the exit event."""
        async for _ in self:
            pass
        assert self._decoder.exit is not None
        return self._decoder.exit

    async def aclose(self) -> None:
        self._done = True
        self._request = None
        self._pending.clear()
        if self._response is not None:
            self._response.close()

    async def __aenter__(self) -> "AsyncExecStream":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


class AsyncSession:
    """A live sandbox. Use it in `async with` to have it deleted however the block ends."""

    def __init__(self, transport: AsyncTransport, info: SessionInfo) -> None:
        self._t = transport
        self.id = info.id
        self.info = info

    def __repr__(self) -> str:
        return "AsyncSession(%r, backend=%r)" % (self.id, self.info.backend)

    async def refresh(self) -> SessionInfo:
        self.info = await self._t.call(_core.get_session(self.id))
        return self.info

    async def set_egress(self, allow: Sequence[str]) -> SessionInfo:
        """See `Session.set_egress`."""
        self.info = await self._t.call(_core.set_egress(self.id, allow))
        return self.info

    async def pause(self) -> SessionInfo:
        """See `Session.pause`."""
        self.info = await self._t.call(_core.pause_session(self.id))
        return self.info

    async def resume(self) -> SessionInfo:
        """See `Session.resume`."""
        self.info = await self._t.call(_core.resume_session(self.id))
        return self.info

    async def snapshot(self, name: str, *, replace: bool = False, workspace: bool = False) -> Dict[str, Any]:
        """See `Session.snapshot`."""
        return await self._t.call(_core.snapshot_session(self.id, name, replace, workspace))

    async def checkpoint(self, name: str, *, replace: bool = False) -> Dict[str, Any]:
        """See `Session.checkpoint`."""
        return await self._t.call(_core.checkpoint_session(self.id, name, replace))

    async def fork(self, count: int = 1) -> List["AsyncSession"]:
        """See `Session.fork`."""
        return [AsyncSession(self._t, info) for info in await self._t.call(_core.fork_session(self.id, count))]

    async def exec(
        self,
        command: Command,
        *,
        stdin: Union[str, bytes, None] = None,
        timeout: Optional[float] = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
    ) -> ExecResult:
        return await self._t.call(_core.exec_(self.id, command, stdin, timeout, env, cwd))

    def stream(self, command: Command, *, timeout: Optional[float] = None) -> AsyncExecStream:
        return AsyncExecStream(self._t, _core.stream(self.id, command, timeout))

    async def shell(
        self, command: str, *, timeout: Optional[float] = None, check: bool = False, name: Optional[str] = None
    ) -> ShellResult:
        return await self._t.call(_core.shell(self.id, command, timeout, check, name))

    async def python(self, code: str, *, timeout: Optional[float] = None) -> PythonResult:
        return await self._t.call(_core.python(self.id, code, timeout))

    async def vars(self) -> List[PythonVar]:
        return await self._t.call(_core.python_vars(self.id))

    async def var(self, name: str) -> Any:
        return await self._t.call(_core.python_var(self.id, name))

    async def read_file(self, path: str) -> bytes:
        return await self._t.call(_core.read_file(self.id, path))

    async def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return (await self.read_file(path)).decode(encoding)

    async def write_file(self, path: str, data: Union[bytes, str]) -> None:
        await self._t.call(_core.write_file(self.id, path, data))

    async def mkdir(self, path: str) -> None:
        await self._t.call(_core.make_dir(self.id, path))

    async def list_files(self, path: str = "") -> List[FileEntry]:
        return await self._t.call(_core.list_files(self.id, path))

    async def upload(self, local: PathLike, path: str = "") -> UploadReport:
        # Packing reads and compresses a whole directory: off the event loop.
        body, length = await asyncio.to_thread(_tar.pack, local)
        with body:
            return await self._t.call(_core.upload(self.id, path, body, length))

    async def upload_tar(
        self, data: Union[bytes, IO[bytes]], path: str = "", *, length: Optional[int] = None
    ) -> UploadReport:
        return await self._t.call(_core.upload(self.id, path, data, length))

    async def download(self, path: str = "") -> bytes:
        return await self._t.call(_core.download(self.id, path))

    async def delete(self) -> None:
        await self._t.call(_core.delete_session(self.id))

    async def __aenter__(self) -> "AsyncSession":
        return self

    async def __aexit__(
        self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        await _close_session(self, exc is not None)


async def _close_session(session: AsyncSession, failing: bool) -> None:
    """The end of a session's `async with`: delete it, even when the block was cancelled (the
    delete is shielded). A session already gone is fine; when the block failed, its exception
    wins over a failed delete."""
    try:
        await asyncio.shield(session.delete())
    except NotFound:
        pass
    except RunnerError:
        if not failing:
            raise


class _SessionStart:
    """What `AsyncClient.session(...)` returns: await it for a session, or `async with` it
    for one deleted at the end of the block."""

    def __init__(self, sessions: "AsyncSessions", kwargs: Dict[str, Any]) -> None:
        self._sessions = sessions
        self._kwargs = kwargs
        self._session: Optional[AsyncSession] = None

    def __await__(self) -> Generator[Any, None, AsyncSession]:
        return self._sessions.create(**self._kwargs).__await__()

    async def __aenter__(self) -> AsyncSession:
        self._session = await self._sessions.create(**self._kwargs)
        return self._session

    async def __aexit__(
        self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        if self._session is not None:
            await _close_session(self._session, exc is not None)


class AsyncSessions:
    """`client.sessions`: create, find and list sessions."""

    def __init__(self, transport: AsyncTransport) -> None:
        self._t = transport

    async def create(
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
    ) -> AsyncSession:
        body = _core.session_body(environment, manifest, environment_name, workspace, static_assets, mounts, backend)
        # See `Sessions.create` of the synchronous client.
        _core.pause_options(body, auto_resume, idle_pause_seconds)
        if pool is not None:
            # False: a sandbox of its own even when a warm pool fits (one to checkpoint or fork).
            body["pool"] = bool(pool)
        return AsyncSession(self._t, await self._t.call(_core.create_session(body)))

    async def restore(
        self, checkpoint: str, *, auto_resume: bool = False, idle_pause_seconds: Optional[float] = None
    ) -> AsyncSession:
        """See `Sessions.restore`."""
        body = _core.restore_body(checkpoint, auto_resume, idle_pause_seconds)
        return AsyncSession(self._t, await self._t.call(_core.create_session(body)))

    async def checkpoints(self) -> List[Dict[str, Any]]:
        return await self._t.call(_core.list_checkpoints())

    async def remove_checkpoint(self, name: str) -> None:
        await self._t.call(_core.delete_checkpoint(name))

    async def get(self, session_id: str) -> AsyncSession:
        return AsyncSession(self._t, await self._t.call(_core.get_session(session_id)))

    async def list(self) -> List[SessionInfo]:
        return await self._t.call(_core.list_sessions())


class AsyncPools:
    """`client.pools`: warm pools, made and removed over HTTP."""

    def __init__(self, transport: AsyncTransport) -> None:
        self._t = transport

    async def create(
        self,
        name: str,
        environment: Environment,
        *,
        size: Optional[int] = None,
        workspace: bool = True,
        static_assets: bool = False,
        snapshot: Optional[str] = None,
    ) -> Pool:
        return await self._t.call(_core.create_pool(name, environment, size, workspace, static_assets, snapshot))

    async def list(self) -> List[Pool]:
        return await self._t.call(_core.list_pools())

    async def delete(self, name: str) -> List[str]:
        return await self._t.call(_core.delete_pool(name))


class AsyncJobs:
    """`client.jobs`: submit manifests, follow and remove their Jobs."""

    def __init__(self, transport: AsyncTransport) -> None:
        self._t = transport

    async def apply(self, manifest: ManifestInput, *, replace: bool = False) -> List[str]:
        return await self._t.call(_core.apply(manifest, replace))

    async def apply_file(self, path: PathLike, *, replace: bool = False) -> List[str]:
        return await self.apply(pathlib.Path(os.fspath(path)), replace=replace)

    async def list(self, label_selector: Union[str, Mapping[str, str], None] = None) -> List[Job]:
        return await self._t.call(_core.list_jobs(label_selector))

    async def get(self, name: str) -> Job:
        return await self._t.call(_core.get_job(name))

    async def wait(self, name: str, timeout: Optional[float] = None, *, poll_interval: float = 0.5) -> Job:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = min(0.05, poll_interval)
        while True:
            job = await self.get(name)
            if job.finished:
                return job
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout("job %s is still %s after %ss" % (name, job.phase, timeout), job)
            pause = delay if deadline is None else max(0.0, min(delay, deadline - time.monotonic()))
            await asyncio.sleep(pause)
            delay = min(delay * 2, poll_interval)

    async def logs(self, name: str) -> str:
        return await self._t.call(_core.job_logs(name))

    async def delete(self, name: str) -> None:
        await self._t.call(_core.delete_job(name))


class AsyncClient:
    """A `runner serve` server, for asyncio; the same arguments as `Client`. Close it with
    `await client.aclose()` or `async with`."""

    def __init__(
        self,
        url: Optional[str] = None,
        *,
        token: Optional[str] = None,
        socket: Optional[PathLike] = None,
        timeout: Optional[float] = None,
    ) -> None:
        self.endpoint = _core.endpoint(url, socket)
        self._t = AsyncTransport(self.endpoint, _core.token(token), timeout)
        self.sessions = AsyncSessions(self._t)
        self.jobs = AsyncJobs(self._t)
        self.pools = AsyncPools(self._t)

    def __repr__(self) -> str:
        return "AsyncClient(%r)" % str(self.endpoint)

    async def health(self) -> Dict[str, Any]:
        return await self._t.call(_core.health())

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
    ) -> _SessionStart:
        """`async with client.session({...}) as s:` (deleted at the end), or
        `s = await client.session({...})`."""
        return _SessionStart(
            self.sessions,
            dict(
                environment=environment,
                manifest=manifest,
                environment_name=environment_name,
                workspace=workspace,
                static_assets=static_assets,
                mounts=mounts,
                backend=backend,
                auto_resume=auto_resume,
                idle_pause_seconds=idle_pause_seconds,
                pool=pool,
            ),
        )

    async def aclose(self) -> None:
        await self._t.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()
