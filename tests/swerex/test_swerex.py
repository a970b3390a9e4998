#!/usr/bin/env python3
"""SWE-ReX 1.4.0 drives one runner session through its RemoteRuntime and the same sequence
through its own LocalRuntime; every observation and exception is compared.

    test_swerex.py URL TOKEN_FILE SESSION_JSON

(run by tests/swerex/run.sh). What is compared: each response model (all fields), or each
exception's class, message and extra_info, with the two runtimes' base directories written as
<B> (inside the runner session's workspace, for ours) and <O> (outside it). Not compared:
create_session's `output`, which for SWE-ReX is its terminal's prompt (the host's
/etc/bash.bashrc PS1), and what follows a timeout, where we differ on purpose.
"""

import asyncio
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request

# The LocalRuntime's shell is an interactive bash on a pty: with a real TERM, readline wraps
# every command in bracketed-paste escapes and SWE-ReX's output keeps their \r\n remains.
os.environ["TERM"] = "dumb"

from swerex import exceptions as sx  # noqa: E402
from swerex.runtime.abstract import (  # noqa: E402
    BashAction,
    BashInterruptAction,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)
from swerex.runtime.local import LocalRuntime  # noqa: E402
from swerex.runtime.remote import RemoteRuntime  # noqa: E402

URL, TOKEN_FILE, SESSION_JSON = sys.argv[1:4]
TOKEN = open(TOKEN_FILE).read().strip()
SESSION = json.loads(SESSION_JSON)
SWEREX_URL = f"{URL}/v1/sessions/{SESSION['id']}/swerex"

failures: list[str] = []
# RemoteRuntime logs every transferred exception as an error; they are expected here.
QUIET = logging.getLogger("swerex-test-quiet")
QUIET.setLevel(logging.CRITICAL)


def fail(message: str) -> None:
    failures.append(message)
    print(f"MISMATCH {message}", flush=True)


class Side:
    """One runtime and its directories."""

    def __init__(self, name, runtime, base, outside):
        self.name, self.rt, self.base, self.outside = name, runtime, base, outside

    def norm(self, value):
        if isinstance(value, str):
            return value.replace(self.base, "<B>").replace(self.outside, "<O>")
        if isinstance(value, dict):
            return {k: self.norm(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.norm(v) for v in value]
        return value


async def outcome(side: Side, step):
    """('ok', model name, fields) or ('raise', class, message, extra_info), normalised."""
    try:
        result = await step(side.rt, side.base, side.outside)
    except Exception as e:  # noqa: BLE001 - every exception is an observation here
        return ("raise", type(e), side.norm(str(e)), side.norm(getattr(e, "extra_info", {}) or {}))
    return ("ok", type(result).__name__, side.norm(result.model_dump()))


async def same(label, ours: Side, local: Side, step, *, skip_fields=()):
    o, l = await outcome(ours, step), await outcome(local, step)
    if o[0] == "ok" and l[0] == "ok":
        o = (o[0], o[1], {k: v for k, v in o[2].items() if k not in skip_fields})
        l = (l[0], l[1], {k: v for k, v in l[2].items() if k not in skip_fields})
    if o == l:
        print(f"same     {label}: {o[1].__name__ if o[0] == 'raise' else o[1]} {o[2]!r}", flush=True)
    else:
        fail(f"{label}\n   ours:  {o!r}\n   local: {l!r}")
    return o


def expect(label, condition, detail=""):
    if condition:
        print(f"ok       {label}", flush=True)
    else:
        fail(f"{label} {detail}")


def at(text, base, outside):
    """`text` with {B} and {O} replaced by a runtime's directories."""
    return text.replace("{B}", base).replace("{O}", outside)


def http(method, path, headers):
    req = urllib.request.Request(URL + path, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


async def mean_round_trip(rt, n=200):
    """Mean ms per call. A measurement, not a check: LocalRuntime gives its prompt 0.1 s after
    each command and fails under load (a busy CI machine), so its misses are counted, not fatal."""
    await rt.run_in_session(BashAction(command="echo hi", session="bench", check="silent"))  # warm up
    start = time.perf_counter()
    missed = 0
    for _ in range(n):
        obs = await rt.run_in_session(BashAction(command="echo hi", session="bench", check="silent"))
        if obs.exit_code != 0 or obs.output != "hi\n":
            missed += 1
    if missed:
        print("  (%d of %d calls came back without their exit code)" % (missed, n))
    return (time.perf_counter() - start) / n * 1000


async def main():
    workspace = SESSION["workspace"]
    ours = Side(
        "ours",
        RemoteRuntime(host=SWEREX_URL, port=None, auth_token=TOKEN, logger=QUIET),
        os.path.join(workspace, "case"),
        tempfile.mkdtemp(prefix="swerex-ours-outside-"),
    )
    local = Side(
        "local",
        LocalRuntime(),
        tempfile.mkdtemp(prefix="swerex-local-"),
        tempfile.mkdtemp(prefix="swerex-local-outside-"),
    )
    os.makedirs(ours.base)
    src = tempfile.mkdtemp(prefix="swerex-upload-src-")
    try:
        await run(ours, local, src)
    finally:
        for d in (ours.outside, local.base, local.outside, src):
            shutil.rmtree(d, ignore_errors=True)


async def run(ours: Side, local: Side, src: str):
    # --- authentication: X-API-Key on the SWE-ReX routes only ---------------------------
    expect("is_alive with X-API-Key", bool(await ours.rt.is_alive()))
    wrong = RemoteRuntime(host=SWEREX_URL, port=None, auth_token="wrong-token-0123456789", logger=QUIET)
    expect("is_alive with a wrong key is False", not bool(await wrong.is_alive()))
    expect("X-API-Key is not a token elsewhere", http("GET", "/v1/sessions", {"X-API-Key": TOKEN}) == 401)
    # SWE-ReX's own root route (GET /) answers a greeting, behind the key like the rest.
    root = urllib.request.Request(SWEREX_URL + "/", headers={"X-API-Key": TOKEN})
    with urllib.request.urlopen(root, timeout=30) as r:
        expect("the root answers as SWE-ReX's server does", json.loads(r.read()) == {"message": "hello world"})
    expect("the root needs the key", http("GET", SWEREX_URL[len(URL):] + "/", {}) == 401)

    def bash(command, **kw):
        return lambda rt, B, O: rt.run_in_session(BashAction(command=at(command, B, O), **kw))

    # --- a bash session that keeps state --------------------------------------------------
    await same("create_session", ours, local, lambda rt, B, O: rt.create_session(CreateBashSessionRequest()),
               skip_fields=("output",))
    await same("cd and export", ours, local, bash("cd {B} && export FOO=bar"))
    await same("exported variable and cwd kept", ours, local, bash("echo $FOO; pwd"))
    await same("plain variables", ours, local, bash("x=5; y='two words'"))
    await same("plain variables kept", ours, local, bash('echo "$x $y"'))
    await same("function", ours, local, bash("f() { echo fn-$1; }"))
    await same("function kept", ours, local, bash("f 1"))
    await same("two lines", ours, local, bash("echo a\necho b"))
    await same("no trailing newline", ours, local, bash("printf abc"))
    await same("heredoc", ours, local, bash("cat <<EOF\nhello $FOO\nEOF"))
    await same("carriage return", ours, local, bash("printf 'a\\r\\nb\\n'"))
    await same("colours stripped", ours, local, bash("echo -e '\\e[31mred\\e[0m'"))
    await same("stderr interleaved", ours, local, bash("echo one; echo two >&2; echo three"))
    await same("failing, check=silent", ours, local, bash("ls /nonexistent-swerex-test", check="silent"))
    await same("failing, check=ignore", ours, local, bash("false", check="ignore"))
    await same("$? kept after check=ignore", ours, local, bash("echo $?"))
    await same("$? reset by reading the exit code", ours, local, bash("echo $?"))
    await same("check=raise", ours, local, bash("(echo out; exit 3)", check="raise"))
    await same("check=raise with error_msg", ours, local, bash("false", check="raise", error_msg="custom"))
    await same("bad syntax", ours, local, bash("echo )", check="silent"))
    await same("bad syntax runs nothing", ours, local, bash("echo ran > {B}/ran.txt\nif", check="silent"))
    await same("... nothing", ours, local, bash("ls {B}/ran.txt", check="silent"))
    # bashlex cannot parse an array assignment: SWE-ReX then ends the command with its own
    # marker, which it answers as expect_string.
    await same("arrays, integers, read-only", ours, local, bash("arr=(1 'a b'); declare -i n=3; readonly r=ro"),
               skip_fields=("expect_string",))
    await same("... kept", ours, local, bash('echo "${arr[1]} ${#arr[@]} $n $r"; n+=1; echo $n'))
    await same("state survives the failures", ours, local, bash("echo $FOO $x; pwd"))
    await same("no such session", ours, local, bash("echo hi", session="nope"))
    await same("session exists", ours, local,
               lambda rt, B, O: rt.create_session(CreateBashSessionRequest(session="default")))

    # --- files ------------------------------------------------------------------------------
    def write(path, content):
        return lambda rt, B, O: rt.write_file(WriteFileRequest(path=at(path, B, O), content=content))

    def read(path, **kw):
        return lambda rt, B, O: rt.read_file(ReadFileRequest(path=at(path, B, O), **kw))

    await same("write_file (parents made)", ours, local, write("{B}/dir/sub/a.txt", "hello\nworld\n"))
    await same("read_file", ours, local, read("{B}/dir/sub/a.txt"))
    await same("write_file outside the workspace", ours, local, write("{O}/x/y.txt", "out there\n"))
    await same("read_file outside the workspace", ours, local, read("{O}/x/y.txt"))
    await same("the shell sees written files", ours, local, bash("cat {B}/dir/sub/a.txt {O}/x/y.txt"))
    await same("read_file missing", ours, local, read("{B}/missing.txt"))
    await same("read_file missing outside", ours, local, read("{O}/missing.txt"))
    await same("read_file of a directory", ours, local, read("{B}/dir"))
    await same("write_file CRLF", ours, local, write("{B}/crlf.txt", "a\r\nb\rc\n"))
    await same("read_file: universal newlines", ours, local, read("{B}/crlf.txt"))
    await same("non-UTF-8 file", ours, local, bash("printf 'caf\\xe9\\n' > {B}/latin.txt"))
    await same("read_file latin-1", ours, local, read("{B}/latin.txt", encoding="latin-1"))
    await same("read_file errors=replace", ours, local, read("{B}/latin.txt", errors="replace"))
    # LocalRuntime raises UnicodeDecodeError; SWE-ReX's exception transfer cannot rebuild
    # that class from a message, so any remote runtime (SWE-ReX's own server too) raises
    # SwerexException with the same message.
    o, l = await outcome(ours, read("{B}/latin.txt")), await outcome(local, read("{B}/latin.txt"))
    expect("read_file strict: UnicodeDecodeError's message as SwerexException",
           l[:2] == ("raise", UnicodeDecodeError) and o[:3] == ("raise", sx.SwerexException, l[2]), f"{o} {l}")

    # --- upload: a file and a directory (zipped by the client, unzipped by us) -----------
    with open(os.path.join(src, "top.txt"), "w") as f:
        f.write("top\n")
    os.makedirs(os.path.join(src, "sub", "deeper"))
    os.makedirs(os.path.join(src, "empty"))
    with open(os.path.join(src, "sub", "deeper", "b.txt"), "w") as f:
        f.write("deep\nfile\n")
    single = os.path.join(src, "top.txt")

    def upload(source, target):
        return lambda rt, B, O: rt.upload(UploadRequest(source_path=source, target_path=at(target, B, O)))

    listing = "(cd {T} && find . | sort && cat top.txt sub/deeper/b.txt)"
    await same("upload a file", ours, local, upload(single, "{B}/uploaded.txt"))
    await same("uploaded file", ours, local, read("{B}/uploaded.txt"))
    await same("upload a directory", ours, local, upload(src, "{B}/updir"))
    await same("uploaded directory", ours, local, bash(listing.replace("{T}", "{B}/updir")))
    await same("upload a directory outside the workspace", ours, local, upload(src, "{O}/updir"))
    await same("uploaded directory outside", ours, local, bash(listing.replace("{T}", "{O}/updir")))

    # --- execute ----------------------------------------------------------------------------
    def execute(**kw):
        def step(rt, B, O):
            args = dict(kw)
            if isinstance(args.get("command"), str):
                args["command"] = at(args["command"], B, O)
            if args.get("cwd"):
                args["cwd"] = at(args["cwd"], B, O)
            return rt.execute(Command(**args))
        return step

    await same("execute argv", ours, local, execute(command=["echo", "hi there"]))
    await same("execute shell", ours, local, execute(command="echo out; echo err >&2; exit 4", shell=True))
    await same("execute merged streams", ours, local,
               execute(command="echo out; echo err >&2; echo end", shell=True, merge_output_streams=True))
    await same("execute check", ours, local, execute(command=["false"], check=True))
    await same("execute check with error_msg", ours, local,
               execute(command="echo x; exit 2", shell=True, check=True, error_msg="boom"))
    await same("execute timeout", ours, local, execute(command=["sleep", "5"], timeout=0.5))
    await same("execute env replaces the environment", ours, local, execute(command=["env"], env={"ONLY": "1"}))
    await same("execute cwd", ours, local, execute(command=["pwd"], cwd="{B}/dir"))
    await same("execute signal", ours, local, execute(command=["sh", "-c", "kill -9 $$"]))
    await same("execute missing program", ours, local, execute(command=["no-such-program-swerex"]))
    await same("execute missing program, own env", ours, local,
               execute(command=["no-such-program-swerex"], env={"A": "1"}))

    # --- startup_source, a second session ---------------------------------------------------
    await same("rc file", ours, local, write("{B}/rc.sh", "export FROM_RC=sourced\nrc_plain=kept\n"))
    await same("create_session with startup_source", ours, local,
               lambda rt, B, O: rt.create_session(
                   CreateBashSessionRequest(session="second", startup_source=[f"{B}/rc.sh"])),
               skip_fields=("output",))
    await same("startup_source took effect", ours, local, bash("echo $FROM_RC $rc_plain", session="second"))
    await same("sessions are separate", ours, local, bash("echo ${FOO:-unset}", session="second"))
    await same("close_session", ours, local,
               lambda rt, B, O: rt.close_session(CloseBashSessionRequest(session="second")))
    await same("closed session is gone", ours, local, bash("echo hi", session="second"))
    await same("close a missing session", ours, local,
               lambda rt, B, O: rt.close_session(CloseBashSessionRequest(session="second")))

    # --- interactive commands: a terminal, as SWE-ReX's own shell is one ------------------
    def interactive(command, **kw):
        return bash(command, is_interactive_command=True, **{"timeout": 10, **kw})

    await same("interactive: a REPL starts", ours, local, interactive("python3 -q", expect=[">>> "]))
    await same("interactive: a line to the REPL", ours, local, interactive("print(6 * 7)", expect=[">>> "]))
    await same("interactive: a prompt", ours, local, interactive("name = input('na' + 'me: ')", expect=[r"na.e: "]))
    await same("interactive: its answer", ours, local, interactive("runner", expect=[">>> "]))
    await same("interactive: state kept", ours, local, interactive("print(name * 2)", expect=[">>> "]))
    await same("interactive: quit", ours, local, bash("exit()", is_interactive_quit=True, timeout=10))
    await same("after the REPL: the shell's state", ours, local, bash("echo $FOO $x; pwd"))
    await same("interactive: a pager", ours, local,
               interactive("seq 1 100000 | more", expect=["--More--"]), skip_fields=("output",))
    await same("interactive: quitting the pager", ours, local, bash("q", is_interactive_quit=True, timeout=10),
               skip_fields=("output",))
    await same("after the pager", ours, local, bash("echo after-pager $FOO; pwd"))
    # A pager that ignores Ctrl-C: SWE-ReX's interrupt falls back to Ctrl-Z and `kill -9 %1`.
    # LocalRuntime's fails here (pexpect.TIMEOUT, its shell left in the pager); ours gets the
    # prompt back, so only ours is checked.
    await outcome(ours, interactive("seq 1 100000 | more", expect=["--More--"]))
    stopped = await outcome(ours, lambda rt, B, O: rt.run_in_session(BashInterruptAction()))
    back = await outcome(ours, bash("echo back $FOO"))
    expect("ours: an interrupt ends a pager", stopped[0] == "ok" and back[0] == "ok" and back[2]["output"] == "back bar\n",
           f"{stopped} {back}")
    await same("interactive: a program that ends", ours, local, interactive("echo done-at-once"))
    await same("interactive: a timeout", ours, local, interactive("sleep 3", timeout=0.5))
    # What LocalRuntime's interrupt answers depends on what its pexpect buffer still holds.
    await same("interrupting the sleep", ours, local,
               lambda rt, B, O: rt.run_in_session(BashInterruptAction()), skip_fields=("output",))
    await same("after the interrupt", ours, local, bash("echo $FOO"))

    # --- round trip ---------------------------------------------------------------------------
    for side in (ours, local):
        await side.rt.create_session(CreateBashSessionRequest(session="bench"))
    ours_ms = await mean_round_trip(ours.rt)
    local_ms = await mean_round_trip(local.rt)

    # --- a timeout: the same exception; then ours is still usable, SWE-ReX's is not ------
    await same("timeout", ours, local, bash("sleep 5", timeout=0.5))
    after = await outcome(ours, bash("echo after; echo $FOO $x; pwd", timeout=10))
    expect("ours: the session is usable after a timeout, its state kept",
           after == ("ok", "BashObservation", {**after[2], "output": "after\nbar 5\n<B>\n", "exit_code": 0}), after)
    theirs = await outcome(local, bash("echo after", timeout=2))
    print(f"note     SWE-ReX's LocalRuntime after its timeout: {theirs!r}", flush=True)

    exited = await outcome(ours, bash("exit 3", check="silent"))
    still = await outcome(ours, bash("echo still $FOO"))
    expect("ours: `exit` ends the command, not the session",
           exited[0] == "ok" and exited[2]["exit_code"] == 3 and still[0] == "ok" and still[2]["output"] == "still bar\n",
           f"{exited} {still}")

    interrupted = await outcome(ours, lambda rt, B, O: rt.run_in_session(BashInterruptAction()))
    expect("ours: an interrupt with nothing running", interrupted[0] == "ok" and interrupted[2]["exit_code"] == 0,
           interrupted)

    # --- close --------------------------------------------------------------------------------
    await same("close", ours, local, lambda rt, B, O: rt.close())
    gone = await outcome(ours, bash("echo hi"))
    expect("ours: close ends every bash session",
           gone[:2] == ("raise", sx.SessionDoesNotExistError), gone)
    again = await outcome(ours, lambda rt, B, O: rt.create_session(CreateBashSessionRequest()))
    fresh = await outcome(ours, bash("echo ${FOO:-unset} ${x:-unset}"))
    expect("ours: a re-created session starts afresh",
           again[0] == "ok" and fresh[0] == "ok" and fresh[2]["output"] == "unset unset\n", f"{again} {fresh}")

    print()
    print("run_in_session(\"echo hi\"), mean round trip over 200 calls:")
    print(f"  runner via SWE-ReX RemoteRuntime: {ours_ms:.2f} ms")
    print(f"  SWE-ReX LocalRuntime:             {local_ms:.2f} ms")
    if failures:
        print(f"\n{len(failures)} mismatch(es):")
        for f in failures:
            print(f"  - {f.splitlines()[0]}")
        sys.exit(1)
    print("all observations match")


asyncio.run(main())
