"""Watches a `runner serve` for the sessions the harnesses make and records, for each, what
its container is: the OCI spec containerd holds (through ctr) and what the sandbox's own
processes see (/proc/self/status, uid_map), while it lives. `check` then says whether each
had runner's hardening and whether anything is left.

    python watch.py watch URL TOKEN_FILE OUT.jsonl       # until SIGTERM
    python watch.py check OUT.jsonl FROM_LINE MIN_SESSIONS
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List

from runner_client import Client, RunnerError

CTR = ["ctr", "--address", os.environ.get("CONTAINERD_ADDRESS", ""), "--namespace", os.environ.get("CONTAINERD_NAMESPACE", "")]

# What the product contract (shared/docs/security.md, README "The hardened spec") says every
# sandbox has.
REQUIRED_NAMESPACES = {"pid", "ipc", "uts", "mount", "cgroup", "network", "user"}
REQUIRED_MASKED = {"/proc/kcore", "/proc/keys", "/proc/timer_list", "/sys/firmware"}
MAX_CAPS = 10
FORBIDDEN_CAPS = {"CAP_SYS_ADMIN", "CAP_NET_ADMIN", "CAP_SYS_PTRACE", "CAP_NET_RAW", "CAP_MKNOD", "CAP_SYS_MODULE"}


def container_of(session: str) -> Dict[str, Any]:
    ids = subprocess.run(CTR + ["containers", "ls", "-q", 'labels."runner.dev/job"==%s' % session], capture_output=True, text=True, check=True).stdout.split()
    if len(ids) != 1:
        raise RuntimeError("session %s: %d containers" % (session, len(ids)))
    info = json.loads(subprocess.run(CTR + ["containers", "info", ids[0]], capture_output=True, text=True, check=True).stdout)
    return {"id": ids[0], "labels": info.get("Labels", {}), "spec": info["Spec"]}


def observe(client: Client, session: str) -> Dict[str, Any]:
    record: Dict[str, Any] = {"session": session, "time": time.time()}
    record.update(container_of(session))
    s = client.sessions.get(session)
    r = s.exec(["/bin/sh", "-c", "grep -E '^(NoNewPrivs|Seccomp|CapEff|CapBnd|Uid):' /proc/self/status; echo uid_map; cat /proc/self/uid_map"], timeout=30)
    record["proc"] = r.stdout
    record["pool"] = s.info.raw.get("pool")
    return record


def watch(url: str, token_file: str, out: str) -> None:
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    seen = set()
    with open(token_file) as f:
        token = f.read().strip()
    with Client(url, token=token, timeout=60) as client, open(out, "a", buffering=1) as log:
        while not stop:
            try:
                ids = [s.id for s in client.sessions.list()]
            except (RunnerError, OSError):
                time.sleep(0.05)
                continue
            for sid in ids:
                if sid in seen:
                    continue
                seen.add(sid)
                try:
                    log.write(json.dumps(observe(client, sid)) + "\n")
                except Exception as e:  # gone already: said, and `check` counts it as unobserved
                    log.write(json.dumps({"session": sid, "error": str(e)}) + "\n")
            time.sleep(0.05)


def violations(record: Dict[str, Any]) -> List[str]:
    out = []
    spec = record["spec"]
    process = spec["process"]
    linux = spec["linux"]
    if process.get("noNewPrivileges") is not True:
        out.append("noNewPrivileges is not true")
    caps = process.get("capabilities", {})
    bounding = set(caps.get("bounding", []))
    if len(bounding) > MAX_CAPS or bounding & FORBIDDEN_CAPS:
        out.append("capabilities: %s" % sorted(bounding))
    if caps.get("inheritable") or caps.get("ambient"):
        out.append("inheritable or ambient capabilities")
    seccomp = linux.get("seccomp") or {}
    if seccomp.get("defaultAction") not in ("SCMP_ACT_ERRNO", "SCMP_ACT_KILL", "SCMP_ACT_KILL_PROCESS"):
        out.append("seccomp default action %r" % seccomp.get("defaultAction"))
    names = {n["type"] for n in linux.get("namespaces", []) if not n.get("path")}
    pinned = {n["type"] for n in linux.get("namespaces", []) if n.get("path")}
    if not REQUIRED_NAMESPACES <= names | pinned:
        out.append("namespaces: %s" % sorted(names | pinned))
    if not REQUIRED_MASKED <= set(linux.get("maskedPaths", [])):
        out.append("masked paths: %s" % linux.get("maskedPaths"))
    resources = linux.get("resources", {})
    if not resources.get("memory", {}).get("limit") or not resources.get("pids", {}).get("limit"):
        out.append("memory or pids limit missing: %s" % resources)
    devices = resources.get("devices", [])
    if not devices or devices[0] != {"allow": False, "access": "rwm"}:
        out.append("device rules do not start with deny-all")
    proc = record["proc"]
    if "NoNewPrivs:\t1" not in proc or "Seccomp:\t2" not in proc:
        out.append("in the sandbox: %r" % proc)
    uid_map = proc.split("uid_map", 1)[1].split()
    if len(uid_map) < 3 or uid_map[1] == "0":
        out.append("root in the sandbox is root on the host: uid_map %s" % uid_map)
    if record["labels"].get("runner.dev/managed") != "true":
        out.append("not labelled runner.dev/managed")
    return out


def check(path: str, from_line: int, minimum: int) -> int:
    with open(path) as f:
        records = [json.loads(line) for line in f.readlines()[from_line:]]
    failed = False
    observed = [r for r in records if "error" not in r]
    for r in records:
        if "error" in r:
            print("FAIL: session %s was not observed: %s" % (r["session"], r["error"]))
            failed = True
            continue
        bad = violations(r)
        if bad:
            print("FAIL: session %s (%s): %s" % (r["session"], r["id"], "; ".join(bad)))
            failed = True
        else:
            caps = len(r["spec"]["process"]["capabilities"]["bounding"])
            print("session %s: container %s hardened (noNewPrivileges, seccomp %s, %d capabilities, user namespace %s, pool %s)" % (
                r["session"], r["id"], r["spec"]["linux"]["seccomp"]["defaultAction"], caps,
                " ".join(r["proc"].split("uid_map", 1)[1].split()[:3]), r.get("pool")))
    if len(observed) < minimum:
        print("FAIL: %d sandboxes observed, at least %d expected" % (len(observed), minimum))
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1] == "watch":
        watch(sys.argv[2], sys.argv[3], sys.argv[4])
    elif sys.argv[1] == "check":
        sys.exit(check(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
    else:
        sys.exit("usage: watch.py watch URL TOKEN_FILE OUT | check OUT FROM_LINE MIN")
