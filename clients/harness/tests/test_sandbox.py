"""The sandbox core against runner serve, on a busybox image (su, busybox tools) and a Debian
one (util-linux setpriv, GNU tools): what `docker exec` would do, case by case."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runner_harness import FileTooLarge, Sandbox, SandboxGone, Server, UserSwitchUnsupported

from _support import BUSYBOX, PYTHON, run, with_sandbox

IMAGES = [BUSYBOX, PYTHON]


@pytest.mark.parametrize("image", IMAGES)
def test_exec_stdin_cwd_env_and_exit(server: Server, image: str) -> None:
    async def body(sb: Sandbox) -> None:
        r = await sb.exec(["sh", "-c", "pwd; echo $FOO; cat; echo err >&2; exit 7"], input="in\n", cwd="/tmp", env={"FOO": "bar"})
        assert (r.exit_code, r.stdout, r.stderr) == (7, "/tmp\nbar\nin\n", "err\n")
        r = await sb.exec(["od", "-An", "-tx1"], input=b"\xff\x00\x01")
        assert r.stdout.split() == ["ff", "00", "01"]
        r = await sb.exec(["sh", "-c", "pwd"], cwd="sub/../.")
        assert r.stdout == "/workspace\n"
        r = await sb.exec(["sleep", "30"], timeout=1)
        assert r.timed_out
        r = await sb.exec(["no-such-program"])
        assert r.exit_code == 127

    run(with_sandbox(server, {"image": image}, body))


@pytest.mark.parametrize("image", IMAGES)
def test_exec_as_another_user(server: Server, image: str) -> None:
    async def body(sb: Sandbox) -> None:
        r = await sb.exec(["sh", "-c", "id -u; id -g; echo $HOME"], user="user")
        assert r.stdout == "1000\n1000\n/home/user\n", r
        r = await sb.exec(["sh", "-c", "id -u; echo $HOME"], user="1000", env={"HOME": "/given"})
        assert r.stdout == "1000\n/given\n", r
        r = await sb.exec(["id", "-u"], user="root")
        assert r.stdout == "0\n"
        r = await sb.exec(["id"], user="nosuchuser")
        assert r.exit_code == 126 and "unable to find user nosuchuser" in r.stderr
        # What the user cannot do, the command cannot either.
        r = await sb.exec(["sh", "-c", "echo x > /root/owned"], user="user")
        assert r.exit_code != 0
        if image == PYTHON:
            r = await sb.exec(["id", "-u"], user="4242:4242")  # no passwd entry: setpriv takes any id
            assert r.stdout == "4242\n"
        else:
            with pytest.raises(UserSwitchUnsupported, match="su"):
                await sb.exec(["id"], user="1000:0")

    run(with_sandbox(server, {"image": image}, body))


def test_a_sandbox_that_is_not_root_runs_as_itself_only(server: Server) -> None:
    async def body(sb: Sandbox) -> None:
        r = await sb.exec(["id", "-u"], user="1000")
        assert r.stdout == "1000\n"
        with pytest.raises(UserSwitchUnsupported):
            await sb.exec(["id", "-u"], user="root")

    run(with_sandbox(server, {"image": PYTHON, "user": "1000:1000"}, body))


@pytest.mark.parametrize("image", IMAGES)
def test_files_anywhere_text_and_binary(server: Server, image: str, tmp_path: Path) -> None:
    async def body(sb: Sandbox) -> None:
        data = os.urandom(5 * 1024 * 1024 + 3)
        await sb.write_file("/opt/deep/blob.bin", data)
        assert await sb.read_file("/opt/deep/blob.bin") == data
        await sb.write_file("crlf.txt", "a\r\nb")
        assert await sb.read_file("/workspace/crlf.txt") == b"a\r\nb"
        await sb.write_file("empty", b"")
        assert await sb.read_file("empty") == b""
        await sb.exec(["ln", "-s", "/opt/deep/blob.bin", "/tmp/link"])
        assert await sb.read_file("/tmp/link") == data
        with pytest.raises(FileNotFoundError):
            await sb.read_file("/nope")
        with pytest.raises(IsADirectoryError):
            await sb.read_file("/opt")
        with pytest.raises(IsADirectoryError):
            await sb.write_file("/opt", "x")
        with pytest.raises(NotADirectoryError):
            await sb.write_file("/opt/deep/blob.bin/under", "x")
        with pytest.raises(OSError, match="not a regular file"):
            await sb.read_file("/dev/zero")
        with pytest.raises(FileTooLarge):
            await sb.read_file("/opt/deep/blob.bin", limit=1024)
        # Directories both ways, modes and links kept, owned by root inside.
        src = tmp_path / "src"
        (src / "sub").mkdir(parents=True)
        (src / "sub" / "run.sh").write_text("#!/bin/sh\necho ran\n")
        (src / "sub" / "run.sh").chmod(0o755)
        (src / "link").symlink_to("sub/run.sh")
        await sb.upload_dir(src, "/srv/app")
        r = await sb.exec(["sh", "-c", "/srv/app/link; stat -c '%u %a' /srv/app/sub/run.sh"])
        assert r.stdout == "ran\n0 755\n", r
        out = tmp_path / "out"
        await sb.download_dir("/srv/app", out)
        assert (out / "sub" / "run.sh").read_text() == "#!/bin/sh\necho ran\n"
        assert os.readlink(out / "link") == "sub/run.sh"
        with pytest.raises(FileNotFoundError):
            await sb.download_dir("/nope", out)

    run(with_sandbox(server, {"image": image}, body))


def test_a_deleted_sandbox_is_gone(server: Server) -> None:
    async def body() -> None:
        client = server.async_client()
        sb = await Sandbox.start(client, {"image": BUSYBOX})
        await sb.delete()
        await sb.delete()  # twice is fine
        with pytest.raises(SandboxGone):
            await sb.exec(["true"])
        await client.aclose()

    run(body())
