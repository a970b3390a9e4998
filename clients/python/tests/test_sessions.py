"""Sessions through the sync client, on both servers (TCP and unix socket)."""

from __future__ import annotations

import io
import json
import os
import tarfile
import time
from pathlib import Path

import pytest

from runner_client import (
    BadRequest,
    Client,
    CommandFailed,
    Conflict,
    NotFound,
    NotSupported,
    RunnerError,
    Session,
    TooLarge,
    Unprocessable,
)

from conftest import HOST_ENV


def test_health(client: Client) -> None:
    assert client.health() == {"status": "ok"}


def test_create_and_describe(client: Client) -> None:
    with client.session(HOST_ENV) as s:
        assert isinstance(s, Session)
        assert s.id.startswith("s-")
        assert s.info.backend == "host"
        assert os.path.isabs(s.info.workspace)
        assert s.refresh().id == s.id
        assert s.id in [i.id for i in client.sessions.list()]
        assert client.sessions.get(s.id).id == s.id


def test_set_egress_is_checked_and_needs_a_bridge_network(client: Client) -> None:
    with client.session(HOST_ENV) as s:
        # Checked as a manifest's entries, with the entry's place.
        with pytest.raises(BadRequest) as info:
            s.set_egress(["10.0.0.0/8", "not a host!"])
        assert "egress.allow[1]" in str(info.value)
        with pytest.raises(TypeError):
            s.set_egress("10.0.0.0/8")  # type: ignore[arg-type]
        # A host session is on no bridge network (the containerd suite changes a real one).
        with pytest.raises(Conflict) as info:
            s.set_egress(["pypi.org:443"])
        assert "no bridge network" in str(info.value)


def test_pause_and_snapshot_need_a_containerd_sandbox(client: Client) -> None:
    # The containerd suite (tests/sandbox_state.rs) pauses, resumes and snapshots real
    # sandboxes; a host session has no freezer and no filesystem of its own.
    with pytest.raises(BadRequest) as info:
        client.session(HOST_ENV, auto_resume=True)
    assert "autoResume" in str(info.value)
    with client.session(HOST_ENV, pool=False) as s:
        assert s.info.state == "running"
        with pytest.raises(BadRequest) as info:
            s.pause()
        assert "paused" in str(info.value)
        with pytest.raises(BadRequest) as info:
            s.snapshot("x")
        assert "host backend" in str(info.value)
        # Checkpoints and forks too (tests/checkpoint.rs runs them on real sandboxes).
        with pytest.raises(BadRequest) as info:
            s.checkpoint("x")
        assert "host backend" in str(info.value)
        with pytest.raises(BadRequest) as info:
            s.fork(2)
        assert "host backend" in str(info.value)
        assert s.refresh().state == "running"
    with pytest.raises(NotFound):
        client.sessions.restore("gone")
    assert client.sessions.checkpoints() == []
    with pytest.raises(NotFound):
        client.sessions.remove_checkpoint("gone")


def test_exec(client: Client) -> None:
    with client.session(HOST_ENV) as s:
        r = s.exec(["sh", "-c", "echo out; echo err >&2; exit 5"])
        assert (r.exit_code, r.stdout, r.stderr, r.timed_out, r.ok) == (5, "out\n", "err\n", False, False)
        assert s.exec("echo $((6 * 7))").stdout == "42\n"  # a string runs under /bin/sh -c
        assert s.exec(["cat"], stdin="from stdin").stdout == "from stdin"
        assert s.exec(["sh", "-c", "echo $FOO"], env={"FOO": "bar"}).stdout == "bar\n"
        s.mkdir("sub/dir")
        assert s.exec(["pwd"], cwd="sub/dir").stdout.strip().endswith("/sub/dir")
        t = s.exec(["sleep", "5"], timeout=0.5)
        assert t.timed_out and not t.ok


def test_exec_stream(client: Client) -> None:
    with client.session(HOST_ENV) as s:
        start = time.monotonic()
        with s.stream("echo first; sleep 1.5; echo second; echo oops >&2; exit 3") as stream:
            first = next(stream)
            # The first line arrives while the command still runs: it is streamed, not buffered.
            assert time.monotonic() - start < 1.4
            rest = list(stream)
        events = [first] + rest
        # stdout and stderr are separate pipes: their order between them is not kept.
        assert "".join(e.data for e in events if e.type == "stdout") == "first\nsecond\n"
        assert "".join(e.data for e in events if e.type == "stderr") == "oops\n"
        assert [e.type for e in events].count("exit") == 1
        assert events[-1].type == "exit" and events[-1].exit_code == 3
        assert stream.exit is not None and stream.exit.exit_code == 3
        # wait() reads to the end; the connection is reusable afterwards.
        assert s.stream(["sh", "-c", "echo x"]).wait().exit_code == 0
        assert s.exec("true").ok


def test_exec_stream_closed_early(client: Client) -> None:
    with client.session(HOST_ENV) as s:
        stream = s.stream("echo go; sleep 30", timeout=1.5)
        assert next(stream).data == "go\n"
        stream.close()
        assert list(stream) == []
        # A session runs one process at a time, and the server lets a stream's command run on
        # after its client left (to its timeout): the next call waits for it, then works.
        start = time.monotonic()
        assert s.exec("echo still usable").stdout == "still usable\n"
        assert time.monotonic() - start < 10


def test_shell_state_persists(client: Client) -> None:
    with client.session(HOST_ENV) as s:
        s.mkdir("here")
        first = s.shell("cd here && export X=yes && f() { echo fn; }")
        assert first.exit_code == 0 and first.ok
        again = s.shell("pwd; echo $X")
        assert again.output.splitlines()[0].endswith("/here")
        assert again.output.splitlines()[1] == "yes"
        # Named shells keep their own state.
        other = s.shell("echo ${X:-unset}", name="other")
        assert other.output == "unset\n"
        failed = s.shell("echo before; exit 4")
        assert (failed.exit_code, failed.output, failed.ok) == (4, "before\n", False)


def test_shell_check_raise(client: Client) -> None:
    with client.session(HOST_ENV) as s:
        assert s.shell("echo fine", check=True).output == "fine\n"
        with pytest.raises(CommandFailed) as info:
            s.shell("echo partial; echo bad >&2; exit 3", check=True)
        e = info.value
        assert isinstance(e, Unprocessable) and isinstance(e, RunnerError)
        assert e.status == 422
        assert e.exit_code == 3
        assert "partial" in e.output and "bad" in e.output
        assert not e.timed_out
        assert e.message  # the server's own words
        assert isinstance(e.body, dict) and e.body["exitCode"] == 3


def test_files_round_trip(client: Client) -> None:
    with client.session(HOST_ENV) as s:
        data = bytes(range(256)) * 1000
        s.write_file("deep/er/blob.bin", data)  # missing parents are made
        assert s.read_file("deep/er/blob.bin") == data
        s.write_file("text.txt", "héllo\n")
        assert s.read_text("text.txt") == "héllo\n"
        assert s.exec(["cat", "text.txt"]).stdout == "héllo\n"  # the sandbox sees it
        s.mkdir("empty/dir")
        entries = {e.name: e for e in s.list_files()}
        assert entries["text.txt"].type == "file" and entries["text.txt"].size == len("héllo\n".encode())
        assert entries["deep"].type == "directory"
        assert entries["empty"].type == "directory"
        assert [e.name for e in s.list_files("deep/er")] == ["blob.bin"]
        assert s.list_files("empty/dir") == []
        with pytest.raises(NotFound):
            s.read_file("no/such/file")
        with pytest.raises(BadRequest):
            s.read_file("../outside")


def _tree(root: Path) -> None:
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("VALUE = 1\n")
    (root / "pkg" / "sub" / "data.json").write_text(json.dumps({"k": [1, 2]}))
    script = root / "run.sh"
    script.write_text("#!/bin/sh\necho ran\n")
    script.chmod(0o755)
    (root / "empty").mkdir()
    os.symlink("pkg/__init__.py", str(root / "link.py"))


def test_upload_directory(client: Client, tmp_path: Path) -> None:
    _tree(tmp_path)
    with client.session(HOST_ENV) as s:
        report = s.upload(tmp_path, "src")
        assert (report.files, report.symlinks) == (3, 1)
        assert report.dirs >= 3  # pkg, pkg/sub, empty (and src, if counted)
        assert report.bytes == sum(len(p.read_bytes()) for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink())
        listed = {e.name: e for e in s.list_files("src")}
        assert set(listed) == {"pkg", "run.sh", "empty", "link.py"}
        assert listed["link.py"].type == "symlink" and listed["link.py"].target == "pkg/__init__.py"
        assert listed["run.sh"].mode & 0o111
        assert json.loads(s.read_file("src/pkg/sub/data.json")) == {"k": [1, 2]}
        assert s.exec(["./run.sh"], cwd="src").stdout == "ran\n"
        assert s.exec(["cat", "src/link.py"]).stdout == "VALUE = 1\n"
        # One file uploads under its own name; into the workspace itself by default.
        s.upload(tmp_path / "run.sh")
        assert s.read_text("run.sh") == "#!/bin/sh\necho ran\n"


def test_big_bodies(client: Client, tmp_path: Path) -> None:
    blob = os.urandom(300 << 10)
    (tmp_path / "blob.bin").write_bytes(blob)
    with client.session(HOST_ENV) as s:
        s.write_file("w.bin", blob)
        assert s.read_file("w.bin") == blob
        assert s.upload(tmp_path, "u").bytes == len(blob)
        assert s.read_file("u/blob.bin") == blob
        with pytest.raises(TooLarge):
            s.write_file("huge", b"\0" * ((64 << 20) + 1))
        assert s.exec("echo after").stdout == "after\n"


def test_upload_tar_and_download(client: Client) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("a/b.txt")
        payload = b"tarred"
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    with client.session(HOST_ENV) as s:
        report = s.upload_tar(buf.getvalue(), "t")
        assert report.files == 1 and report.bytes == 6
        assert s.read_file("t/a/b.txt") == b"tarred"
        with tarfile.open(fileobj=io.BytesIO(s.download("t")), mode="r") as tar:
            names = tar.getnames()
            member = next(m for m in tar.getmembers() if m.name.endswith("b.txt"))
            extracted = tar.extractfile(member)
            assert extracted is not None and extracted.read() == b"tarred"
        assert any(n.endswith("a/b.txt") for n in names)


def test_delete(client: Client) -> None:
    s = client.session(HOST_ENV)
    s.write_file("x", "y")
    workspace = s.info.workspace
    s.delete()
    with pytest.raises(NotFound):
        client.sessions.get(s.id)
    with pytest.raises(NotFound):
        s.exec("true")
    with pytest.raises(NotFound):
        s.delete()
    assert s.id not in [i.id for i in client.sessions.list()]
    # Its scratch workspace goes with it: removed on the server's blocking pool once the
    # session is gone, so on a busy machine a moment after the answer.
    deadline = time.monotonic() + 10
    while os.path.exists(workspace) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(workspace), "the scratch workspace outlived its session by 10 s"


def test_context_manager_deletes(client: Client) -> None:
    with client.session(HOST_ENV) as s:
        pass
    with pytest.raises(NotFound):
        client.sessions.get(s.id)


def test_context_manager_deletes_on_exception(client: Client) -> None:
    class Boom(Exception):
        pass

    seen = []
    with pytest.raises(Boom):
        with client.session(HOST_ENV) as s:
            seen.append(s.id)
            raise Boom()
    with pytest.raises(NotFound):
        client.sessions.get(seen[0])


def test_context_manager_when_already_deleted(client: Client) -> None:
    with client.session(HOST_ENV) as s:
        s.delete()  # leaving the block finds it gone: fine


def test_python_not_supported_on_host(client: Client) -> None:
    with client.session(HOST_ENV) as s:
        with pytest.raises(NotSupported) as info:
            s.python("x = 1")
        assert info.value.status == 501
        assert "containerd" in info.value.message
        with pytest.raises(NotSupported):
            s.vars()


def test_missing_session(client: Client) -> None:
    with pytest.raises(NotFound) as info:
        client.sessions.get("s-doesnotexist")
    assert info.value.status == 404 and "s-doesnotexist" in info.value.message
    gone = client.session(HOST_ENV)
    gone.delete()
    for call in (lambda: gone.exec("true"), lambda: gone.read_file("x"), lambda: gone.shell("true"), gone.refresh):
        with pytest.raises(NotFound):
            call()


def test_bad_requests(client: Client) -> None:
    with client.session(HOST_ENV) as s:
        with pytest.raises(BadRequest) as info:
            s.exec("true", timeout=-1)
        assert "timeoutSeconds" in info.value.message
        with pytest.raises(BadRequest):
            s.stream(["true"], timeout=0)
        with pytest.raises(BadRequest):
            s.exec([])
    with pytest.raises(RunnerError) as bad_env:
        client.session({"backend": "host", "noSuchField": 1})
    assert bad_env.value.status in (400, 422)


def test_setup_failure_is_unprocessable(client: Client) -> None:
    with pytest.raises(Unprocessable) as info:
        client.session({"backend": "host", "setup": {"commands": ["exit 7"]}})
    assert info.value.status == 422


MANIFEST = """\
# Two Environments and a Job: a session takes the one it is told.
apiVersion: runner/v1alpha1
kind: Environment
metadata: {name: plain}
spec:
  backend: host
---
apiVersion: runner/v1alpha1
kind: Environment
metadata:
  name: greeter
spec:
  backend: host
  env:
    GREETING: hello
    ANSWER: "042"
    FLAG: on
---
apiVersion: runner/v1alpha1
kind: Job
metadata: {name: unused}
spec:
  environment: greeter
  command: ["true"]
"""


def test_session_from_manifest(client: Client, tmp_path: Path) -> None:
    path = tmp_path / "envs.yaml"
    path.write_text(MANIFEST)
    with client.session(manifest=path, environment_name="greeter") as s:
        out = s.exec(["sh", "-c", "echo $GREETING $ANSWER $FLAG"]).stdout
        # YAML 1.2 like the server's parser: `on` stays the string "on".
        assert out == "hello 042 on\n"
    with pytest.raises(ValueError, match="2 Environments"):
        client.session(manifest=path)
    with pytest.raises(ValueError, match="no Environment named"):
        client.session(manifest=path, environment_name="nope")
    single = tmp_path / "single.json"
    single.write_text(
        json.dumps(
            {
                "apiVersion": "runner/v1alpha1",
                "kind": "Environment",
                "metadata": {"name": "j"},
                "spec": {"backend": "host", "env": {"FROM": "json"}},
            }
        )
    )
    with client.session(manifest=str(single)) as s:
        assert s.exec(["sh", "-c", "echo $FROM"]).stdout == "json\n"


def test_session_with_whole_document(client: Client) -> None:
    doc = {
        "apiVersion": "runner/v1alpha1",
        "kind": "Environment",
        "metadata": {"name": "doc"},
        "spec": {"backend": "host", "env": {"V": "1"}},
    }
    with client.session(doc) as s:
        assert s.exec(["sh", "-c", "echo $V"]).stdout == "1\n"


def test_workspace_given(client: Client, scratch: str, unique: str) -> None:
    workspace = Path(scratch) / unique
    workspace.mkdir()
    (workspace / "seed.txt").write_text("seeded")
    with client.session(HOST_ENV, workspace=str(workspace)) as s:
        assert s.info.workspace == str(workspace)
        assert s.exec(["cat", "seed.txt"]).stdout == "seeded"
        s.write_file("made.txt", "by the api")
    assert (workspace / "made.txt").read_text() == "by the api"  # a given workspace is kept
