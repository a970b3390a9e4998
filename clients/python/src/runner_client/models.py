"""What the server answers, as typed objects. Each keeps the decoded JSON it came from in
`raw`, so fields this client does not know yet are still reachable."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Mapping, Optional

__all__ = [
    "SessionInfo",
    "ExecResult",
    "StreamEvent",
    "ShellResult",
    "PythonResult",
    "PythonVar",
    "FileEntry",
    "UploadReport",
    "Job",
    "JobPhase",
    "Pool",
]

JobPhase = Literal["Pending", "Running", "Succeeded", "Failed"]
EventType = Literal["stdout", "stderr", "exit"]


def _int(v: Any) -> Optional[int]:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _str(v: Any, default: str = "") -> str:
    return v if isinstance(v, str) else default


def _opt_str(v: Any) -> Optional[str]:
    return v if isinstance(v, str) else None


def _obj(v: Any) -> Dict[str, Any]:
    return dict(v) if isinstance(v, dict) else {}


@dataclass(frozen=True)
class SessionInfo:
    """A session as the server describes it (`GET /v1/sessions/{id}`)."""

    id: str
    backend: str
    workspace: str
    created: str
    idle_seconds: int
    active_calls: int
    state: str = "running"
    """`running`, `paused` (its processes frozen: `Session.pause`), or `ended` (its sandbox
    ended under it — its init was killed or the shim it shared died: only `delete` is left)."""
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "SessionInfo":
        return cls(
            id=_str(d.get("id")),
            backend=_str(d.get("backend")),
            workspace=_str(d.get("workspace")),
            created=_str(d.get("created")),
            idle_seconds=_int(d.get("idleSeconds")) or 0,
            active_calls=_int(d.get("activeCalls")) or 0,
            state=_str(d.get("state")) or "running",
            raw=dict(d),
        )


@dataclass(frozen=True)
class ExecResult:
    """What one command did (`exec`, and a Job's `status.result`)."""

    exit_code: Optional[int]
    """The exit status, or None when a signal ended the process."""
    signal: Optional[int]
    timed_out: bool
    oom_killed: bool
    stdout: str
    stderr: str
    stdout_dropped_bytes: int = 0
    stderr_dropped_bytes: int = 0
    duration_ms: int = 0
    peak_memory_bytes: Optional[int] = None
    cpu_time_ms: Optional[int] = None
    setup: Optional[Dict[str, Any]] = None
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        """Exited 0, within its time."""
        return self.exit_code == 0 and not self.timed_out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "ExecResult":
        setup = d.get("setup")
        return cls(
            exit_code=_int(d.get("exitCode")),
            signal=_int(d.get("signal")),
            timed_out=bool(d.get("timedOut", False)),
            oom_killed=bool(d.get("oomKilled", False)),
            stdout=_str(d.get("stdout")),
            stderr=_str(d.get("stderr")),
            stdout_dropped_bytes=_int(d.get("stdoutDroppedBytes")) or 0,
            stderr_dropped_bytes=_int(d.get("stderrDroppedBytes")) or 0,
            duration_ms=_int(d.get("durationMs")) or 0,
            peak_memory_bytes=_int(d.get("peakMemoryBytes")),
            cpu_time_ms=_int(d.get("cpuTimeMs")),
            setup=dict(setup) if isinstance(setup, dict) else None,
            raw=dict(d),
        )


@dataclass(frozen=True)
class StreamEvent:
    """One line of `exec/stream`: output as it happens (`stdout`, `stderr`), then `exit`."""

    type: EventType
    data: str = ""
    """The text of a stdout/stderr event."""
    exit_code: Optional[int] = None
    signal: Optional[int] = None
    timed_out: bool = False
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "StreamEvent":
        kind = d.get("type")
        if kind not in ("stdout", "stderr", "exit"):
            raise ValueError("unknown stream event %r" % (kind,))
        return cls(
            type=kind,
            data=_str(d.get("data")),
            exit_code=_int(d.get("exitCode")),
            signal=_int(d.get("signal")),
            timed_out=bool(d.get("timedOut", False)),
            raw=dict(d),
        )


@dataclass(frozen=True)
class ShellResult:
    """A stateful-shell call: stdout and stderr interleaved as a terminal shows them."""

    output: str
    exit_code: Optional[int]
    timed_out: bool
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "ShellResult":
        return cls(
            output=_str(d.get("output")),
            exit_code=_int(d.get("exitCode")),
            timed_out=bool(d.get("timedOut", False)),
            raw=dict(d),
        )


@dataclass(frozen=True)
class PythonResult:
    """Code run in the session's persistent interpreter."""

    output: str
    stderr: str
    error: Optional[str]
    """The traceback when the code raised (the interpreter survives it)."""
    vars: List[str]
    timed_out: bool = False
    oom_killed: bool = False
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "PythonResult":
        names = d.get("vars")
        return cls(
            output=_str(d.get("output")),
            stderr=_str(d.get("stderr")),
            error=_opt_str(d.get("error")),
            vars=[n for n in names if isinstance(n, str)] if isinstance(names, list) else [],
            timed_out=bool(d.get("timedOut", False)),
            oom_killed=bool(d.get("oomKilled", False)),
            raw=dict(d),
        )


@dataclass(frozen=True)
class PythonVar:
    """One variable of the interpreter, as listed by `vars()`."""

    name: str
    type: str
    summary: str

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "PythonVar":
        return cls(name=_str(d.get("name")), type=_str(d.get("type")), summary=_str(d.get("summary")))


@dataclass(frozen=True)
class FileEntry:
    """One entry of a workspace directory listing."""

    name: str
    type: str
    """`file`, `directory`, `symlink` or `other`."""
    size: int
    mode: int
    """Permission bits, e.g. 0o644."""
    mtime: int
    """Modification time, seconds since the epoch."""
    target: Optional[str] = None
    """A symlink's target as stored (never followed)."""

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "FileEntry":
        return cls(
            name=_str(d.get("name")),
            type=_str(d.get("type")),
            size=_int(d.get("size")) or 0,
            mode=_int(d.get("mode")) or 0,
            mtime=_int(d.get("mtime")) or 0,
            target=_opt_str(d.get("target")),
        )


@dataclass(frozen=True)
class UploadReport:
    """What a tar upload created."""

    files: int
    dirs: int
    symlinks: int
    hardlinks: int
    bytes: int

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "UploadReport":
        return cls(
            files=_int(d.get("files")) or 0,
            dirs=_int(d.get("dirs")) or 0,
            symlinks=_int(d.get("symlinks")) or 0,
            hardlinks=_int(d.get("hardlinks")) or 0,
            bytes=_int(d.get("bytes")) or 0,
        )


@dataclass(frozen=True)
class Job:
    """A Job as the server shows it (a Kubernetes-style object); `raw` is the whole object."""

    name: str
    labels: Dict[str, str]
    phase: str
    """`Pending`, `Running`, `Succeeded` or `Failed`."""
    reason: Optional[str]
    message: Optional[str]
    result: Optional[ExecResult]
    """The deciding attempt's result, once there is one."""
    status: Dict[str, Any]
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def finished(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    @property
    def succeeded(self) -> bool:
        return self.phase == "Succeeded"

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Job":
        meta = _obj(d.get("metadata"))
        status = _obj(d.get("status"))
        result = status.get("result")
        return cls(
            name=_str(meta.get("name")),
            labels={str(k): str(v) for k, v in _obj(meta.get("labels")).items()},
            phase=_str(status.get("phase")),
            reason=_opt_str(status.get("reason")),
            message=_opt_str(status.get("message")),
            result=ExecResult.from_json(result) if isinstance(result, dict) else None,
            status=status,
            raw=dict(d),
        )


@dataclass(frozen=True)
class Pool:
    """A warm pool: containers of one Environment started ahead of time. A session whose
    Environment is the pool's (same image, resources, user, hardening) claims a member."""

    name: str
    environment: str
    size: int
    ready: int
    """Members waiting to be claimed now."""
    broken: int
    workspace: bool
    static_assets: bool
    key: str
    created: str
    snapshot: Optional[str] = None
    """The snapshot members start from, when not the Environment's image."""
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Pool":
        return cls(
            name=_str(d.get("name")),
            environment=_str(d.get("environment")),
            size=_int(d.get("size")) or 0,
            ready=_int(d.get("ready")) or 0,
            broken=_int(d.get("broken")) or 0,
            workspace=bool(d.get("workspace", False)),
            static_assets=bool(d.get("staticAssets", False)),
            key=_str(d.get("key")),
            created=_str(d.get("created")),
            snapshot=_str(d.get("snapshot")) if d.get("snapshot") is not None else None,
            raw=dict(d),
        )
