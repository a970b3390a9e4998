#!/usr/bin/env python3
"""Cold sessions from several `runner serve`s in turn (scripts/cold-ab.sh): per server and
image the median create and create -> first shell answer, and the median of the differences
of sessions paired in order against the first server.
Usage: cold_ab.py N URL URL... (env BENCH_TOKEN; BLOCK sessions in a row, default 5;
PAUSE_MS after each delete, default 300; IMAGES, comma-separated)."""
import http.client
import json
import os
import statistics
import sys
import time
import urllib.parse

n = int(sys.argv[1])
urls = sys.argv[2:]
token = os.environ["BENCH_TOKEN"]
images = os.environ.get("IMAGES", "local/busybox:1.35,local/python:3.11").split(",")
block = max(1, int(os.environ.get("BLOCK", "5")))
pause = float(os.environ.get("PAUSE_MS", "300")) / 1e3
servers = [(urllib.parse.urlparse(u).hostname, urllib.parse.urlparse(u).port) for u in urls]


def call(server, method, path, body=None):
    conn = http.client.HTTPConnection(*server, timeout=60)
    conn.request(method, path, body=None if body is None else json.dumps(body),
                 headers={"Authorization": "Bearer " + token, "Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    conn.close()
    if response.status >= 300:
        sys.exit(f"{method} {path} on {server}: {response.status} {data[:300]!r}")
    return json.loads(data) if data else None


def session(server, image):
    """One cold session: (create ms, create -> first shell answer ms)."""
    t = time.perf_counter()
    created = call(server, "POST", "/v1/sessions", {"environment": {"image": image}})
    create = time.perf_counter() - t
    answer = call(server, "POST", f"/v1/sessions/{created['id']}/shell", {"command": "true"})
    first = time.perf_counter() - t
    if answer.get("exitCode") != 0:
        sys.exit(f"the first shell answer was {answer}")
    call(server, "DELETE", f"/v1/sessions/{created['id']}")
    return create * 1e3, first * 1e3


results = {(i, image): [] for i in range(len(servers)) for image in images}
for image in images:
    for server in servers:  # each server's first session of an image is not measured
        session(server, image)
        time.sleep(pause)
for k in range(0, n, block):
    for image in images:
        order = list(range(len(servers)))
        if (k // block) % 2:
            order.reverse()
        for i in order:
            for _ in range(min(block, n - k)):
                results[(i, image)].append(session(servers[i], image))
                time.sleep(pause)
for image in images:
    for i in range(len(servers)):
        create = [c for c, _ in results[(i, image)]]
        first = [f for _, f in results[(i, image)]]
        q = statistics.quantiles(first, n=4)
        print(f"{image:20} server {i}: create {statistics.median(create):6.1f} ms, first answer "
              f"{statistics.median(first):6.1f} ms (p25 {q[0]:.1f}, p75 {q[2]:.1f}; n {len(first)})")
    for i in range(1, len(servers)):
        diffs = [b[1] - a[1] for a, b in zip(results[(0, image)], results[(i, image)])]
        print(f"{image:20} server {i} - server 0, first answer: median paired difference {statistics.median(diffs):+.1f} ms")
