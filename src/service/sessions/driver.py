"""runner's persistent Python driver: one interpreter state per session, driven over a unix
socket the host listens on. One JSON object per line each way.

Requests:  {"op": "exec", "code": "..."} | {"op": "vars"} | {"op": "var", "name": "x"}
Answers:   exec -> {"output", "stderr", "vars", "error"}; vars -> {"vars": [{name, type, summary}]};
           var -> {"value"} (JSON when serializable, else {"repr": ...}) or {"error"}.
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
import traceback

NAMESPACE = {"__name__": "__main__", "__builtins__": __builtins__}
SUMMARY_LIMIT = 200
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
    hello = {"hello": os.getpid(), "interpreter": "ipython" if SHELL is not None else "python"}
    stream.write((json.dumps(hello) + "\n").encode())
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
            answer = {"error": INTERRUPTED}
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
