#!/usr/bin/env python3
"""A stand-in for the Kubernetes API server, for exercising runner's `--kube` client code
(tests/kube_status.rs): the few endpoints `apply --kube` and `delete job --kube` call, on
loopback over plain HTTP. It is not evidence of what Kubernetes does (the recorded objects
and the schema validation are); it shows that runner creates what it exported, follows the
Job, reads the pods' logs, and maps the result.

A created Job "runs" at once: one pod whose log is FAKE_LOG and whose container exits with
FAKE_EXIT (0: the Job completes; otherwise it fails with BackoffLimitExceeded). The Job reads
as active on its first GET, finished after (never, with FAKE_NEVER set). Prints its port on stdout; writes every request
line to the file named by FAKE_REQUESTS.
"""
import json
import os
import sys
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

objects = {}  # (collection path, name) -> object
job_gets = {}
EXIT = int(os.environ.get("FAKE_EXIT", "0"))
LOG = os.environ.get("FAKE_LOG", "")
STAMP = "2026-11-20T10:00:00Z"


def matches(obj, selector):
    labels = obj.get("metadata", {}).get("labels", {})
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


def pod_for(job, namespace):
    name = job["metadata"]["name"]
    failed = EXIT != 0
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{name}-x1y2z",
            "namespace": namespace,
            "creationTimestamp": STAMP,
            "labels": dict(job["spec"]["template"]["metadata"]["labels"], **{"batch.kubernetes.io/job-name": name}),
        },
        "spec": job["spec"]["template"]["spec"],
        "status": {
            "phase": "Failed" if failed else "Succeeded",
            "startTime": STAMP,
            "containerStatuses": [{
                "name": "job", "image": "x", "imageID": "", "ready": False, "restartCount": 0,
                "state": {"terminated": {
                    "exitCode": EXIT, "reason": "Error" if failed else "Completed",
                    "startedAt": STAMP, "finishedAt": "2026-11-20T10:00:02Z",
                }},
            }],
        },
    }


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def record(self):
        path = os.environ.get("FAKE_REQUESTS")
        if path:
            with open(path, "a") as f:
                f.write(f"{self.command} {self.path}\n")

    def send(self, code, body, content_type="application/json"):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def status(self, code, reason, message):
        self.send(code, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                         "message": message, "reason": reason, "code": code})

    def split(self):
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        parts = url.path.strip("/").split("/")
        # /api/v1/namespaces/NS/KIND[/NAME[/log]] or /apis/G/V/namespaces/NS/KIND[/NAME]
        base = 2 if parts[0] == "api" else 3
        namespace = parts[base + 1]
        kind = parts[base + 2]
        rest = parts[base + 3:]
        return "/".join(parts[: base + 3]), namespace, kind, rest, query

    def do_POST(self):
        self.record()
        collection, namespace, kind, _, _ = self.split()
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        name = body["metadata"]["name"]
        if (collection, name) in objects:
            return self.status(409, "AlreadyExists", f'{kind} "{name}" already exists')
        body["metadata"].update({"uid": f"uid-{len(objects)}", "creationTimestamp": STAMP, "resourceVersion": "1"})
        objects[(collection, name)] = body
        if kind == "jobs":
            pod = pod_for(body, namespace)
            objects[(f"api/v1/namespaces/{namespace}/pods", pod["metadata"]["name"])] = pod
        self.send(201, body)

    def do_GET(self):
        self.record()
        collection, namespace, kind, rest, query = self.split()
        if len(rest) == 2 and rest[1] == "log":
            if (collection, rest[0]) not in objects or query.get("container") != "job":
                return self.status(404, "NotFound", "no such pod or container")
            return self.send(200, LOG.encode(), "text/plain")
        if rest:
            obj = objects.get((collection, rest[0]))
            if obj is None:
                return self.status(404, "NotFound", f'{kind} "{rest[0]}" not found')
            if kind == "jobs":
                job_gets[rest[0]] = job_gets.get(rest[0], 0) + 1
                obj = json.loads(json.dumps(obj))
                if job_gets[rest[0]] == 1 or os.environ.get("FAKE_NEVER"):
                    obj["status"] = {"startTime": STAMP, "active": 1}
                elif EXIT == 0:
                    obj["status"] = {"startTime": STAMP, "succeeded": 1, "completionTime": "2026-11-20T10:00:03Z",
                                     "conditions": [{"type": "Complete", "status": "True", "reason": "CompletionsReached",
                                                     "lastTransitionTime": "2026-11-20T10:00:03Z"}]}
                else:
                    obj["status"] = {"startTime": STAMP, "failed": 1,
                                     "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                                                     "message": "Job has reached the specified backoff limit",
                                                     "lastTransitionTime": "2026-11-20T10:00:03Z"}]}
            return self.send(200, obj)
        selector = query.get("labelSelector", "")
        items = [o for (c, _), o in sorted(objects.items()) if c == collection and matches(o, selector)]
        self.send(200, {"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": "1"}, "items": items})

    def do_DELETE(self):
        self.record()
        collection, _, kind, rest, _ = self.split()
        obj = objects.pop((collection, rest[0]), None)
        if obj is None:
            return self.status(404, "NotFound", f'{kind} "{rest[0]}" not found')
        self.send(200, obj)


server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
