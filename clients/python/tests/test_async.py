"""The asyncio flavour, on both servers (TCP and unix socket). Each test runs its own event
loop (`asyncio.run`): no plugin needed."""

from __future__ import annotations

import asyncio
import io
import os
import tarfile
import time
from pathlib import Path
from typing import Awaitable, Dict, TypeVar

import pytest

from runner_client import (
    AsyncClient,
    AsyncSession,
    CommandFailed,
    Conflict,
    NotFound,
    NotSupported,
    TooLarge,
    Unauthorized,
    WaitTimeout,
)

from conftest import HOST_ENV
from test_jobs import manifest

T = TypeVar("T")


def run(aw: Awaitable[T]) -> T:
    return asyncio.run(aw)  # type: ignore[arg-type]


def test_session_calls(async_client_args: Dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f.txt").write_text("uploaded")
    os.symlink("d/f.txt", str(tmp_path / "l"))

    async def main() -> None:
        async with AsyncClient(**async_client_args) as client:
            assert await client.health() == {"status": "ok"}
            async with client.session(HOST_ENV) as s:
                assert isinstance(s, AsyncSession) and s.info.backend == "host"
                r = await s.exec(["sh", "-c", "echo out; echo err >&2; exit 2"])
                assert (r.exit_code, r.stdout, r.stderr) == (2, "out\n", "err\n")
                assert (await s.exec(["cat"], stdin="in", env={"A": "b"})).stdout == "in"

                events = [e async for e in s.stream("echo 1; sleep 0.2; echo 2; exit 4")]
                assert "".join(e.data for e in events if e.type == "stdout") == "1\n2\n"
                assert events[-1].type == "exit" and events[-1].exit_code == 4

                await s.shell("mkdir -p w && cd w && export V=kept")
                out = (await s.shell("pwd; echo $V")).output.splitlines()
                assert out[0].endswith("/w") and out[1] == "kept"
                with pytest.raises(CommandFailed) as failed:
                    await s.shell("echo nope; exit 9", check=True)
                assert failed.value.exit_code == 9 and "nope" in failed.value.output

                await s.write_file("x/y.bin", b"\x00\x01\xff")
                assert await s.read_file("x/y.bin") == b"\x00\x01\xff"
                await s.mkdir("m/n")
                names = {e.name: e.type for e in await s.list_files()}
                assert names["x"] == "directory" and names["m"] == "directory"

                report = await s.upload(tmp_path, "up")
                assert (report.files, report.symlinks) == (1, 1)
                assert await s.read_text("up/l") == "uploaded"
                with tarfile.open(fileobj=io.BytesIO(await s.download("up")), mode="r") as tar:
                    assert any(n.endswith("d/f.txt") for n in tar.getnames())

                with pytest.raises(NotSupported) as ns:
                    await s.python("1 + 1")
                assert ns.value.status == 501
                assert (await s.refresh()).id == s.id
            with pytest.raises(NotFound):
                await client.sessions.get(s.id)

    run(main())


def test_big_bodies(async_client_args: Dict[str, str], tmp_path: Path) -> None:
    """Bodies over 64 KiB wait for "100 Continue"; a refused one is never sent."""
    blob = os.urandom(300 << 10)
    (tmp_path / "blob.bin").write_bytes(blob)

    async def main() -> None:
        async with AsyncClient(**async_client_args) as client:
            async with client.session(HOST_ENV) as s:
                await s.write_file("w.bin", blob)
                assert await s.read_file("w.bin") == blob
                report = await s.upload(tmp_path, "u")
                assert report.files == 1 and report.bytes == len(blob)
                assert await s.read_file("u/blob.bin") == blob
                with pytest.raises(TooLarge):
                    await s.write_file("huge", b"\0" * ((64 << 20) + 1))
                assert (await s.exec("echo after")).stdout == "after\n"
        async with AsyncClient(**dict(async_client_args, token="not-the-token-at-all")) as client:
            for _ in range(3):
                with pytest.raises(Unauthorized):
                    await client.jobs.apply("x" * (1 << 20))
                with pytest.raises(Unauthorized):
                    await client.jobs.apply("kind: Job")

    run(main())


def test_stream_is_incremental_and_closable(async_client_args: Dict[str, str]) -> None:
    async def main() -> None:
        async with AsyncClient(**async_client_args) as client:
            async with client.session(HOST_ENV) as s:
                start = time.monotonic()
                async with s.stream("echo first; sleep 20", timeout=1.5) as stream:
                    first = await stream.__anext__()
                    assert first.data == "first\n"
                    assert time.monotonic() - start < 1.4
                # Left early: the connection was dropped; the session still answers.
                assert (await s.exec("echo after")).stdout == "after\n"
                assert (await s.stream(["true"]).wait()).exit_code == 0

    run(main())


def test_context_manager_deletes_on_exception(async_client_args: Dict[str, str]) -> None:
    ids = []

    async def main() -> None:
        async with AsyncClient(**async_client_args) as client:
            with pytest.raises(ZeroDivisionError):
                async with client.session(HOST_ENV) as s:
                    ids.append(s.id)
                    1 / 0
            with pytest.raises(NotFound):
                await client.sessions.get(ids[0])
            # The awaited form is an async context manager too.
            s2 = await client.session(HOST_ENV)
            with pytest.raises(KeyError):
                async with s2:
                    raise KeyError("x")
            with pytest.raises(NotFound):
                await client.sessions.get(s2.id)

    run(main())


def test_cancelled_call_deletes_and_client_survives(async_client_args: Dict[str, str]) -> None:
    async def main() -> None:
        async with AsyncClient(**async_client_args) as client:
            ids = []

            async def body() -> None:
                async with client.session(HOST_ENV) as s:
                    ids.append(s.id)
                    await s.exec("sleep 10", timeout=1)

            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(body(), 0.5)
            # Cancelled inside the block: the session was still deleted.
            with pytest.raises(NotFound):
                await client.sessions.get(ids[0])
            assert await client.health() == {"status": "ok"}

    run(main())


def test_concurrent_calls(async_client_args: Dict[str, str]) -> None:
    async def one(client: AsyncClient, i: int) -> str:
        async with client.session(HOST_ENV) as s:
            return (await s.exec(["sh", "-c", "sleep 1; echo %d" % i])).stdout

    async def main() -> None:
        async with AsyncClient(**async_client_args) as client:
            start = time.monotonic()
            outs = await asyncio.gather(*(one(client, i) for i in range(6)))
            assert outs == ["%d\n" % i for i in range(6)]
            # Six one-second commands at once, not one after another.
            assert time.monotonic() - start < 4.5

    run(main())


def test_jobs(async_client_args: Dict[str, str], unique: str) -> None:
    async def main() -> None:
        async with AsyncClient(**async_client_args) as client:
            assert await client.jobs.apply(manifest(unique, "echo async-job")) == [unique]
            done = await client.jobs.wait(unique, timeout=60)
            assert done.succeeded and done.result is not None and done.result.stdout == "async-job\n"
            assert await client.jobs.logs(unique) == "async-job\n"
            assert unique in [j.name for j in await client.jobs.list({"suite": "pyclient"})]
            await client.jobs.delete(unique)
            with pytest.raises(NotFound):
                await client.jobs.get(unique)

            slow = unique + "-slow"
            await client.jobs.apply(manifest(slow, "sleep 30"))
            try:
                with pytest.raises(Conflict):
                    await client.jobs.apply(manifest(slow, "sleep 30"))
                with pytest.raises(WaitTimeout):
                    await client.jobs.wait(slow, timeout=0.3)
            finally:
                await client.jobs.delete(slow)

    run(main())


def test_errors(async_client_args: Dict[str, str]) -> None:
    async def main() -> None:
        async with AsyncClient(**async_client_args) as client:
            with pytest.raises(NotFound):
                await client.sessions.get("s-missing")
        bad = dict(async_client_args, token="not-the-token-at-all")
        async with AsyncClient(**bad) as client:
            with pytest.raises(Unauthorized) as info:
                await client.sessions.list()
            assert info.value.status == 401
            with pytest.raises(Unauthorized):
                await client.jobs.apply("kind: Job")
            assert await client.health() == {"status": "ok"}  # needs no token

    run(main())
