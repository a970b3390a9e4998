"""One runner session as an evaluation harness uses it: commands with stdin, cwd, env, a user
and a timeout; files and directories anywhere in the sandbox, text or binary; removal.

Everything happens inside the sandbox through runner's exec API, so each operation has the
meaning it has for `docker exec`: paths are the sandbox's (not only its workspace), links are
followed as the sandbox's own processes follow them, and what is written belongs to the
sandbox's user. runner's files API works on the workspace from the host; a harness wants the
container's view, which is what this module gives. The Inspect, Harbor and mini-swe-agent
adapters are thin layers over it.
"""

from __future__ import annotations

import asyncio
import base64
import errno
import io
import os
import posixpath
import tarfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import anyio
from runner_client import (
    AsyncClient,
    AsyncSession,
    Conflict,
    ExecResult,
    NotFound,
    TransportError,
    Unavailable,
)

from . import _commands as cmd

# Reads come back as base64 on stdout, which the server caps per stream (10 MiB by default):
# 4 MiB of file is 5.4 MiB of text. A server with a smaller cap makes the reader shrink its
# chunks (it sees the dropped bytes) down to one block.
_READ_BLOCKS = (4 << 20) // cmd.READ_BLOCK
# Writes go as base64 stdin inside a JSON body, which the server caps at 4 MiB.
_WRITE_CHUNK = 2 << 20
# Larger stdin is written to a file in the sandbox first (the JSON body is capped at 4 MiB, and
# bytes that are not UTF-8 travel as base64).
_STDIN_INLINE = 2 << 20
# How long one chunk of a transfer may take in the sandbox.
_TRANSFER_TIMEOUT = 600.0
# Where directory transfers stage their tar in the sandbox.
_STAGING_DIR = "/tmp"


class SandboxError(RuntimeError):
    """A sandbox operation failed for a reason of the sandbox or the server."""


class SandboxGone(SandboxError):
    """The session is gone (ended, evicted, its server stopped or unreachable): nothing more
    can run in it."""


class UserSwitchUnsupported(SandboxError):
    """The sandbox cannot run commands as the requested user (no setpriv or su in its image,
    or its processes are not root)."""


class FileTooLarge(SandboxError):
    def __init__(self, path: str, size: int, limit: int) -> None:
        super().__init__("%s is %d bytes, above the limit of %d" % (path, size, limit))
        self.size = size
        self.limit = limit


@dataclass(frozen=True)
class Started:
    """What a session was started as: its id and the Environment sent."""

    id: str
    environment: Dict[str, Any]
    pool: Optional[str]


def default_workdir(environment: Mapping[str, Any]) -> str:
    """The working directory of an Environment's commands (runner's default /workspace)."""
    spec = environment.get("spec", environment) if "kind" in environment else environment
    workdir = spec.get("workdir") if isinstance(spec, Mapping) else None
    return workdir if isinstance(workdir, str) and workdir.startswith("/") else "/workspace"


class Sandbox:
    """A live runner session: start one with `Sandbox.start`, end it with `delete`."""

    def __init__(self, client: AsyncClient, session: AsyncSession, *, workdir: str, environment: Mapping[str, Any]):
        self._client = client
        self._session = session
        self.workdir = workdir
        self.environment = dict(environment)
        self._switch: Optional[cmd.Switch] = None
        self._switch_lock = asyncio.Lock()
        self.deleted = False

    @classmethod
    async def start(
        cls,
        client: AsyncClient,
        environment: Mapping[str, Any],
        *,
        mounts: Optional[Sequence[Mapping[str, Any]]] = None,
    ) -> "Sandbox":
        """Start a session of `environment` (an Environment's spec, or a whole document)."""
        try:
            session = await client.sessions.create(dict(environment), mounts=mounts)
        except (Unavailable, TransportError) as e:
            raise SandboxGone("runner serve at %s cannot start a sandbox: %s" % (client.endpoint, e)) from e
        return cls(client, session, workdir=default_workdir(environment), environment=environment)

    @property
    def id(self) -> str:
        return self._session.id

    @property
    def pool(self) -> Optional[str]:
        pool = self._session.info.raw.get("pool")
        return pool if isinstance(pool, str) else None

    def __repr__(self) -> str:
        return "Sandbox(%s)" % self.id

    # --- commands -------------------------------------------------------------------------

    async def exec(
        self,
        argv: Sequence[str],
        *,
        input: Union[str, bytes, None] = None,
        cwd: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        user: Union[str, int, None] = None,
        timeout: Optional[float] = None,
        host_timeout: Optional[float] = None,
    ) -> ExecResult:
        """Run `argv` to its end or its `timeout` (the sandbox kills the whole process tree;
        the result says `timed_out`). `cwd` relative to the working directory; `user` as
        `docker exec --user` takes it. `host_timeout`: how long to wait for the server's
        answer at all (asyncio.TimeoutError after it)."""
        argv = list(argv)
        if not argv or not all(isinstance(a, str) for a in argv) or not argv[0]:
            raise ValueError("a command is a non-empty list of strings")
        env = cmd.check_env(env)
        if user is not None:
            argv = cmd.as_user(argv, user, await self._user_switch(), keep_home="HOME" in env)
        stdin: Optional[str] = None
        if input is not None:
            raw = input.encode("utf-8") if isinstance(input, str) else input
            if len(raw) > _STDIN_INLINE:
                staged = posixpath.join(_STAGING_DIR, ".runner-harness-stdin-%s" % uuid.uuid4().hex)
                await self.write_file(staged, raw)
                argv = cmd.stdin_from_file(staged, argv)
            else:
                stdin, encoded = cmd.stdin_text(input)
                if encoded:
                    argv = cmd.decoding_stdin(argv)
        call = self._session.exec(
            argv,
            stdin=stdin,
            timeout=timeout,
            env=env or None,
            cwd=cmd.sandbox_path(cwd, self.workdir) if cwd is not None else None,
        )
        result: ExecResult = await self._call(call if host_timeout is None else asyncio.wait_for(call, host_timeout))
        if user is not None and result.exit_code == 126:
            refused = cmd.failure(result.stderr)
            if refused is not None and refused.errno_name == "EUSERS":
                raise UserSwitchUnsupported(refused.detail)
        return result

    async def _call(self, awaitable: Any) -> Any:
        """A call on the session, with the session's end said as SandboxGone."""
        try:
            return await awaitable
        except NotFound as e:
            raise SandboxGone("sandbox %s is gone: %s" % (self.id, e.message)) from e
        except Conflict as e:
            # An evicted session (over its ephemeral storage) answers 409 from then on.
            raise SandboxGone("sandbox %s cannot run commands any more: %s" % (self.id, e.message)) from e
        except (Unavailable, TransportError) as e:
            raise SandboxGone("sandbox %s: runner serve is unreachable: %s" % (self.id, e)) from e

    async def _user_switch(self) -> cmd.Switch:
        async with self._switch_lock:
            if self._switch is None:
                probe = await self._call(self._session.exec(cmd.PROBE_SWITCH, timeout=60))
                if probe.exit_code != 0:
                    raise SandboxError("probing how to switch users failed: %s" % (probe.stderr or probe.stdout))
                self._switch = cmd.Switch.parse(probe.stdout)
            return self._switch

    async def _run_ours(self, argv: List[str], *, stdin: Optional[str] = None, timeout: float = _TRANSFER_TIMEOUT) -> ExecResult:
        result: ExecResult = await self._call(self._session.exec(argv, stdin=stdin, timeout=timeout))
        if result.timed_out:
            raise asyncio.TimeoutError("a file transfer in sandbox %s took longer than %ss" % (self.id, timeout))
        return result

    # --- files ----------------------------------------------------------------------------

    async def read_file(self, path: str, *, limit: Optional[int] = None) -> bytes:
        """The bytes of the regular file `path` (links followed). FileNotFoundError,
        IsADirectoryError, PermissionError, OSError(EINVAL) for what is not a regular file,
        FileTooLarge above `limit`. A file that changes while it is read gives what each
        chunk found, at most the size it had at first."""
        path = cmd.sandbox_path(path, self.workdir)
        blocks = _READ_BLOCKS
        result = await self._run_ours(cmd.read_chunk(path, 0, blocks))
        _raise_for_file(result, path)
        if result.exit_code != 0:
            raise SandboxError("reading %s in sandbox %s failed: %s" % (path, self.id, result.stderr.strip()))
        size, text = cmd.parse_first_chunk(result.stdout)
        if limit is not None and size > limit:
            raise FileTooLarge(path, size, limit)
        data = bytearray()
        if result.stdout_dropped_bytes:
            # The server keeps less of a command's output than a chunk (its size line, first,
            # survived): read again from the start in blocks.
            blocks = 1
        else:
            data += base64.b64decode(text)
        while len(data) < size and len(data) % cmd.READ_BLOCK == 0:
            result = await self._run_ours(cmd.read_chunk(path, len(data) // cmd.READ_BLOCK, blocks))
            _raise_for_file(result, path)
            if result.exit_code != 0:
                raise SandboxError("reading %s in sandbox %s failed: %s" % (path, self.id, result.stderr.strip()))
            if result.stdout_dropped_bytes:
                if blocks == 1:
                    raise SandboxError(
                        "runner serve keeps less than %d bytes of a command's output: raise its --max-output-bytes"
                        % (cmd.READ_BLOCK * 4 // 3 + 4)
                    )
                blocks = max(1, blocks // 4)
                continue
            piece = base64.b64decode(result.stdout)
            if not piece:
                break
            data += piece
        return bytes(data[:size])

    async def write_file(self, path: str, data: Union[bytes, str]) -> None:
        """Write `data` to `path` (parents made; an existing file replaced). IsADirectoryError,
        NotADirectoryError (a parent is a file), PermissionError."""
        if isinstance(data, str):
            data = data.encode("utf-8")
        path = cmd.sandbox_path(path, self.workdir)
        offset = 0
        while True:
            chunk = data[offset : offset + _WRITE_CHUNK]
            result = await self._run_ours(
                cmd.write_chunk(path, append=offset > 0), stdin=base64.b64encode(chunk).decode("ascii")
            )
            _raise_for_file(result, path)
            if result.exit_code != 0:
                raise SandboxError("writing %s in sandbox %s failed: %s" % (path, self.id, result.stderr.strip()))
            offset += len(chunk)
            if offset >= len(data):
                return

    async def upload_file(self, local: Union[str, "os.PathLike[str]"], path: str) -> None:
        await self.write_file(path, await asyncio.to_thread(Path(local).read_bytes))

    async def download_file(self, path: str, local: Union[str, "os.PathLike[str]"]) -> None:
        data = await self.read_file(path)
        target = Path(local)
        await asyncio.to_thread(_write_local, target, data)

    async def upload_dir(self, local: Union[str, "os.PathLike[str]"], dest: str) -> None:
        """Copy the local directory's contents into `dest` (made if missing)."""
        source = Path(local)
        if not source.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(source))
        tarball = await asyncio.to_thread(_pack_local, source)
        staged = posixpath.join(_STAGING_DIR, ".runner-harness-%s.tar" % uuid.uuid4().hex)
        await self.write_file(staged, tarball)
        result = await self._run_ours(cmd.unpack_dir(staged, cmd.sandbox_path(dest, self.workdir)))
        if result.exit_code != 0:
            raise SandboxError("unpacking into %s in sandbox %s failed: %s" % (dest, self.id, result.stderr.strip()))

    async def download_dir(self, source: str, local: Union[str, "os.PathLike[str]"]) -> None:
        """Copy the sandbox directory's contents into the local directory (made if missing;
        files there are overwritten). Links stay links; FIFOs and devices are skipped."""
        source = cmd.sandbox_path(source, self.workdir)
        staged = posixpath.join(_STAGING_DIR, ".runner-harness-%s.tar" % uuid.uuid4().hex)
        try:
            result = await self._run_ours(cmd.pack_dir(source, staged))
            _raise_for_file(result, source)
            if result.exit_code != 0:
                raise SandboxError("packing %s in sandbox %s failed: %s" % (source, self.id, result.stderr.strip()))
            tarball = await self.read_file(staged)
        finally:
            try:
                await self._run_ours(cmd.remove(staged), timeout=60)
            except SandboxGone:
                pass
        await asyncio.to_thread(_unpack_local, tarball, Path(local))

    # --- the network ----------------------------------------------------------------------

    async def set_egress(self, allow: Sequence[str]) -> None:
        """Replace the sandbox's egress (`PATCH /v1/sessions/{id}`): at once, connections to
        what is no longer allowed cut. Only for a sandbox on a bridge network (runner answers
        409 otherwise, said here as ValueError)."""
        try:
            await self._session.set_egress(list(allow))
        except Conflict as e:
            raise ValueError("sandbox %s: %s" % (self.id, e.message)) from e
        except (NotFound, Unavailable, TransportError) as e:
            raise SandboxGone("sandbox %s: changing its egress: %s" % (self.id, e)) from e

    # --- the end --------------------------------------------------------------------------

    async def delete(self) -> None:
        """End the session: runner removes its container and everything it owned. Shielded
        from cancellation (an interrupted eval still removes its sandboxes); a session already
        gone is fine."""
        if self.deleted:
            return
        # anyio's shield, not asyncio.shield: the delete is awaited to its end even inside a
        # cancelled task (asyncio.shield would return at once and leave it running).
        with anyio.CancelScope(shield=True):
            try:
                await self._session.delete()
            except NotFound:
                pass
        self.deleted = True


def _raise_for_file(result: ExecResult, path: str) -> None:
    refused = cmd.failure(result.stderr)
    if refused is None:
        if result.exit_code != 0 and "permission denied" in result.stderr.lower():
            raise PermissionError(errno.EACCES, "Permission denied", path)
        if result.exit_code != 0 and "read-only file system" in result.stderr.lower():
            raise PermissionError(errno.EROFS, "Read-only file system", path)
        return
    name = refused.errno_name
    if name == "ENOENT":
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
    if name == "EISDIR":
        raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
    if name == "ENOTDIR":
        raise NotADirectoryError(errno.ENOTDIR, "Not a directory", refused.detail or path)
    if name == "EACCES":
        raise PermissionError(errno.EACCES, "Permission denied", refused.detail or path)
    if name == "EINVAL":
        raise OSError(errno.EINVAL, refused.detail or "Invalid argument", path)
    raise SandboxError("%s: %s %s" % (path, name, refused.detail))


def _write_local(target: Path, data: bytes) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)


def _pack_local(source: Path) -> bytes:
    buffer = io.BytesIO()
    # GNU format: busybox's tar reads its long names; PAX headers it may not.
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for entry in sorted(source.iterdir()):
            tar.add(entry, arcname=entry.name, filter=_as_root)
    return buffer.getvalue()


def _as_root(member: tarfile.TarInfo) -> tarfile.TarInfo:
    """What is copied in belongs to root in the sandbox, as with `docker cp` (the local
    owner's uid means nothing there); a sandbox whose processes are not root owns it
    instead."""
    member.uid = member.gid = 0
    member.uname = member.gname = "root"
    return member


def _skip_devices(member: tarfile.TarInfo, dest: str) -> Optional[tarfile.TarInfo]:
    """tarfile's data filter (no absolute paths, no escapes, no setuid), except that FIFOs and
    devices are skipped rather than failing the whole directory: a sandbox can make them."""
    if member.isdev():
        return None
    return tarfile.data_filter(member, dest)


def _unpack_local(tarball: bytes, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:") as tar:
        tar.extractall(dest, filter=_skip_devices)
