"""Terminals and watches. Terminals: a command on a pseudo-terminal in a session (`Session.terminal(...)`), over the
server's WebSocket `GET /v1/sessions/{id}/pty` (a small RFC 6455 client on the standard library;
TCP, TLS or a unix socket, as the client's other calls).

    with session.terminal(["python3", "-i"], rows=30, cols=100) as t:
        t.expect(">>> ")
        t.write("print(6 * 7)\\r")
        print(t.expect("42"))
        t.signal("INT")          # to the terminal's foreground process group, as Ctrl-C
        t.resize(40, 120)
    # leaving the block hangs the terminal up; `t.exit_code` once it ended
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import select
import socket as _socket
import ssl
import struct
import threading
import time
from typing import Any, Dict, Iterator, List, Mapping, Optional, Pattern, Sequence, Union

from . import _core
from .errors import TransportError, WaitTimeout

__all__ = ["Terminal", "open_terminal", "watch_events"]

_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
_MAX_HEAD = 64 << 10
_MAX_FRAME = 16 << 20
_OP_CONT, _OP_TEXT, _OP_BINARY, _OP_CLOSE, _OP_PING, _OP_PONG = 0, 1, 2, 8, 9, 10
# What one write sends at most per message (the server takes messages of up to 64 KiB).
_WRITE_CHUNK = 32 << 10


def _connect(endpoint: _core.Endpoint, timeout: Optional[float]) -> _socket.socket:
    if endpoint.scheme == "unix":
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(endpoint.socket_path)
        except BaseException:
            sock.close()
            raise
        return sock
    sock = _socket.create_connection((endpoint.host, endpoint.port), timeout=timeout)
    if endpoint.scheme == "https":
        sock = ssl.create_default_context().wrap_socket(sock, server_hostname=endpoint.host)
    return sock


class Terminal:
    """An open terminal: `read`/`expect` its screen output, `write` keys, `resize`, `signal`,
    `close` (hang up), `wait` for its end. Reads belong to one thread at a time; writes and
    control messages may come from another."""

    def __init__(self, sock: _socket.socket, rest: bytes) -> None:
        self._sock = sock
        self._inbuf = rest  # received bytes not yet parsed into frames
        self._output = b""  # screen output received but not yet returned
        self._send_lock = threading.Lock()
        self._closed = False  # the socket is done
        self._ended = False  # the server closed the stream
        self.exit_code: Optional[int] = None
        """The command's exit status once it ended (128 + N when signal N ended it)."""
        self.errors: List[str] = []
        """What the server refused of the control messages sent."""

    # ---- frames

    def _send_frame(self, opcode: int, payload: bytes) -> None:
        mask = os.urandom(4)
        n = len(payload)
        if n < 126:
            head = struct.pack("!BB", 0x80 | opcode, 0x80 | n)
        elif n < 1 << 16:
            head = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, n)
        else:
            head = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, n)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        with self._send_lock:
            if self._closed:
                raise TransportError("the terminal is closed")
            try:
                self._sock.sendall(head + mask + masked)
            except OSError as e:
                raise TransportError("the terminal's connection broke: %s" % e) from None

    def _fill(self, need: int, deadline: Optional[float]) -> bool:
        """At least `need` bytes in the input buffer; False on timeout."""
        while len(self._inbuf) < need:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            ready, _, _ = select.select([self._sock], [], [], left)
            if not ready and not (isinstance(self._sock, ssl.SSLSocket) and self._sock.pending()):
                return False
            try:
                data = self._sock.recv(65536)
            except OSError as e:
                raise TransportError("the terminal's connection broke: %s" % e) from None
            if not data:
                raise TransportError("the server closed the terminal's connection without a close")
            self._inbuf += data
        return True

    def _frame(self, deadline: Optional[float]) -> Optional["tuple[int, bytes]"]:
        """The next whole message (opcode, payload); None on timeout."""
        opcode_first: Optional[int] = None
        parts: List[bytes] = []
        while True:
            if not self._fill(2, deadline):
                if parts:  # keep what was taken of a fragmented message
                    raise TransportError("a fragmented message stalled")
                return None
            b0, b1 = self._inbuf[0], self._inbuf[1]
            n, off = b1 & 0x7F, 2
            if n == 126:
                if not self._fill(4, deadline):
                    return None
                n, off = struct.unpack("!H", self._inbuf[2:4])[0], 4
            elif n == 127:
                if not self._fill(10, deadline):
                    return None
                n, off = struct.unpack("!Q", self._inbuf[2:10])[0], 10
            if n > _MAX_FRAME:
                raise TransportError("the server sent a frame of %d bytes" % n)
            if b1 & 0x80:
                raise TransportError("the server sent a masked frame")
            if not self._fill(off + n, deadline):
                return None
            payload, self._inbuf = self._inbuf[off : off + n], self._inbuf[off + n :]
            opcode = b0 & 0x0F
            if opcode >= 8:  # control frames come whole, even between fragments
                if opcode == _OP_PING:
                    self._send_frame(_OP_PONG, payload)
                    continue
                if opcode == _OP_PONG:
                    continue
                return opcode, payload
            if opcode_first is None:
                opcode_first = opcode
            parts.append(payload)
            if b0 & 0x80:
                return opcode_first, b"".join(parts)

    def _pump(self, deadline: Optional[float]) -> bool:
        """Take one message; False on timeout or at the end."""
        if self._ended:
            return False
        got = self._frame(deadline)
        if got is None:
            return False
        opcode, payload = got
        if opcode == _OP_BINARY:
            self._output += payload
        elif opcode == _OP_TEXT:
            message = json.loads(payload.decode("utf-8"))
            if message.get("type") == "exit":
                code, signal = message.get("exitCode"), message.get("signal")
                self.exit_code = code if code is not None else (128 + signal if signal is not None else -1)
            elif message.get("type") == "error":
                self.errors.append(str(message.get("message")))
        elif opcode == _OP_CLOSE:
            self._ended = True
            try:
                self._send_frame(_OP_CLOSE, payload[:2])
            except TransportError:
                pass
            self._shutdown()
        return True

    def _shutdown(self) -> None:
        with self._send_lock:
            if not self._closed:
                self._closed = True
                self._sock.close()

    # ---- the API

    def read(self, timeout: Optional[float] = None) -> bytes:
        """Screen output as it comes: what arrived (waiting up to `timeout` seconds for some,
        None: until some comes); b"" on timeout and once the terminal ended."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._output:
            if not self._pump(deadline):
                break
        out, self._output = self._output, b""
        return out

    def expect(self, pattern: Union[str, bytes, Pattern[bytes]], timeout: float = 30.0) -> bytes:
        """Read until `pattern` (text, bytes, or a compiled bytes regex) appears; everything
        read up to the end of the match. What follows stays for the next read. Raises
        WaitTimeout (with what was read) when it does not appear in time or the terminal ends."""
        if isinstance(pattern, str):
            pattern = pattern.encode("utf-8")
        regex = re.compile(re.escape(pattern)) if isinstance(pattern, bytes) else pattern
        deadline = time.monotonic() + timeout
        while True:
            found = regex.search(self._output)
            if found:
                out, self._output = self._output[: found.end()], self._output[found.end() :]
                return out
            if not self._pump(deadline):
                seen = self._output.decode("utf-8", "replace")
                why = "the terminal ended" if self._ended else "not within %ss" % timeout
                raise WaitTimeout("%r did not appear (%s); the terminal showed: %r" % (regex.pattern, why, seen[-2000:]))

    def write(self, data: Union[bytes, str]) -> None:
        """Keys in (text is sent as UTF-8; Enter is "\\r", Ctrl-C "\\x03")."""
        if isinstance(data, str):
            data = data.encode("utf-8")
        for i in range(0, len(data), _WRITE_CHUNK):
            self._send_frame(_OP_BINARY, data[i : i + _WRITE_CHUNK])

    def _control(self, message: Mapping[str, Any]) -> None:
        self._send_frame(_OP_TEXT, json.dumps(message).encode("utf-8"))

    def resize(self, rows: int, cols: int) -> None:
        """A new window size (the programs get SIGWINCH)."""
        self._control({"type": "resize", "rows": rows, "cols": cols})

    def signal(self, signal: Union[str, int] = "INT") -> None:
        """Signal the terminal's foreground process group (by name, `INT`, or number)."""
        self._control({"type": "signal", "signal": signal})

    def wait(self, timeout: Optional[float] = None) -> int:
        """Wait for the command to end (what it still prints is kept for `read`); its status."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.exit_code is None and not self._ended:
            if not self._pump(deadline) and not self._ended:
                raise WaitTimeout("the terminal's command did not end within %ss" % timeout)
        return self.exit_code if self.exit_code is not None else -1

    def close(self) -> None:
        """Hang up: the command gets SIGHUP (and is killed if it outlives a grace)."""
        if self._closed:
            return
        try:
            self._send_frame(_OP_CLOSE, struct.pack("!H", 1000))
        except TransportError:
            pass
        self._shutdown()

    def __enter__(self) -> "Terminal":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def open_terminal(
    endpoint: _core.Endpoint,
    token: Optional[str],
    session_id: str,
    command: Optional[_core.Command] = None,
    *,
    rows: int = 24,
    cols: int = 80,
    env: Optional[Mapping[str, str]] = None,
    cwd: Optional[str] = None,
    timeout: Optional[float] = 30.0,
) -> Terminal:
    """Open a terminal in a session (`command`: an argv list, a string for `/bin/sh -c`, or
    None for the image's shell). Errors come as the other calls' (NotFound, BadRequest...)."""
    query: List["tuple[str, str]"] = []
    if command is not None:
        argv: Sequence[str] = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        query += [("arg", a) for a in argv]
    query += [("rows", str(rows)), ("cols", str(cols))]
    query += [("env", "%s=%s" % (k, v)) for k, v in (env or {}).items()]
    if cwd is not None:
        query.append(("cwd", cwd))
    from urllib.parse import urlencode

    path = endpoint.prefix + _core._session_path(session_id, "pty") + "?" + urlencode(query)
    key = base64.b64encode(os.urandom(16)).decode("ascii")
    head = [
        "GET %s HTTP/1.1" % path,
        "Host: %s" % endpoint.host_header,
        "User-Agent: %s" % _core.USER_AGENT,
        "Upgrade: websocket",
        "Connection: Upgrade",
        "Sec-WebSocket-Key: %s" % key,
        "Sec-WebSocket-Version: 13",
    ]
    if token:
        head.append("Authorization: Bearer %s" % token)
    try:
        sock = _connect(endpoint, timeout)
    except OSError as e:
        raise TransportError("%s: %s" % (endpoint, e)) from None
    try:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                raise TransportError("%s: the server closed the connection before answering" % endpoint)
            data += chunk
            if len(data) > _MAX_HEAD:
                raise TransportError("%s: an answer's head over %d bytes" % (endpoint, _MAX_HEAD))
        raw_head, rest = data.split(b"\r\n\r\n", 1)
        lines = raw_head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers: Dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if status != 101:
            length = int(headers.get("content-length", "0"))
            while len(rest) < length:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                rest += chunk
            _core.raise_for(_core.Response(status, headers, rest[:length]))
            raise TransportError("%s: HTTP %d instead of a WebSocket" % (endpoint, status))
        accept = base64.b64encode(hashlib.sha1(key.encode("ascii") + _GUID).digest()).decode("ascii")
        if headers.get("sec-websocket-accept") != accept:
            raise TransportError("%s: a WebSocket answer with the wrong accept key" % endpoint)
        sock.settimeout(None)
        return Terminal(sock, rest)
    except BaseException:
        sock.close()
        raise


def watch_events(opened: Any) -> Iterator[Dict[str, Any]]:
    """The events of an open watch response (NDJSON), one dict each, as they come."""
    pending = b""
    try:
        while True:
            data = opened.read1()
            if not data:
                return
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                if line.strip():
                    yield json.loads(line.decode("utf-8"))
    finally:
        opened.close()
