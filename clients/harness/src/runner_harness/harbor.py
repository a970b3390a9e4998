"""Harbor's environment on runner: a trial's container is a runner session on the node's
`runner serve`, with runner's hardening.

    harbor run -p tasks/hello --agent oracle --env runner_harness.harbor:RunnerEnvironment

(Harbor takes third-party environments as an import path; `--ek key=value` passes the keyword
arguments below.) The server is RUNNER_URL / RUNNER_SOCKET with RUNNER_TOKEN /
RUNNER_TOKEN_FILE, or `--ek url=... --ek token_file=...`.

The task's `[environment]` maps onto a runner Environment: `docker_image` (runner runs prebuilt
images: a task that only has a Dockerfile is refused; `--ek image=` names one), `workdir` (else
the Dockerfile's WORKDIR), `env`, `cpus`, `memory_mb`, `storage_mb` (ephemeral storage), and
the network policy: `no-network` is runner's `network: none`; `allowlist` is a bridge network
whose `egress.allow` is the allowed hosts (names, `*.` wildcards, IPv4 addresses and CIDRs;
runner's resolver enforces names); `public` (Harbor's default) has no faithful runner
equivalent, since runner never gives a sandbox the whole network, so it is refused unless
`--ek public_egress='[...]'` says which egress entries stand for it on this node.

The policy can change while the trial runs (Harbor's per-phase policies: an agent phase without
network, a verifier with pypi.org): a sandbox that some phase lets out starts on runner's bridge,
and each switch is a `PATCH` of its egress, which cuts connections to what it no longer allows.
A no-network phase there has no way out, though the bridge's other containers stay reachable
by address (runner cannot take a live sandbox off its network); a trial whose every phase is
no-network gets `network: none`.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
from pathlib import Path, PurePosixPath
from typing import Any, Dict, List, Optional, Sequence, Union

# Harbor ships no type information (no py.typed): its classes are Any to a type checker.
from harbor.environments.base import BaseEnvironment, ExecResult  # type: ignore[import-untyped]
from harbor.environments.capabilities import (  # type: ignore[import-untyped]
    EnvironmentCapabilities,
    EnvironmentResourceCapabilities,
)
from harbor.models.task.config import EnvironmentConfig, NetworkMode, NetworkPolicy  # type: ignore[import-untyped]
from harbor.models.trial.paths import TrialPaths  # type: ignore[import-untyped]

from runner_client import AsyncClient, RunnerError

from ._connect import server_from_env
from .sandbox import Sandbox, SandboxGone

ENVIRONMENT_TYPE = "runner"


class RunnerEnvironment(BaseEnvironment):  # type: ignore[misc]
    """A Harbor environment whose container is a runner session."""

    def __init__(
        self,
        environment_dir: Path,
        environment_name: str,
        session_id: str,
        trial_paths: TrialPaths,
        task_env_config: EnvironmentConfig,
        *args: Any,
        url: Optional[str] = None,
        socket: Optional[str] = None,
        token_file: Optional[str] = None,
        image: Optional[str] = None,
        workdir: Optional[str] = None,
        public_egress: Union[Sequence[str], str, None] = None,
        keep_sandbox: bool = False,
        **kwargs: Any,
    ) -> None:
        # Set before the base's __init__: it validates the definition, which needs them.
        self._image_override = image
        self._workdir_override = workdir
        self._public_egress = _entries(public_egress, "public_egress")
        self._server = server_from_env(url, socket=socket, token_file=token_file)
        self._keep_sandbox = bool(keep_sandbox)
        self._client: Optional[AsyncClient] = None
        self._sandbox: Optional[Sandbox] = None
        self._shell = "bash"
        super().__init__(
            environment_dir=environment_dir,
            environment_name=environment_name,
            session_id=session_id,
            trial_paths=trial_paths,
            task_env_config=task_env_config,
            **kwargs,
        )

    @staticmethod
    def type() -> str:
        return ENVIRONMENT_TYPE

    @classmethod
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities:
        return EnvironmentResourceCapabilities(cpu_limit=True, memory_limit=True, fractional_cpus=True)

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        # IPv6 entries are refused (runner's bridge networks are IPv4). The policy may change
        # after start: runner replaces a live sandbox's egress (PATCH /v1/sessions/{id}).
        return EnvironmentCapabilities(
            dynamic_network_policy=True,
            disable_internet=True,
            network_allowlist=True,
            network_allowlist_hostnames=True,
            network_allowlist_wildcard_hostnames=True,
            network_allowlist_ipv4_addresses=True,
            network_allowlist_ipv4_cidrs=True,
        )

    @classmethod
    def preflight(cls) -> None:
        try:
            server = server_from_env()
        except ValueError as e:
            raise SystemExit("runner environment: %s" % e) from None
        try:
            with server.client(timeout=10) as client:
                client.health()
        except (RunnerError, OSError) as e:
            raise SystemExit("runner environment: runner serve at %s does not answer: %s" % (server.address, e)) from None

    def _validate_definition(self) -> None:
        if (self.environment_dir / "docker-compose.yaml").exists():
            raise ValueError(
                "%s: a Docker Compose environment (sidecar services) cannot run on runner, which gives a trial one sandbox"
                % self.environment_dir
            )
        if self._image() is None:
            raise FileNotFoundError(
                "task %s: runner runs prebuilt images and this task only has a Dockerfile: build it elsewhere, "
                "`runner image import` (or push) it, and set [environment] docker_image in task.toml or pass "
                "--ek image=NAME" % self.environment_name
            )
        public = any(p.network_mode == NetworkMode.PUBLIC for p in self._policies())
        if public and self._public_egress is None:
            raise ValueError(
                "task %s asks for network_mode 'public' (Harbor's default), which runner does not give a sandbox: "
                "set network_mode = \"no-network\" or \"allowlist\" (with allowed_hosts) in task.toml, or pass "
                "--ek public_egress='[\"pypi.org:443\", \"*.pythonhosted.org:443\", ...]' to say which runner "
                "egress entries stand for the internet on this node" % self.environment_name
            )

    def _policies(self) -> List[NetworkPolicy]:
        """The baseline policy and every phase's (Harbor switches between them)."""
        return [self._network_policy, *getattr(self, "_phase_network_policies", [])]

    def _image(self) -> Optional[str]:
        return self._image_override or self.task_env_config.docker_image

    def _workdir(self) -> str:
        if self._workdir_override:
            return self._workdir_override
        if self.task_env_config.workdir:
            return str(self.task_env_config.workdir)
        return dockerfile_workdir(self.environment_dir / "Dockerfile") or "/workspace"

    def environment_spec(self) -> Dict[str, Any]:
        """The runner Environment the trial's sandbox runs in."""
        image = self._image()
        assert image is not None, "checked by _validate_definition"
        spec: Dict[str, Any] = {
            "image": image,
            "workdir": self._workdir(),
            # The image's files at its working directory stay visible, as under Docker.
            "mountWorkspace": False,
        }
        env = self._startup_env()
        if env:
            spec["env"] = env
        resources: Dict[str, Any] = {}
        if (cpus := self._effective_cpus) is not None:
            resources["cpu"] = "%g" % cpus
        if (memory := self._effective_memory_mb) is not None:
            resources["memory"] = "%dMi" % memory
        if (storage := self._effective_storage_mb) is not None:
            resources["ephemeralStorage"] = "%dMi" % storage
        if resources:
            spec["resources"] = resources
        if all(p.network_mode == NetworkMode.NO_NETWORK for p in self._policies()):
            spec["network"] = "none"
        else:
            # Some phase goes out: on the bridge from the start, with the current policy's way
            # out (none for a no-network one); a switch replaces it.
            spec["network"] = "bridge"
            spec["egress"] = {"allow": egress_of(self._network_policy, self._public_egress)}
        return spec

    async def _apply_network_policy(self, network_policy: NetworkPolicy) -> None:
        """Harbor's switch between phase policies: the sandbox's egress replaced at once."""
        if self._sandbox is None:
            # Not started: start() makes the sandbox with the policy Harbor records now.
            return
        if self.environment_spec_network() == "none":
            if network_policy.network_mode == NetworkMode.NO_NETWORK:
                return
            raise ValueError(
                "the runner sandbox of %s was started without a network (every policy it was given was no-network) "
                "and cannot be put on one" % self.session_id
            )
        await self._sandbox.set_egress(egress_of(network_policy, self._public_egress))

    def environment_spec_network(self) -> str:
        """The network the sandbox was (or will be) started on: `none` or `bridge`."""
        started = self._sandbox.environment if self._sandbox is not None else self.environment_spec()
        return str(started.get("network", "none"))

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self, force_build: bool) -> None:
        if force_build:
            self.logger.warning("runner does not build images: --force-build has no effect on %s", self.environment_name)
        self._client = self._server.async_client()
        try:
            self._sandbox = await Sandbox.start(self._client, self.environment_spec())
        except RunnerError as e:
            raise RuntimeError("runner could not start the sandbox of %s: %s" % (self.session_id, e.message)) from e
        self.logger.debug("runner session %s for %s", self._sandbox.id, self.session_id)
        probe = await self._sandbox.exec(["/bin/sh", "-c", "command -v bash >/dev/null 2>&1"])
        self._shell = "bash" if probe.exit_code == 0 else "sh"
        await self.ensure_dirs(self._mount_targets(writable_only=True))
        await self._upload_environment_dir_after_start()

    async def stop(self, delete: bool) -> None:
        sandbox, self._sandbox = self._sandbox, None
        try:
            if sandbox is not None:
                if self._keep_sandbox:
                    self.logger.info("runner session %s kept (keep_sandbox): DELETE /v1/sessions/%s removes it", sandbox.id, sandbox.id)
                else:
                    await sandbox.delete()
        finally:
            if self._client is not None:
                await self._client.aclose()
                self._client = None

    @property
    def sandbox(self) -> Sandbox:
        if self._sandbox is None:
            raise RuntimeError("the runner environment of %s is not started" % self.session_id)
        return self._sandbox

    # --- commands -------------------------------------------------------------------------

    async def exec(
        self,
        command: str,
        cwd: Optional[str] = None,
        env: Optional[Dict[str, str]] = None,
        timeout_sec: Optional[int] = None,
        user: Union[str, int, None] = None,
    ) -> ExecResult:
        user = self._resolve_user(user)
        merged = self._merge_env(env)
        try:
            result = await self.sandbox.exec(
                [self._shell, "-c", command],
                cwd=cwd or self._workdir(),
                env=merged,
                user=user,
                timeout=timeout_sec if timeout_sec else None,
            )
        except SandboxGone as e:
            raise RuntimeError(str(e)) from e
        if result.timed_out:
            # As Harbor's docker environment says it.
            raise RuntimeError("Command timed out after %s seconds" % timeout_sec)
        code = result.exit_code if result.exit_code is not None else 128 + (result.signal or 0)
        return ExecResult(stdout=result.stdout or None, stderr=result.stderr or None, return_code=code)

    # --- files ----------------------------------------------------------------------------

    async def upload_file(self, source_path: Union[Path, str], target_path: str) -> None:
        await self.sandbox.upload_file(source_path, target_path)

    async def upload_dir(self, source_dir: Union[Path, str], target_dir: str) -> None:
        await self.sandbox.upload_dir(source_dir, target_dir)

    async def download_file(self, source_path: str, target_path: Union[Path, str]) -> None:
        await self.sandbox.download_file(source_path, target_path)

    async def download_dir(self, source_dir: str, target_dir: Union[Path, str]) -> None:
        await self.sandbox.download_dir(source_dir, target_dir)

    async def attach(self) -> None:
        """A line-at-a-time shell in the sandbox (runner has no terminal API yet)."""
        os.execvp(sys.executable, [sys.executable, "-m", "runner_harness.shell", self.sandbox.id])


def network_spec(policy: NetworkPolicy, public_egress: Optional[List[str]]) -> Dict[str, Any]:
    """Harbor's network policy as runner Environment fields (for a sandbox of one policy)."""
    if policy.network_mode == NetworkMode.NO_NETWORK:
        return {"network": "none"}
    allow = egress_of(policy, public_egress)
    return {"network": "bridge", "egress": {"allow": allow}} if allow else {"network": "bridge"}


def egress_of(policy: NetworkPolicy, public_egress: Optional[List[str]]) -> List[str]:
    """The `egress.allow` entries of a policy on runner's bridge: none for no-network, the
    allowed hosts of an allowlist, what `public_egress` says public means on this node."""
    if policy.network_mode == NetworkMode.NO_NETWORK:
        return []
    if policy.network_mode == NetworkMode.ALLOWLIST:
        return list(policy.allowed_hosts)
    if public_egress is None:
        raise ValueError("network_mode 'public' needs public_egress (see the module's documentation)")
    return list(public_egress)


def _entries(value: Union[Sequence[str], str, None], what: str) -> Optional[List[str]]:
    if value is None:
        return None
    if isinstance(value, str):
        value = [v for v in value.replace(",", " ").split() if v]
    entries = list(value)
    if not all(isinstance(e, str) and e for e in entries):
        raise ValueError("%s: a list of runner egress entries (addresses, CIDRs, domain names)" % what)
    return entries


def dockerfile_workdir(path: Path) -> Optional[str]:
    """The WORKDIR of a Dockerfile's last stage (relative ones resolved), if any: runner does
    not read an image's working directory (image config is untrusted), a task's Dockerfile
    says what its commands expect."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    workdir: Optional[str] = None
    for raw in lines:
        words = raw.strip().split(None, 1)
        if not words or words[0].startswith("#"):
            continue
        instruction = words[0].upper()
        if instruction == "FROM":
            workdir = None
        elif instruction == "WORKDIR" and len(words) > 1:
            value = words[1].strip().strip('"').strip("'")
            if value.startswith("$") or not value:
                continue
            workdir = value if value.startswith("/") else str(PurePosixPath(workdir or "/") / value)
    return workdir
