"""The Harbor environment: the task's [environment] as a runner Environment (network policy
to egress), and a trial's container lifecycle against runner serve."""

from __future__ import annotations

import logging
import shlex
import socket
from pathlib import Path
from typing import Any, Callable

import pytest
from harbor.models.task.config import EnvironmentConfig, NetworkMode, NetworkPolicy
from harbor.models.trial.paths import TrialPaths

from runner_harness import Server
from runner_harness.harbor import RunnerEnvironment, dockerfile_workdir, network_spec

from _support import PYTHON, run


def make(tmp_path: Path, policy: NetworkPolicy, **kwargs: Any) -> RunnerEnvironment:
    env_dir = tmp_path / "environment"
    env_dir.mkdir(exist_ok=True)
    (env_dir / "Dockerfile").write_text("FROM python\nWORKDIR /srv\nWORKDIR app\n")
    config = EnvironmentConfig(docker_image=kwargs.pop("docker_image", PYTHON), cpus=1, memory_mb=256, storage_mb=512, env={"TASK_VAR": "t"})
    trial = TrialPaths(trial_dir=tmp_path / "trial")
    return RunnerEnvironment(
        environment_dir=env_dir,
        environment_name="hello",
        session_id="hello__abc__env",
        trial_paths=trial,
        task_env_config=config,
        logger=logging.getLogger("test"),
        network_policy=policy,
        **kwargs,
    )


def test_network_policy_becomes_egress() -> None:
    assert network_spec(NetworkPolicy(network_mode=NetworkMode.NO_NETWORK), None) == {"network": "none"}
    allow = NetworkPolicy(network_mode=NetworkMode.ALLOWLIST, allowed_hosts=["pypi.org", "*.example.com", "10.1.2.3", "10.0.0.0/8"])
    assert network_spec(allow, None) == {"network": "bridge", "egress": {"allow": ["pypi.org", "*.example.com", "10.1.2.3", "10.0.0.0/8"]}}
    public = NetworkPolicy(network_mode=NetworkMode.PUBLIC)
    assert network_spec(public, ["0.0.0.0/0", "pypi.org"]) == {"network": "bridge", "egress": {"allow": ["0.0.0.0/0", "pypi.org"]}}
    with pytest.raises(ValueError, match="public_egress"):
        network_spec(public, None)


def test_the_task_environment_maps_and_what_cannot_run_is_refused(server: Server, tmp_path: Path) -> None:
    env = make(tmp_path, NetworkPolicy(network_mode=NetworkMode.ALLOWLIST, allowed_hosts=["pypi.org"]))
    assert env.environment_spec() == {
        "image": PYTHON,
        "workdir": "/srv/app",
        "mountWorkspace": False,
        "env": {"TASK_VAR": "t"},
        "resources": {"cpu": "1", "memory": "256Mi", "ephemeralStorage": "512Mi"},
        "network": "bridge",
        "egress": {"allow": ["pypi.org"]},
    }
    with pytest.raises(ValueError, match="network_mode 'public'"):
        make(tmp_path, NetworkPolicy(network_mode=NetworkMode.PUBLIC))
    assert make(tmp_path, NetworkPolicy(), public_egress="pypi.org:443, *.pythonhosted.org:443").environment_spec()["egress"] == {
        "allow": ["pypi.org:443", "*.pythonhosted.org:443"]
    }
    with pytest.raises(FileNotFoundError, match="docker_image"):
        make(tmp_path, NetworkPolicy(network_mode=NetworkMode.NO_NETWORK), docker_image=None)
    with pytest.raises(ValueError, match="IPv6"):
        make(tmp_path, NetworkPolicy(network_mode=NetworkMode.ALLOWLIST, allowed_hosts=["2001:db8::1"]))
    assert dockerfile_workdir(tmp_path / "environment" / "Dockerfile") == "/srv/app"


def test_a_trial_container_lives_and_goes(server: Server, tmp_path: Path) -> None:
    env = make(tmp_path, NetworkPolicy(network_mode=NetworkMode.NO_NETWORK))

    async def body() -> None:
        await env.start(force_build=False)
        sid = env.sandbox.id
        try:
            r = await env.exec("pwd; echo $TASK_VAR; echo $EXTRA; echo err >&2; exit 5", env={"EXTRA": "x"})
            assert (r.return_code, r.stdout, r.stderr) == (5, "/srv/app\nt\nx\n", "err\n")
            r = await env.exec("id -u; echo $HOME", user="user")
            assert r.stdout == "1000\n/home/user\n"
            with env.with_default_user(1000):
                assert (await env.exec("id -u")).stdout == "1000\n"
            with pytest.raises(RuntimeError, match="timed out after 1 seconds"):
                await env.exec("sleep 20", timeout_sec=1)
            local = tmp_path / "up"
            (local / "d").mkdir(parents=True)
            (local / "d" / "f.txt").write_text("hi")
            await env.upload_dir(local, "/tests")
            await env.upload_file(local / "d" / "f.txt", "/one/f.txt")
            assert await env.is_file("/tests/d/f.txt") and await env.is_dir("/one")
            await env.exec("mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt")
            await env.download_dir("/logs/verifier", tmp_path / "down")
            assert (tmp_path / "down" / "reward.txt").read_text() == "1\n"
            await env.download_file("/one/f.txt", tmp_path / "f.txt")
            assert (tmp_path / "f.txt").read_text() == "hi"
        finally:
            await env.stop(delete=True)
        with server.client() as c:
            assert sid not in [s.id for s in c.sessions.list()]

    run(body())


def test_phase_policies_switch_the_sandboxs_egress(server: Server, tmp_path: Path) -> None:
    """Harbor's per-phase network policies (an agent without network, a verifier that may
    reach one host): the sandbox starts on runner's bridge with no way out, and each
    set_network_policy (what Harbor's trial calls between phases) replaces its egress."""
    assert network_spec(NetworkPolicy(network_mode=NetworkMode.NO_NETWORK), None) == {"network": "none"}
    listener = socket.socket()
    listener.bind(("0.0.0.0", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    no_network = NetworkPolicy(network_mode=NetworkMode.NO_NETWORK)

    async def body(gateway_policy: Callable[[str], NetworkPolicy]) -> None:
        env = make(tmp_path, no_network, phase_network_policies=[no_network, gateway_policy("10.89.0.1")])
        assert env.capabilities.dynamic_network_policy
        assert env.environment_spec()["network"] == "bridge" and env.environment_spec()["egress"] == {"allow": []}
        await env.start(force_build=False)
        try:
            # The host, through the bridge's gateway (runner's resolver's address).
            probe = (
                "import socket\ngw = [l.split()[1] for l in open('/etc/resolv.conf') if l.startswith('nameserver')][0]\n"
                "try:\n    socket.create_connection((gw, %d), timeout=3).close(); print(gw, 'open')\n"
                "except OSError as e:\n    print(gw, 'refused', e.errno)\n" % port
            )

            async def reach() -> str:
                r = await env.exec("python3 -c %s" % shlex.quote(probe))
                assert r.return_code == 0, r
                return str(r.stdout).strip()

            closed = await reach()
            assert closed.split()[1] == "refused", closed
            gateway = closed.split()[0]
            await env.set_network_policy(gateway_policy(gateway))
            assert await reach() == "%s open" % gateway
            await env.set_network_policy(no_network)
            assert (await reach()).split()[1] == "refused"
        finally:
            await env.stop(delete=True)

    try:
        run(body(lambda host: NetworkPolicy(network_mode=NetworkMode.ALLOWLIST, allowed_hosts=[host])))
    finally:
        listener.close()


def test_a_no_network_sandbox_is_not_put_on_a_network(server: Server, tmp_path: Path) -> None:
    env = make(tmp_path, NetworkPolicy(network_mode=NetworkMode.NO_NETWORK))

    async def body() -> None:
        await env.start(force_build=False)
        try:
            with pytest.raises(ValueError, match="without a network"):
                await env.set_network_policy(NetworkPolicy(network_mode=NetworkMode.ALLOWLIST, allowed_hosts=["pypi.org"]))
            await env.set_network_policy(NetworkPolicy(network_mode=NetworkMode.NO_NETWORK))
        finally:
            await env.stop(delete=True)

    run(body())
