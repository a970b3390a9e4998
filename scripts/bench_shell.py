#!/usr/bin/env python3
"""Shell round trip through the Python client: mean and median of 200 `echo hi` calls in one
session of a running `runner serve`.

    pip install ./clients/python
    RUNNER_TOKEN=... scripts/bench_shell.py http://127.0.0.1:8080 local/python:3.11   # or: host
"""
import statistics
import sys
import time

from runner_client import Client


def main() -> None:
    url, env = sys.argv[1], sys.argv[2]
    environment = {"backend": "host"} if env == "host" else {"image": env}
    with Client(url) as client, client.session(environment) as session:
        for _ in range(20):
            session.shell("echo hi")
        times = []
        for _ in range(200):
            start = time.perf_counter()
            result = session.shell("echo hi")
            times.append(time.perf_counter() - start)
            assert result.output == "hi\n", result
    print(
        f"{env}: shell round trip via the Python client: mean {statistics.mean(times) * 1e3:.2f} ms, "
        f"median {statistics.median(times) * 1e3:.2f} ms (200 calls)"
    )


if __name__ == "__main__":
    main()
