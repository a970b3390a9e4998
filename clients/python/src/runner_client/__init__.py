"""Python client of `runner serve`: live sandboxes (sessions) and Jobs over its HTTP API.

    from runner_client import Client
    with Client("http://127.0.0.1:8080") as client:          # token: $RUNNER_TOKEN
        with client.session({"backend": "host"}) as s:       # deleted at the end of the block
            print(s.exec(["echo", "hi"]).stdout)

`AsyncClient` is the same API for asyncio (`await` every call, `async with`, `async for`).
"""

from ._aio import AsyncClient, AsyncExecStream, AsyncJobs, AsyncPools, AsyncSession, AsyncSessions
from ._sync import Client, ExecStream, Jobs, Pools, Session, Sessions
from .errors import (
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
    WaitTimeout,
)
from .manifest import environment_from_manifest, load_documents
from .terminal import Terminal
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

__version__ = "0.1.0"

__all__ = [
    "Client",
    "Session",
    "Sessions",
    "Jobs",
    "Pools",
    "ExecStream",
    "AsyncClient",
    "AsyncSession",
    "AsyncSessions",
    "AsyncJobs",
    "AsyncPools",
    "AsyncExecStream",
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
    "ExecResult",
    "FileEntry",
    "Job",
    "Pool",
    "PythonResult",
    "PythonVar",
    "SessionInfo",
    "ShellResult",
    "StreamEvent",
    "UploadReport",
    "Terminal",
    "environment_from_manifest",
    "load_documents",
]
