"""`python -m runner_harness.shell SESSION_ID`: a line-at-a-time shell in a runner session,
what an Inspect sandbox's `connection()` offers. Each line runs in the session's stateful
shell (its own named shell, so `cd` and `export` persist between lines without touching the
shell agents use); Ctrl-D ends it. runner has no terminal API yet: full-screen programs do
not work here.

The server is RUNNER_URL / RUNNER_SOCKET with RUNNER_TOKEN / RUNNER_TOKEN_FILE: the token is
never on the command line.
"""

from __future__ import annotations

import argparse
import os
import sys

from runner_client import NotFound, RunnerError

from ._connect import ConnectionSettingsError, server_from_env


def main(argv: "list[str] | None" = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner_harness.shell", description=__doc__.split("\n\n")[0])
    parser.add_argument("session", help="the runner session id (s-...)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds each line may run (default 600)")
    args = parser.parse_args(argv)
    try:
        server = server_from_env()
    except ConnectionSettingsError as e:
        print("runner shell: %s" % e, file=sys.stderr)
        return 2
    name = "connect-%d" % os.getpid()
    with server.client() as client:
        try:
            session = client.sessions.get(args.session)
        except NotFound:
            print("runner shell: no session %s on %s" % (args.session, server.address), file=sys.stderr)
            return 2
        interactive = sys.stdin.isatty()
        status = 0
        while True:
            if interactive:
                print("%s$ " % args.session, end="", flush=True)
            line = sys.stdin.readline()
            if not line:
                break
            if not line.strip():
                continue
            try:
                result = session.shell(line.rstrip("\n"), timeout=args.timeout, name=name)
            except RunnerError as e:
                print("runner shell: %s" % e.message, file=sys.stderr)
                return 1
            sys.stdout.write(result.output)
            sys.stdout.flush()
            status = result.exit_code if result.exit_code is not None else 1
            if result.timed_out:
                print("runner shell: the command ran longer than %ss and was interrupted" % args.timeout, file=sys.stderr)
        return status


if __name__ == "__main__":
    sys.exit(main())
