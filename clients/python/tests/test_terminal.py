"""Terminals (`Session.terminal`) on the host backend, over TCP and the unix socket: a shell's
window size and resize, Ctrl-C reaching the foreground command, the Python REPL, errors."""

from __future__ import annotations

import time

import pytest

from runner_client import BadRequest, Client, NotFound, NotSupported, Terminal, WaitTimeout

from conftest import HOST_ENV


def test_a_shell_on_a_terminal_resizes_and_interrupts(client: Client) -> None:
    with client.session(HOST_ENV) as s:
        with s.terminal(["sh"], rows=30, cols=100) as t:
            assert isinstance(t, Terminal)
            t.write("stty size\r")
            t.expect("30 100")
            t.resize(12, 34)
            t.write("stty size\r")
            t.expect("12 34")
            t.write("sleep 60\r")
            time.sleep(0.3)
            t.write("\x03")
            t.write("echo after-$?\r")
            t.expect("after-130")
            t.write("sleep 60\r")
            time.sleep(0.3)
            t.signal("INT")
            t.write("echo again-$?\r")
            t.expect("again-130")
            t.write("exit 7\r")
            assert t.wait(30) == 7
            assert t.errors == []


def test_the_python_repl_on_a_terminal(client: Client) -> None:
    with client.session(HOST_ENV) as s:
        with s.terminal(["python3", "-i", "-q"]) as t:
            t.expect(">>> ")
            t.write("import sys; print(sys.stdin.isatty(), 6 * 7)\r")
            t.expect("True 42")
            t.write("exit(3)\r")
            assert t.wait(30) == 3
        with pytest.raises(WaitTimeout):
            with s.terminal(["cat"]) as t:
                t.expect("never printed", timeout=0.5)


def test_terminal_errors(client: Client) -> None:
    with client.session(HOST_ENV) as s:
        with pytest.raises(BadRequest):
            s.terminal(["sh"], rows=0)
        with s.terminal(["sh"]) as t:
            t.resize(0, 10)
            t.write("echo ok\r")
            t.expect("ok")
            assert t.errors and "rows" in t.errors[0]
    gone = client.session(HOST_ENV)
    gone.delete()
    with pytest.raises(NotFound):
        gone.terminal(["sh"])


def test_watching_the_workspace(client: Client) -> None:
    with client.session(HOST_ENV) as s:
        events = s.watch()
        assert next(events)["type"] == "ready"
        s.exec(["sh", "-c", "mkdir d && echo hi > d/a.txt"])
        seen = []
        for event in events:
            seen.append(event)
            # Created (or found when d was watched, if the write came first).
            if event.get("path") == "d/a.txt":
                break
        assert {"type": "create", "path": "d", "dir": True} in seen
        s.exec(["mv", "d/a.txt", "d/b.txt"])
        for event in events:
            if event["type"] == "move":
                assert event == {"type": "move", "from": "d/a.txt", "to": "d/b.txt", "dir": False}
                break
        events.close()
        with pytest.raises(NotFound):
            next(s.watch("missing"))


def test_a_host_session_has_no_metrics_of_its_own(client: Client) -> None:
    with client.session(HOST_ENV) as s:
        with pytest.raises(NotSupported):
            s.metrics()
