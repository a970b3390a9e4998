"""Which `runner serve` a harness talks to: the node's, named by the environment the harness
runs in, as the Python client reads it, plus a token file (what a node's service manager
hands out without putting the secret itself in the environment)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from runner_client import AsyncClient, Client

URL_ENV = "RUNNER_URL"
"""`http://127.0.0.1:8080` or `unix:/run/runner.sock`, as `runner serve` prints it."""
SOCKET_ENV = "RUNNER_SOCKET"
"""A unix socket's path (instead of RUNNER_URL)."""
TOKEN_ENV = "RUNNER_TOKEN"
TOKEN_FILE_ENV = "RUNNER_TOKEN_FILE"
"""A file holding the token (the one `runner serve --token-file` reads)."""


class ConnectionSettingsError(ValueError):
    """The environment names no usable server or token."""


@dataclass(frozen=True)
class Server:
    """Where the server is and how to authenticate; never printed with its token."""

    url: Optional[str]
    socket: Optional[str]
    token: Optional[str]

    def __repr__(self) -> str:
        where = self.socket and "unix:" + self.socket or self.url or "http://127.0.0.1:8080"
        return "Server(%s, token=%s)" % (where, "set" if self.token else "none")

    @property
    def address(self) -> str:
        if self.socket:
            return "unix:" + self.socket
        return self.url or os.environ.get(URL_ENV) or "http://127.0.0.1:8080"

    def client(self, timeout: Optional[float] = None) -> Client:
        if self.socket:
            return Client(socket=self.socket, token=self.token, timeout=timeout)
        return Client(self.url, token=self.token, timeout=timeout)

    def async_client(self, timeout: Optional[float] = None) -> AsyncClient:
        if self.socket:
            return AsyncClient(socket=self.socket, token=self.token, timeout=timeout)
        return AsyncClient(self.url, token=self.token, timeout=timeout)


def server_from_env(
    url: Optional[str] = None,
    *,
    socket: Optional[str] = None,
    token: Optional[str] = None,
    token_file: Optional[str] = None,
) -> Server:
    """The server from arguments, else RUNNER_URL / RUNNER_SOCKET and RUNNER_TOKEN /
    RUNNER_TOKEN_FILE. A token is required: `runner serve` answers 401 to everything but
    /healthz without one, and saying so here is clearer than a 401 on the first sandbox."""
    url = url or os.environ.get(URL_ENV) or None
    socket = socket or os.environ.get(SOCKET_ENV) or None
    if url and socket:
        raise ConnectionSettingsError(
            "both a URL (%s) and a socket (%s) name the runner server: set one" % (URL_ENV, SOCKET_ENV)
        )
    token = token or os.environ.get(TOKEN_ENV) or None
    token_file = token_file or os.environ.get(TOKEN_FILE_ENV) or None
    if token is None and token_file is not None:
        try:
            with open(token_file, encoding="utf-8") as f:
                token = f.read().strip() or None
        except OSError as e:
            raise ConnectionSettingsError("%s=%s: %s" % (TOKEN_FILE_ENV, token_file, e.strerror)) from None
        if token is None:
            raise ConnectionSettingsError("%s=%s is empty" % (TOKEN_FILE_ENV, token_file))
    if token is None:
        raise ConnectionSettingsError(
            "no token for runner serve: set %s (or %s to the file `runner serve --token-file` reads)"
            % (TOKEN_ENV, TOKEN_FILE_ENV)
        )
    return Server(url=url, socket=socket, token=token)
