"""runner's persistent Python driver: one interpreter state per session, driven over a unix
socket the host listens on. One JSON object per line each way.

Requests:  {"op": "exec", "code": "..."} | {"op": "vars"} | {"op": "var", "name": "x"}
Answers:   exec -> {"output", "stderr", "vars", "error"}; vars -> {"vars": [{name, type, summary}]};
           var -> {"value"} (JSON when serializable, else {"repr": ...}) or {"error"}.
A timeout is a SIGINT from the host: the running code gets KeyboardInterrupt, the answer
says so, and the interpreter stays usable. Needs only python3.
"""
import ast
import contextlib
import io
import json
import os
import signal
import socket
import sys
import traceback

NAMESPACE = {"__name__": "__main__", "__builtins__": __builtins__}
SUMMARY_LIMIT = 200


def user_vars():
    return {
        k: v
        for k, v in NAMESPACE.items()
        if not k.startswith("_") and not isinstance(v, type(sys)) and not callable(v) or (
            not k.startswith("_") and callable(v) and getattr(v, "__module__", None) == "__main__"
        )
    }


def summary(value):
    try:
        text = repr(value)
    except Exception as e:  # a broken __repr__ must not break the driver
        text = "<unrepresentable: %s>" % e
    return text if len(text) <= SUMMARY_LIMIT else text[: SUMMARY_LIMIT - 3] + "..."


def run(code):
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
        error = "TimeoutError: execution interrupted (time limit reached)"
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
            json.dumps(value)
            return {"value": value}
        except (TypeError, ValueError):
            return {"value": {"repr": summary(value)}}
    return {"error": "unknown op %r" % op}


def main():
    # Started in the background by sh, we inherit SIGINT ignored (POSIX asynchronous lists);
    # the host's SIGINT is how a timeout stops the running code.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    path = sys.argv[1]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    stream = conn.makefile("rwb")
    stream.write((json.dumps({"hello": os.getpid()}) + "\n").encode())
    stream.flush()
    while True:
        try:
            line = stream.readline()
        except KeyboardInterrupt:
            continue
        if not line:
            return
        try:
            answer = handle(json.loads(line))
        except KeyboardInterrupt:
            answer = {"error": "TimeoutError: execution interrupted (time limit reached)"}
        except Exception as e:
            answer = {"error": "driver: %s" % e}
        try:
            data = json.dumps(answer, default=summary)
        except Exception as e:
            data = json.dumps({"error": "driver: %s" % e})
        stream.write((data + "\n").encode())
        stream.flush()


if __name__ == "__main__":
    main()
