"""The pure parts: paths, stdin, env checks, the scripts' refusals."""

from __future__ import annotations

import base64

import pytest

from runner_harness import _commands as cmd


def test_sandbox_paths_resolve_like_a_shell() -> None:
    assert cmd.sandbox_path("a/b", "/workspace") == "/workspace/a/b"
    assert cmd.sandbox_path("../etc/passwd", "/workspace") == "/etc/passwd"
    assert cmd.sandbox_path("/tmp/./x/../y", "/w") == "/tmp/y"
    assert cmd.sandbox_path("//double", "/w") == "/double"
    assert cmd.sandbox_path(".", "/w") == "/w"
    for bad in ["", "a\0b"]:
        with pytest.raises(ValueError):
            cmd.sandbox_path(bad, "/w")


def test_stdin_is_text_unless_it_cannot_be() -> None:
    assert cmd.stdin_text("héllo") == ("héllo", False)
    assert cmd.stdin_text("x".encode()) == ("x", False)
    text, encoded = cmd.stdin_text(b"\xff\x00")
    assert encoded and base64.b64decode(text) == b"\xff\x00"


def test_env_names_are_checked() -> None:
    assert cmd.check_env({"A_1": 2}) == {"A_1": "2"}  # type: ignore[dict-item]
    for bad in ["1A", "A-B", "", "A B"]:
        with pytest.raises(ValueError, match="environment variable name"):
            cmd.check_env({bad: "x"})


def test_script_refusals_are_found() -> None:
    assert cmd.failure("noise\nrunner-harness-error: ENOENT\n") == cmd.ScriptFailure("ENOENT", "")
    assert cmd.failure("runner-harness-error: EUSERS no setpriv\n") == cmd.ScriptFailure("EUSERS", "no setpriv")
    # A command's own output that only mentions the marker mid-line is not a refusal.
    assert cmd.failure("echo runner-harness-error: ENOENT") is None


def test_switch_probe_answers() -> None:
    assert cmd.Switch.parse("setpriv /usr/bin/setpriv\n") == cmd.Switch("setpriv", "/usr/bin/setpriv")
    assert cmd.Switch.parse("none -") == cmd.Switch("none", "-")
    with pytest.raises(ValueError):
        cmd.Switch.parse("whatever")


def test_helpers_start_sh_by_absolute_path_with_a_pinned_path() -> None:
    for argv in (cmd.read_chunk("/x", 0, 1), cmd.write_chunk("/x", False), cmd.PROBE_SWITCH, cmd.decoding_stdin(["cat"])):
        assert argv[0] == "/bin/sh" and argv[1] == "-c"
        assert "PATH=/usr/sbin:/usr/bin:/sbin:/bin" in argv[2]
    argv = cmd.as_user(["id"], "1000:1000", cmd.Switch("setpriv", "/usr/bin/setpriv"), keep_home=False)
    assert argv[-1] == "id" and argv[4:8] == ["1000:1000", "setpriv", "/usr/bin/setpriv", "0"]
    with pytest.raises(ValueError):
        cmd.as_user(["id"], "", cmd.Switch("su", "/bin/su"), keep_home=False)
