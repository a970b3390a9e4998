"""runner's persistent Python driver: one interpreter state per session, driven over a unix
socket the host listens on. One JSON object per line each way.

Requests:  {"op": "exec", "code": "..."} | {"op": "vars"} | {"op": "var", "name": "x"}
Answers:   exec -> {"output", "stderr", "vars", "error"}; vars -> {"vars": [{name, type, summary}]};
           var -> {"value"} (JSON when serializable, else {"repr": ...}) or {"error"}.
{"op": "detach"} -> {"detached": true}, then the driver closes its connection and connects
again once the host listens (a checkpoint: no connection to the host may be in it).
A timeout is a SIGINT from the host: the running code gets KeyboardInterrupt, the answer
says so, and the interpreter stays usable. Needs only python3; when IPython is installed, code
runs in IPython's InteractiveShell (magics, `_`, display hooks), as reference 003 specifies.
"""
import ast
import contextlib
import io
import json
import os
import signal
import socket
import sys
import time
import traceback

NAMESPACE = {"__name__": "__main__", "__builtins__": __builtins__}
SUMMARY_LIMIT = 200
# Bytes of output and of stderr an answer keeps (head and tail): the host's output limit,
# given as the second argument. The host reads at most 2 * OUTPUT_LIMIT + ANSWER_OVERHEAD
# bytes of an answer line (src/service/sessions/python.rs) and restarts a driver that sends
# more, so every answer is made to fit.
OUTPUT_LIMIT = 10 << 20
ANSWER_OVERHEAD = 1 << 20
# Variable names listed in an answer.
VARS_LIMIT = 10000
# How often a detached driver looks for the host's socket again (seconds). A restored copy
# resumes in this sleep: what is left of it is on the restore's path to its first answer. A
# failed connect costs about 10 us, so a detached driver polling spends under 1% of a core.
RECONNECT_POLL = 0.002
INTERRUPTED = "TimeoutError: execution interrupted (time limit reached)"


def ipython_shell():
    """IPython's shell when it is installed (None otherwise): its namespace replaces ours."""
    try:
        from IPython.core.interactiveshell import InteractiveShell
    except Exception:
        return None
    shell = InteractiveShell.instance(colors="NoColor")
    # A cell's value is output as a kernel shows it, without the terminal's `Out[n]:` prompt.
    shell.displayhook.write_output_prompt = lambda: None
    return shell


SHELL = ipython_shell()
HIDDEN = set()
if SHELL is not None:
    NAMESPACE = SHELL.user_ns
    HIDDEN = set(SHELL.user_ns_hidden)


def clip(text, limit):
    """The head and tail of `text` within `limit` UTF-8 bytes, and how many bytes were left out."""
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return text, 0
    half = limit // 2
    head = data[:half].decode("utf-8", "ignore")
    tail = data[len(data) - half :].decode("utf-8", "ignore")
    kept = len(head.encode("utf-8", "replace")) + len(tail.encode("utf-8", "replace"))
    return head + tail, len(data) - kept


def encode(answer):
    """The answer as one JSON line that fits what the host reads: streams clipped to the
    output limit (halved again while the escaped line is still too long), long lists cut."""
    limit = 2 * OUTPUT_LIMIT + ANSWER_OVERHEAD
    names = answer.get("vars")
    if isinstance(names, list) and len(names) > VARS_LIMIT:
        answer["vars"] = names[:VARS_LIMIT]
        answer["varsTruncated"] = True
    keep = OUTPUT_LIMIT
    raw = {k: answer.get(k) for k in ("output", "stderr")}
    while True:
        for key, text in raw.items():
            if isinstance(text, str):
                answer[key], dropped = clip(text, keep)
                if dropped:
                    answer[key + "DroppedBytes"] = dropped
        data = json.dumps(answer, default=summary, ensure_ascii=False)
        if len(data.encode("utf-8", "replace")) < limit or keep == 0:
            break
        keep //= 2
    if len(data.encode("utf-8", "replace")) >= limit:
        # Not the streams: a value too large to send (`var` of a huge list, a huge traceback).
        data = json.dumps({"error": "driver: the answer is larger than %d bytes" % limit, "value": {"repr": summary(answer.get("value"))}})
    return data


def fits(value, depth=0):
    """Whether every integer in `value` fits the host's JSON numbers (64 bits)."""
    if depth > 100:
        return False
    if isinstance(value, bool) or value is None or isinstance(value, (str, float)):
        return True
    if isinstance(value, int):
        return -(1 << 63) <= value < (1 << 64)
    if isinstance(value, dict):
        return all(fits(v, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(fits(v, depth + 1) for v in value)
    return True


def user_vars():
    return {
        k: v
        for k, v in NAMESPACE.items()
        if k not in HIDDEN and not k.startswith("_") and not isinstance(v, type(sys)) and not callable(v) or (
            not k.startswith("_") and callable(v) and getattr(v, "__module__", None) == "__main__"
        )
    }


def summary(value):
    try:
        text = repr(value)
    except Exception as e:  # a broken __repr__ must not break the driver
        text = "<unrepresentable: %s>" % e
    return text if len(text) <= SUMMARY_LIMIT else text[: SUMMARY_LIMIT - 3] + "..."


def run_ipython(code):
    out, err = io.StringIO(), io.StringIO()
    errors = []

    def keep_traceback(*args, **kwargs):
        kind, value, _ = sys.exc_info()
        if isinstance(value, KeyboardInterrupt):
            errors.append(INTERRUPTED)
        else:
            errors.append(traceback.format_exc(limit=-3))

    # Errors go to `error`, not into the output (IPython prints them to stdout).
    SHELL.showtraceback = keep_traceback
    SHELL.showsyntaxerror = keep_traceback
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            result = SHELL.run_cell(code, store_history=True)
        failure = result.error_before_exec or result.error_in_exec
        if failure is not None and not errors:
            errors.append("".join(traceback.format_exception_only(type(failure), failure)))
    except KeyboardInterrupt:
        errors.append(INTERRUPTED)
    return {"output": out.getvalue(), "stderr": err.getvalue(), "vars": sorted(user_vars()), "error": errors[0] if errors else None}


def run(code):
    if SHELL is not None:
        return run_ipython(code)
    out, err = io.StringIO(), io.StringIO()
    error = None
    try:
        tree = ast.parse(code, "<cell>", "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            exec(compile(tree, "<cell>", "exec"), NAMESPACE)
            if last is not None:
                value = eval(compile(last, "<cell>", "eval"), NAMESPACE)
                if value is not None:
                    print(repr(value))
    except KeyboardInterrupt:
        error = INTERRUPTED
    except BaseException:  # SystemExit too: the session must survive the user's code
        error = traceback.format_exc(limit=-3)
    return {"output": out.getvalue(), "stderr": err.getvalue(), "vars": sorted(user_vars()), "error": error}


def handle(request):
    op = request.get("op")
    if op == "exec":
        return run(request.get("code", ""))
    if op == "vars":
        return {"vars": [{"name": k, "type": type(v).__name__, "summary": summary(v)} for k, v in sorted(user_vars().items())]}
    if op == "var":
        name = request.get("name", "")
        if name not in NAMESPACE:
            return {"error": "no variable %r" % name}
        value = NAMESPACE[name]
        try:
            # Not NaN or Infinity (Python writes them, JSON has none), nor an integer the
            # host's parser cannot hold: those come back as their repr.
            if not fits(value):
                raise ValueError("not a JSON value the host reads")
            json.dumps(value, allow_nan=False)
            return {"value": value}
        except (TypeError, ValueError):
            return {"value": {"repr": summary(value)}}
    return {"error": "unknown op %r" % op}


def connect(path):
    """A connection to the host's socket and our hello on it."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    stream = conn.makefile("rwb")
    hello = {"hello": os.getpid(), "interpreter": "ipython" if SHELL is not None else "python"}
    stream.write((json.dumps(hello) + "\n").encode())
    stream.flush()
    return conn, stream


def reconnect(path):
    """After a detach (a checkpoint of the sandbox): wait for the host's socket to be there
    again (in this sandbox, or in a copy restored from the checkpoint) and connect. Polls: a
    process blocked in nothing but sleep is what CRIU dumps and restores most simply."""
    while True:
        try:
            return connect(path)
        except OSError:
            time.sleep(RECONNECT_POLL)


def serve(stream):
    """Answer requests until EOF (False) or a detach (True)."""
    while True:
        try:
            line = stream.readline()
        except KeyboardInterrupt:
            continue
        if not line:
            return False
        try:
            request = json.loads(line)
            if isinstance(request, dict) and request.get("op") == "detach":
                stream.write(b'{"detached": true}\n')
                stream.flush()
                return True
            answer = handle(request)
        except KeyboardInterrupt:
            answer = {"error": INTERRUPTED}
        except Exception as e:
            answer = {"error": "driver: %s" % e}
        try:
            data = encode(answer)
        except Exception as e:
            data = json.dumps({"error": "driver: %s" % e})
        stream.write((data + "\n").encode("utf-8", "replace"))
        stream.flush()


def main():
    # Started in the background by sh, we inherit SIGINT ignored (POSIX asynchronous lists);
    # the host's SIGINT is how a timeout stops the running code.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    global OUTPUT_LIMIT
    path = sys.argv[1]
    if len(sys.argv) > 2:
        OUTPUT_LIMIT = int(sys.argv[2])
    conn, stream = connect(path)
    while serve(stream):
        stream.close()
        conn.close()
        conn, stream = reconnect(path)


if __name__ == "__main__":
    main()
