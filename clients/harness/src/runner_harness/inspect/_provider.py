"""Inspect AI's `SandboxEnvironment` on runner: each sample's sandboxes are runner sessions on
the node's `runner serve`, made at sample_init and removed at sample_cleanup (also when the
sample or the eval is interrupted), with runner's hardening; warm pools live for the task.

Semantics follow Inspect's docker provider: commands run as `docker compose exec` runs them
(cwd relative to the working directory, env through the exec API, `user` as `--user` takes it,
an in-sandbox timeout that kills the whole process tree and raises TimeoutError), files are the
sandbox's own (any path, links followed, Inspect's errors), output limits raise
OutputLimitExceededError. `exec_remote` (streaming) is Inspect's own implementation, which
drives its sandbox tools through this provider's exec and files: a runner session runs one
command at a time, so a native stream held open for a background process would block every
other command of the sample.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import shlex
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Tuple, Union, overload

import anyio
from inspect_ai.util import (
    ExecResult,
    OutputLimitExceededError,
    SandboxConnection,
    SandboxEnvironment,
    SandboxEnvironmentConfigType,
    SandboxEnvironmentLimits,
    sandboxenv,
)
from inspect_ai.util._sandbox.environment import SandboxUnavailableError, SandboxUserUnsupportedError
from pydantic import BaseModel, Field
from typing_extensions import override

from runner_client import AsyncClient, NotFound, RunnerError

from .. import _plan
from .._connect import server_from_env
from ..compose import COMPOSE_FILES, Healthcheck, Service
from ..sandbox import FileTooLarge, Sandbox, SandboxGone, UserSwitchUnsupported

logger = logging.getLogger(__name__)

# How much longer than a command's own timeout the server's answer may take before the call
# is treated as hung (the sandbox kills the command at its timeout; teardown of its tree and
# the answer take seconds at most).
_HOST_SLACK = 30.0
_MAX_RETRIES = 2


class RunnerSandboxEnvironmentConfig(BaseModel, frozen=True):
    """A runner sandbox configured in code: `sandbox=SandboxEnvironmentSpec("runner",
    RunnerSandboxEnvironmentConfig(environments={"default": {"image": "local/python:3.11"}}))`.
    Each value is a runner Environment spec (image, resources, env, network, egress, ...)."""

    environments: Dict[str, Dict[str, Any]] = Field(default_factory=dict)
    default: Optional[str] = None
    pool: int = 0
    """Warm members kept for every environment while the task runs (0: none)."""


def _plan_for(config: SandboxEnvironmentConfigType | None, env: Optional[Dict[str, str]] = None) -> _plan.Plan:
    if config is None:
        return _plan.default_plan()
    if isinstance(config, str):
        return _plan.load_file(config, env)
    if isinstance(config, RunnerSandboxEnvironmentConfig):
        return _plan.from_specs(config.environments, config.default, config.pool)
    # Inspect's ComposeConfig (a compose file given as an object, or read back from a log).
    dump = getattr(config, "model_dump", None)
    if dump is not None and type(config).__name__ == "ComposeConfig":
        raw = dump(by_alias=True, exclude_none=True)
        return _plan.from_compose_dict(raw, os.getcwd(), env)
    raise _plan.ConfigError("sandbox 'runner': unsupported configuration %r" % type(config).__name__)


def _sample_env(metadata: Dict[str, Any]) -> Dict[str, str]:
    """What `${SAMPLE_METADATA_X}` resolves to in a compose file (as Inspect's docker provider)."""
    env = dict(os.environ)
    for key, value in metadata.items():
        env["SAMPLE_METADATA_%s" % str(key).replace(" ", "_").upper()] = str(value)
    return env


def _config_key(config: SandboxEnvironmentConfigType | None) -> str:
    if config is None or isinstance(config, str):
        return "file:%s" % config
    return "model:%s" % config.model_dump_json()


class _State:
    """What this process made on the server: live sessions (removed at cleanup, and at exit
    should an interruption skip that) and the warm pools of each task config."""

    def __init__(self) -> None:
        self.clients: Dict[int, AsyncClient] = {}
        self.live: Dict[str, Tuple[str, str]] = {}  # session id -> (config key, server address)
        self.pools: Dict[str, List[str]] = {}  # config key -> pool names
        self.registered_exit = False
        self.record = _Record()

    def client(self) -> AsyncClient:
        """One client per event loop (its connections belong to that loop)."""
        loop = asyncio.get_running_loop()
        client = self.clients.get(id(loop))
        if client is None:
            client = server_from_env().async_client()
            self.clients[id(loop)] = client
        if not self.registered_exit:
            import atexit

            atexit.register(_remove_leftovers)
            self.registered_exit = True
        return client


class _Record:
    """This process's sessions and pools in a file (Inspect's data directory), so that
    `inspect sandbox cleanup runner` can remove what a killed eval left."""

    def __init__(self) -> None:
        self.path: Optional[Path] = None

    def _dir(self) -> Path:
        from inspect_ai._util.appdirs import inspect_data_dir

        return Path(inspect_data_dir("runner-sandboxes"))

    def save(self, state: "_State") -> None:
        try:
            if self.path is None:
                self.path = self._dir() / ("%d-%s.json" % (os.getpid(), uuid.uuid4().hex[:8]))
            data = {
                "pid": os.getpid(),
                "server": server_from_env().address,
                "sessions": sorted(state.live),
                "pools": sorted(p for pools in state.pools.values() for p in pools),
            }
            if not data["sessions"] and not data["pools"]:
                self.path.unlink(missing_ok=True)
                return
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(data))
            tmp.replace(self.path)
        except OSError as e:
            logger.warning("could not record runner sandboxes for `inspect sandbox cleanup`: %s", e)

    def others(self) -> List[Path]:
        d = self._dir()
        return sorted(d.glob("*.json")) if d.is_dir() else []


_state = _State()


def _remove_leftovers() -> None:
    """At exit: what sample_cleanup and task_cleanup did not get to (an interrupted eval)."""
    if not _state.live and not any(_state.pools.values()):
        return
    try:
        with server_from_env().client(timeout=30) as client:
            for sid in list(_state.live):
                try:
                    client.sessions.get(sid).delete()
                except NotFound:
                    pass
                _state.live.pop(sid, None)
            for pools in _state.pools.values():
                for name in pools:
                    try:
                        client.pools.delete(name)
                    except NotFound:
                        pass
            _state.pools.clear()
    except Exception as e:  # the process is exiting: say what is left, do not raise
        print("runner sandboxes left on the server (%s); `inspect sandbox cleanup runner` removes them" % e, file=sys.stderr)
    _state.record.save(_state)


@sandboxenv(name="runner")
class RunnerSandboxEnvironment(SandboxEnvironment):
    """A runner session as an Inspect sandbox."""

    def __init__(self, name: str, sandbox: Sandbox, config_key: str) -> None:
        super().__init__()
        self._name = name
        self._sandbox = sandbox
        self._config_key = config_key

    @property
    def session_id(self) -> str:
        """The runner session behind this sandbox (`GET /v1/sessions/{id}`)."""
        return self._sandbox.id

    @property
    def sandbox(self) -> Sandbox:
        return self._sandbox

    # --- configuration ---------------------------------------------------------------------

    @classmethod
    def config_files(cls) -> List[str]:
        return _plan.MANIFEST_FILES + COMPOSE_FILES

    @classmethod
    def is_docker_compatible(cls) -> bool:
        return True

    @classmethod
    def config_deserialize(cls, config: Dict[str, Any]) -> BaseModel:
        return RunnerSandboxEnvironmentConfig(**config)

    @classmethod
    def default_concurrency(cls) -> Optional[int]:
        # Each sandbox is a container on this node: as many as twice its CPUs at once, as the
        # docker provider does.
        return 2 * (os.cpu_count() or 1)

    # --- lifecycle -------------------------------------------------------------------------

    @classmethod
    async def task_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None) -> None:
        plan = _plan_for(config)
        client = _state.client()
        key = _config_key(config)
        # Fail at the start of the eval, not at its first sample, when the server is not there.
        try:
            await client.health()
        except RunnerError as e:
            raise SandboxUnavailableError("runner serve at %s: %s" % (client.endpoint, e)) from e
        except OSError as e:
            raise SandboxUnavailableError("runner serve at %s is unreachable: %s" % (client.endpoint, e)) from e
        for service in plan.services:
            if service.pool <= 0:
                continue
            name = "inspect-%s-%s" % (_slug(service.name), uuid.uuid4().hex[:8])
            pool = await client.pools.create(name, _session_spec(service), size=service.pool)
            _state.pools.setdefault(key, []).append(pool.name)
            _state.record.save(_state)
            logger.info("runner warm pool %s: %d ready for service %r", pool.name, pool.ready, service.name)

    @classmethod
    async def task_init_environment(
        cls, config: SandboxEnvironmentConfigType | None, metadata: Dict[str, str]
    ) -> Dict[str, str]:
        # A compose file that names sample metadata needs its own task_init per value set
        # (its images may differ).
        if isinstance(config, str) and os.path.isfile(config):
            text = Path(config).read_text(encoding="utf-8")
            return {k: v for k, v in _sample_env(metadata).items() if k.startswith("SAMPLE_METADATA_") and k in text}
        return {}

    @classmethod
    async def sample_init(
        cls, task_name: str, config: SandboxEnvironmentConfigType | None, metadata: Dict[str, str]
    ) -> Dict[str, SandboxEnvironment]:
        plan = _plan_for(config, _sample_env(metadata))
        client = _state.client()
        key = _config_key(config)
        started: Dict[str, SandboxEnvironment] = {}
        try:
            for service in plan.services:
                sandbox = await _start(client, service)
                _state.live[sandbox.id] = (key, str(client.endpoint))
                _state.record.save(_state)
                started[service.name] = cls(service.name, sandbox, key)
                await _start_main(sandbox, service)
            for service in plan.services:
                if service.healthcheck is not None:
                    env = started[service.name]
                    assert isinstance(env, RunnerSandboxEnvironment)
                    await _wait_healthy(env._sandbox, service.name, service.healthcheck)
        except BaseException:
            await _delete_all(list(started.values()))
            raise
        return plan.ordered_for_inspect(started)

    @classmethod
    async def sample_cleanup(
        cls,
        task_name: str,
        config: SandboxEnvironmentConfigType | None,
        environments: Dict[str, SandboxEnvironment],
        interrupted: bool,
    ) -> None:
        # Also when interrupted: a sandbox of a cancelled sample is removed now (shielded from
        # the cancellation), not left for the end of the eval.
        await _delete_all(list(environments.values()))

    @classmethod
    async def task_cleanup(cls, task_name: str, config: SandboxEnvironmentConfigType | None, cleanup: bool) -> None:
        key = _config_key(config)
        leftover = [sid for sid, (k, _) in _state.live.items() if k == key]
        pools = _state.pools.get(key, [])
        if not cleanup:
            if leftover or pools:
                print(
                    "runner sandboxes kept (--no-sandbox-cleanup): sessions %s, pools %s; remove them with "
                    "`inspect sandbox cleanup runner [SESSION_ID]`" % (", ".join(leftover) or "none", ", ".join(pools) or "none")
                )
            return
        client = _state.client()
        with anyio.CancelScope(shield=True):
            for sid in leftover:
                try:
                    await _delete_session(client, sid)
                except NotFound:
                    pass
                _state.live.pop(sid, None)
            for name in list(pools):
                try:
                    await client.pools.delete(name)
                except NotFound:
                    pass
                pools.remove(name)
        _state.record.save(_state)

    @classmethod
    async def cli_cleanup(cls, id: Optional[str]) -> None:
        """`inspect sandbox cleanup runner [ID]`: one session by id, or everything that evals
        recorded and did not remove (their processes are gone)."""
        with server_from_env().client(timeout=60) as client:
            if id is not None:
                try:
                    client.sessions.get(id).delete()
                    print("removed runner session %s" % id)
                except NotFound:
                    print("no runner session %s" % id)
                return
            for path in _state.record.others():
                try:
                    data = json.loads(path.read_text())
                except (OSError, ValueError):
                    continue
                if _alive(int(data.get("pid", 0))) and data.get("pid") != os.getpid():
                    continue
                for sid in data.get("sessions", []):
                    try:
                        client.sessions.get(sid).delete()
                        print("removed runner session %s" % sid)
                    except NotFound:
                        pass
                for name in data.get("pools", []):
                    try:
                        client.pools.delete(name)
                        print("removed runner pool %s" % name)
                    except NotFound:
                        pass
                path.unlink(missing_ok=True)

    # --- commands ---------------------------------------------------------------------------

    @override
    async def exec(
        self,
        cmd: List[str],
        input: Union[str, bytes, None] = None,
        cwd: Optional[str] = None,
        env: Optional[Dict[str, str]] = None,
        user: Optional[str] = None,
        timeout: Optional[int] = None,
        timeout_retry: bool = True,
        concurrency: bool = True,
    ) -> ExecResult[str]:
        if not cmd:
            raise ValueError("cmd must not be empty")
        retries = 0
        while True:
            if timeout is None:
                host_timeout = None
            elif retries == 0:
                host_timeout = timeout + _HOST_SLACK
            else:
                # As Inspect's docker provider retries a hung call: shorter waits each time.
                host_timeout = max(min(timeout + _HOST_SLACK, 60) // retries, 1)
            try:
                result = await self._sandbox.exec(
                    cmd, input=input, cwd=cwd, env=env, user=user, timeout=timeout, host_timeout=host_timeout
                )
                break
            except asyncio.TimeoutError as e:
                retries += 1
                if timeout_retry and retries <= _MAX_RETRIES:
                    logger.info("retrying a command whose answer did not come: %s", shlex.join(cmd))
                    continue
                raise TimeoutError("Command timed out after %s seconds (no answer from runner serve)" % timeout) from e
            except UserSwitchUnsupported as e:
                raise SandboxUserUnsupportedError(str(e)) from e
            except SandboxGone as e:
                raise SandboxUnavailableError(str(e)) from e
        if result.timed_out:
            error = TimeoutError("Command timed out after %s seconds" % timeout)
            partial = (result.stdout or "") + (result.stderr or "")
            if partial:
                setattr(error, "truncated_output", partial)
            raise error
        limit = SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE
        for text, dropped in ((result.stdout, result.stdout_dropped_bytes), (result.stderr, result.stderr_dropped_bytes)):
            if dropped or len(text.encode("utf-8")) > limit:
                raise OutputLimitExceededError(
                    limit_str=SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE_STR,
                    truncated_output=text.encode("utf-8")[:limit].decode("utf-8", "ignore"),
                )
        code = result.exit_code if result.exit_code is not None else 128 + (result.signal or 0)
        return ExecResult(success=code == 0, returncode=code, stdout=result.stdout, stderr=result.stderr)

    # --- files ------------------------------------------------------------------------------

    @override
    async def write_file(self, file: str, contents: Union[str, bytes]) -> None:
        try:
            await self._sandbox.write_file(file, contents)
        except SandboxGone as e:
            raise SandboxUnavailableError(str(e)) from e

    @overload
    async def read_file(self, file: str, text: Literal[True] = True) -> str: ...

    @overload
    async def read_file(self, file: str, text: Literal[False]) -> bytes: ...

    @override
    async def read_file(self, file: str, text: bool = True) -> Union[str, bytes]:
        if os.path.basename(file.rstrip("/")) in (".", ".."):
            raise IsADirectoryError(errno.EISDIR, "Is a directory.", file)
        try:
            data = await self._sandbox.read_file(file, limit=SandboxEnvironmentLimits.MAX_READ_FILE_SIZE)
        except FileTooLarge:
            raise OutputLimitExceededError(
                limit_str=SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR, truncated_output=None
            ) from None
        except SandboxGone as e:
            raise SandboxUnavailableError(str(e)) from e
        # Strict, as Inspect's providers decode: a binary file read as text raises
        # UnicodeDecodeError; CRLF stays CRLF.
        return data.decode("utf-8") if text else data

    # --- connecting -------------------------------------------------------------------------

    @override
    async def connection(self, *, user: Optional[str] = None) -> SandboxConnection:
        if user is not None:
            raise NotImplementedError(
                "runner's interactive shell runs as the sandbox's own user; connect without user="
            )
        try:
            await self._sandbox._call(self._sandbox._session.refresh())
        except SandboxGone as e:
            raise ConnectionError("sandbox %r is not running: %s" % (self._name, e)) from e
        command = shlex.join([sys.executable, "-m", "runner_harness.shell", self._sandbox.id])
        return SandboxConnection(type="runner", command=command, container=self._sandbox.id)

    @override
    def default_polling_interval(self) -> float:
        # Polls of Inspect's sandbox tools are one runner exec each (milliseconds).
        return 0.2


async def _start(client: AsyncClient, service: Service) -> Sandbox:
    try:
        return await Sandbox.start(client, _session_spec(service), mounts=service.mounts or None)
    except SandboxGone as e:
        raise SandboxUnavailableError(str(e)) from e
    except RunnerError as e:
        raise RuntimeError("runner could not start sandbox %r: %s" % (service.name, e.message)) from e


def _session_spec(service: Service) -> Dict[str, Any]:
    return dict(service.spec)


async def _start_main(sandbox: Sandbox, service: Service) -> None:
    """The service's own process (compose's command), in the background as its main process
    would be; its output is discarded (runner keeps no logs of background processes)."""
    if not service.main:
        return
    result = await sandbox.exec(
        ["/bin/sh", "-c", 'cd "$0" 2>/dev/null; "$@" </dev/null >/dev/null 2>&1 &', sandbox.workdir, *service.main]
    )
    if result.exit_code != 0:
        raise RuntimeError("service %r: starting %s failed: %s" % (service.name, shlex.join(service.main), result.stderr))


async def _wait_healthy(sandbox: Sandbox, name: str, hc: Healthcheck) -> None:
    """Run the healthcheck until it passes, as `docker compose up --wait` does: failures
    during the start period do not count; then `retries` consecutive failures fail the sample."""
    start = time.monotonic()
    failures = 0
    while True:
        result = await sandbox.exec(hc.test, timeout=max(hc.timeout, 1))
        if result.exit_code == 0 and not result.timed_out:
            return
        in_start = time.monotonic() - start < hc.start_period
        if not in_start:
            failures += 1
            if failures >= hc.retries:
                raise RuntimeError(
                    "service %r is unhealthy: %s failed %d times: %s"
                    % (name, shlex.join(hc.test), failures, (result.stderr or result.stdout).strip()[-500:])
                )
        await asyncio.sleep(hc.start_interval if in_start else hc.interval)


async def _delete_session(client: AsyncClient, sid: str) -> None:
    session = await client.sessions.get(sid)
    await session.delete()


async def _delete_all(environments: List[SandboxEnvironment]) -> None:
    async def one(env: SandboxEnvironment) -> None:
        if not isinstance(env, RunnerSandboxEnvironment):
            return
        try:
            await env._sandbox.delete()
        except RunnerError as e:
            logger.warning("removing runner sandbox %s: %s", env._sandbox.id, e)
            return
        _state.live.pop(env._sandbox.id, None)

    # Shielded: a cancelled sample still removes its sandboxes.
    with anyio.CancelScope(shield=True):
        await asyncio.gather(*(one(e) for e in environments))
    _state.record.save(_state)


def _slug(name: str) -> str:
    out = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
    return out[:30] or "service"


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
