"""The Inspect provider against runner serve, through the interface Inspect calls: task and
sample lifecycle, exec with its limits and errors, files, connection, exec_remote."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import pytest
from inspect_ai.util import (
    ExecCompleted,
    ExecRemoteStreamingOptions,
    ExecStderr,
    ExecStdout,
    OutputLimitExceededError,
    SandboxEnvironment,
)
from inspect_ai.util._sandbox.environment import SandboxUserUnsupportedError
from inspect_ai.util._sandbox.events import SandboxEnvironmentProxy
from inspect_ai.util._sandbox.limits import override_max_exec_output_size, override_max_read_file_size
from inspect_ai.util._sandbox.registry import registry_find_sandboxenv

from runner_harness import Server
from runner_harness.inspect import RunnerSandboxEnvironment, RunnerSandboxEnvironmentConfig

from _support import BUSYBOX, PYTHON, run

COMPOSE = """
services:
  default:
    image: %s
    network_mode: none
    working_dir: /work
    environment: {WHO: "${SAMPLE_METADATA_WHO}"}
  side:
    image: %s
    network_mode: none
    x-default: false
""" % (PYTHON, BUSYBOX)


def test_registered_through_the_entry_point() -> None:
    from inspect_ai._util.entrypoints import ensure_entry_points

    ensure_entry_points()
    assert registry_find_sandboxenv("runner") is RunnerSandboxEnvironment
    assert RunnerSandboxEnvironment.is_docker_compatible()
    assert "compose.yaml" in RunnerSandboxEnvironment.config_files()


def sessions(server: Server) -> int:
    with server.client() as c:
        return len(c.sessions.list())


def test_sample_lifecycle_exec_and_files(server: Server, tmp_path: Path) -> None:
    compose = tmp_path / "compose.yaml"
    compose.write_text(COMPOSE)
    before = sessions(server)

    async def body() -> None:
        config = str(compose)
        await RunnerSandboxEnvironment.task_init("t", config)
        assert await RunnerSandboxEnvironment.task_init_environment(config, {"who": "me"}) == {"SAMPLE_METADATA_WHO": "me"}
        envs = await RunnerSandboxEnvironment.sample_init("t", config, {"who": "me"})
        try:
            assert list(envs) == ["default", "side"]
            sb = envs["default"]
            r = await sb.exec(["sh", "-c", "pwd; echo $WHO; echo $X"], env={"X": "y"})
            assert (r.success, r.stdout) == (True, "/work\nme\ny\n")
            r = await sb.exec(["sh", "-c", "cat; exit 3"], input="piped")
            assert (r.returncode, r.stdout) == (3, "piped")
            r = await sb.exec(["pwd"], cwd="sub/..")
            assert r.stdout == "/work\n"
            with pytest.raises(TimeoutError):
                await sb.exec(["sleep", "20"], timeout=1)
            with override_max_exec_output_size(1000):
                with pytest.raises(OutputLimitExceededError) as over:
                    await sb.exec(["sh", "-c", "head -c 5000 /dev/zero | tr '\\0' x"])
                assert over.value.truncated_output == "x" * 1000
            r = await sb.exec(["id", "-u"], user="user")
            assert r.stdout == "1000\n"
            with pytest.raises(SandboxUserUnsupportedError):
                await envs["side"].exec(["id"], user="1000:0")
            # Files: text and bytes, Inspect's errors.
            await sb.write_file("a/b.txt", "x\r\ny")
            assert await sb.read_file("/work/a/b.txt") == "x\r\ny"
            await sb.write_file("bin", b"\xff\xfe")
            assert await sb.read_file("bin", text=False) == b"\xff\xfe"
            with pytest.raises(UnicodeDecodeError):
                await sb.read_file("bin")
            with pytest.raises(FileNotFoundError):
                await sb.read_file("missing")
            with pytest.raises(IsADirectoryError):
                await sb.read_file("a")
            with pytest.raises(IsADirectoryError):
                await sb.read_file("a/.")
            with pytest.raises(IsADirectoryError):
                await sb.write_file("a", "x")
            with override_max_read_file_size(10):
                with pytest.raises(OutputLimitExceededError):
                    await sb.read_file("a/b.txt" if False else "/etc/passwd")
            # connection(): a shell a person can type into.
            conn = await sb.connection()
            assert conn.type == "runner" and conn.container == sb.as_type(RunnerSandboxEnvironment).session_id
            shell = subprocess.run(conn.command, shell=True, input="cd /tmp\npwd; echo $WHO\n", capture_output=True, text=True, timeout=60)
            assert shell.stdout == "/tmp\nme\n", shell
        finally:
            await RunnerSandboxEnvironment.sample_cleanup("t", config, envs, interrupted=False)
        assert sessions(server) == before
        with pytest.raises(Exception):
            await sb.exec(["true"])
        await RunnerSandboxEnvironment.task_cleanup("t", config, cleanup=True)

    run(body())


def test_config_in_code_with_a_pool_and_an_interrupted_sample(server: Server) -> None:
    config = RunnerSandboxEnvironmentConfig(environments={"default": {"image": BUSYBOX, "resources": {"memory": "64Mi"}}}, pool=1)
    assert RunnerSandboxEnvironment.config_deserialize(config.model_dump()) == config

    async def body() -> None:
        await RunnerSandboxEnvironment.task_init("t", config)
        with server.client() as c:
            pools = c.pools.list()
        assert [p.ready for p in pools] == [1], pools
        envs = await RunnerSandboxEnvironment.sample_init("t", config, {})
        sb = envs["default"].as_type(RunnerSandboxEnvironment)
        with server.client() as c:
            assert c.sessions.get(sb.session_id).info.raw.get("pool") == pools[0].name

        # A sample cancelled mid-command: cleanup (interrupted=True) still removes it.
        task = asyncio.ensure_future(sb.exec(["sleep", "30"]))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await RunnerSandboxEnvironment.sample_cleanup("t", config, envs, interrupted=True)
        with server.client() as c:
            assert sb.session_id not in [s.id for s in c.sessions.list()]
        await RunnerSandboxEnvironment.task_cleanup("t", config, cleanup=True)
        with server.client() as c:
            assert c.pools.list() == []

    run(body())


def test_exec_remote_streams_through_inspects_sandbox_tools(server: Server) -> None:
    config = RunnerSandboxEnvironmentConfig(environments={"default": {"image": PYTHON}})

    async def body() -> None:
        envs = await RunnerSandboxEnvironment.sample_init("t", config, {})
        # As Inspect hands sandboxes to solvers and tools (exec_remote polls through it).
        sb: SandboxEnvironment = SandboxEnvironmentProxy(envs["default"])
        try:
            proc = await sb.exec_remote(["sh", "-c", "echo one; echo two >&2; read x; echo got $x; exit 4"], ExecRemoteStreamingOptions(stdin_open=True))
            await proc.write_stdin("three\n")
            await proc.close_stdin()
            out, err, code = "", "", None
            async for event in proc:
                if isinstance(event, ExecStdout):
                    out += event.data
                elif isinstance(event, ExecStderr):
                    err += event.data
                elif isinstance(event, ExecCompleted):
                    code = event.exit_code
            assert (out, err, code) == ("one\ngot three\n", "two\n", 4)
            result = await sb.exec_remote(["echo", "awaited"], stream=False)
            assert result.stdout == "awaited\n"
        finally:
            await RunnerSandboxEnvironment.sample_cleanup("t", config, envs, interrupted=False)

    run(body())


def test_configs_runner_cannot_run_are_refused(tmp_path: Path) -> None:
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM x\n")
    compose = tmp_path / "compose.yaml"
    compose.write_text("services:\n  default:\n    image: x\n    privileged: true\n    network_mode: none\n")

    async def body() -> None:
        with pytest.raises(ValueError, match="does not build images"):
            await RunnerSandboxEnvironment.sample_init("t", str(dockerfile), {})
        with pytest.raises(ValueError, match="privileged"):
            await RunnerSandboxEnvironment.sample_init("t", str(compose), {})

    run(body())
