"""Exceptions: every failure the server answers becomes a `RunnerError` carrying its status,
the server's message and the decoded body; each status has its own subclass."""

from __future__ import annotations

from typing import Any, Dict, Optional, Type

__all__ = [
    "RunnerError",
    "BadRequest",
    "Unauthorized",
    "NotFound",
    "Conflict",
    "TooLarge",
    "Unprocessable",
    "CommandFailed",
    "ServerError",
    "NotSupported",
    "Unavailable",
    "TransportError",
    "WaitTimeout",
    "error_for",
]


class RunnerError(Exception):
    """A request the server refused or failed.

    `status` is the HTTP status (0 for failures that never got one, see `TransportError`),
    `message` the server's `error` text, `body` the decoded JSON body (or the raw text when
    the body was not JSON).
    """

    def __init__(self, status: int, message: str, body: Any = None) -> None:
        super().__init__(status, message, body)
        self.status = status
        self.message = message
        self.body = body

    def __str__(self) -> str:
        if self.status:
            return "%d: %s" % (self.status, self.message)
        return self.message

    def __repr__(self) -> str:
        return "%s(status=%d, message=%r)" % (type(self).__name__, self.status, self.message)


class BadRequest(RunnerError):
    """400: a field, query or body the server could not accept."""


class Unauthorized(RunnerError):
    """401: missing or wrong bearer token."""


class NotFound(RunnerError):
    """404: no such session, job, file, variable or route."""


class Conflict(RunnerError):
    """409: e.g. applying a Job whose namesake still runs."""


class TooLarge(RunnerError):
    """413: the request body is over the server's cap."""


class Unprocessable(RunnerError):
    """422: the request was understood but refused or failed (e.g. a session's setup)."""


class CommandFailed(Unprocessable):
    """422 from a shell call with `check=True`: the command failed; its output is kept."""

    @property
    def output(self) -> str:
        return str(self._field("output", ""))

    @property
    def exit_code(self) -> Optional[int]:
        code = self._field("exitCode", None)
        return code if isinstance(code, int) else None

    @property
    def timed_out(self) -> bool:
        return bool(self._field("timedOut", False))

    def _field(self, key: str, default: Any) -> Any:
        return self.body.get(key, default) if isinstance(self.body, dict) else default


class ServerError(RunnerError):
    """500 (or any other 5xx without its own class): the server failed."""


class NotSupported(RunnerError):
    """501: the session or backend cannot do this (e.g. Python on a host session)."""


class Unavailable(RunnerError):
    """503: a backend the request needs (containerd) is not available."""


class TransportError(RunnerError, ConnectionError):
    """The server could not be reached, or answered something that is not HTTP (status 0)."""

    def __init__(self, message: str) -> None:
        super().__init__(0, message, None)


class WaitTimeout(RunnerError, TimeoutError):
    """`jobs.wait` gave up before the Job finished; `job` is the last state seen (status 0)."""

    def __init__(self, message: str, job: Any = None) -> None:
        super().__init__(0, message, None)
        self.job = job


_BY_STATUS: Dict[int, Type[RunnerError]] = {
    400: BadRequest,
    401: Unauthorized,
    404: NotFound,
    409: Conflict,
    413: TooLarge,
    422: Unprocessable,
    500: ServerError,
    501: NotSupported,
    503: Unavailable,
}


def error_for(status: int, body: Any) -> RunnerError:
    """The exception for an error answer: its class by status, its message from `error`."""
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        message = body["error"]
    elif isinstance(body, str) and body.strip():
        message = body.strip()
    else:
        message = "HTTP %d" % status
    cls = _BY_STATUS.get(status)
    if status == 422 and isinstance(body, dict) and ("exitCode" in body or "output" in body):
        cls = CommandFailed
    if cls is None:
        cls = ServerError if status >= 500 else RunnerError
    return cls(status, message, body)
