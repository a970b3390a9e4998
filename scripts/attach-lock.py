#!/usr/bin/env python3
"""What keeping the cgroup attach lock warm saves on this host, measured in the kernel alone:
the time to move a process into a cgroup (what runc does once per cold container) after an
idle moment, with and without a thread moving itself into its own cgroup every 4 ms (what
runner's attach_lock does while a create is in flight). Root, cgroup v1 memory hierarchy.
Usage: scripts/attach-lock.py [N]."""
import os, time, threading, statistics, subprocess, sys
mem = "/sys/fs/cgroup/memory"
exp = os.path.join(mem, "runner-attach-exp")
os.makedirs(exp, exist_ok=True)
own = None
for l in open("/proc/self/cgroup"):
    h, ctrl, path = l.strip().split(":", 2)
    if "memory" in ctrl.split(","):
        own = os.path.join(mem, path.lstrip("/"))
child = subprocess.Popen(["sleep", "1000"])
def attach(cg, pid):
    with open(os.path.join(cg, "cgroup.procs"), "w") as f:
        f.write(str(pid))
def timed(n, gap):
    out = []
    for _ in range(n):
        time.sleep(gap)
        t = time.perf_counter()
        attach(exp, child.pid)
        out.append((time.perf_counter() - t) * 1e3)
        attach(own, child.pid)
    return out
stop = False
def warmer():
    while not stop:
        attach(own, os.getpid())
        time.sleep(0.004)
n = int(sys.argv[1]) if len(sys.argv) > 1 else 30
cold = timed(n, 0.2)
th = threading.Thread(target=warmer); th.start()
time.sleep(0.05)
warm = timed(n, 0.2)
stop = True; th.join()
cold2 = timed(n, 0.2)
child.kill(); child.wait()
os.rmdir(exp)
q = lambda xs: "median %.2f  p90 %.2f  max %.2f ms" % (statistics.median(xs), sorted(xs)[int(len(xs)*0.9)], max(xs))
print("attach to a v1 memory cgroup, cold:     ", q(cold))
print("attach, a warmer writing every 4 ms:    ", q(warm))
print("attach, cold again:                     ", q(cold2))
