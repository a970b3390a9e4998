"""Docker Compose services as runner Environments: one sandbox per service, under the
service's name. Pure (the file's text and the host's environment in, specs out), so the whole
mapping is tested without a server.

What maps: `image`, `environment` / `env_file`, `working_dir`, `user` (numeric uid:gid),
`network_mode: none`, `mem_limit` / `deploy.resources.limits.memory`, `cpus` /
`deploy.resources.limits.cpus`, `pids_limit`, `pull_policy`, bind `volumes`, `command` /
`entrypoint` (the service's main process, started in the background), `healthcheck`,
`depends_on` (start order), `x-default`; accepted with no effect in a sandbox that lives for
one sample: `init`, `stop_grace_period`, `restart`, `tty`, `stdin_open`, reservations,
`x-local`. Everything else Docker would do and runner cannot is refused with the service and
field named: a build, networks or published ports (runner sandboxes reach nothing unless an
`x-runner` egress list says so; there is no service-name DNS between sandboxes), extra
capabilities, privileged mode, devices, a read-only root filesystem.

`x-runner` on a service: `pool: N` (a warm pool per task) and `spec: {...}` (runner Environment
fields merged over the mapped ones: `egress`, `network: bridge`, `resources.ephemeralStorage`,
`hostUsers` ...; the server checks them).
"""

from __future__ import annotations

import os
import platform
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import yaml

COMPOSE_FILES = ["compose.yaml", "compose.yml", "docker-compose.yaml", "docker-compose.yml"]


class ComposeError(ValueError):
    """A compose file that runner cannot run as written."""


@dataclass
class Healthcheck:
    """A service's `healthcheck`, run in its sandbox until it passes (compose's `--wait`)."""

    test: List[str]
    interval: float = 30.0
    timeout: float = 30.0
    retries: int = 3
    start_period: float = 0.0
    start_interval: float = 5.0


@dataclass
class Service:
    """One sandbox to start: its name, runner Environment spec and what runs at start."""

    name: str
    spec: Dict[str, Any]
    default: bool = False
    """`x-default: true`."""
    main: Optional[List[str]] = None
    """The service's `entrypoint` + `command`, started in the background (None: only a
    keep-alive, which runner's sandbox does not need)."""
    mounts: List[Dict[str, Any]] = field(default_factory=list)
    healthcheck: Optional[Healthcheck] = None
    pool: int = 0
    """Members of a warm pool made at task start (x-runner.pool)."""


# Fields handled below, and fields accepted with no effect (see the module docstring).
_MAPPED = {
    "image", "environment", "env_file", "working_dir", "user", "network_mode", "mem_limit",
    "cpus", "deploy", "pids_limit", "pull_policy", "volumes", "command", "entrypoint",
    "healthcheck", "depends_on", "x-default", "x-runner", "platform", "privileged",
    "read_only", "security_opt", "memswap_limit",
}
_IGNORED = {"init", "stop_grace_period", "restart", "tty", "stdin_open", "mem_reservation", "x-local"}

_WHY_NOT = {
    "build": "runner runs prebuilt images: build it elsewhere, `runner image import` (or push and pull) it, and name it in image:",
    "networks": "runner sandboxes are on no network unless x-runner.spec says network: bridge (or a named runner Network) with its egress; services do not reach each other by name",
    "ports": "publishing ports needs a bridge network: use x-runner.spec.ports with network: bridge",
    "expose": "services do not reach each other by name in runner",
    "container_name": "runner names containers itself (and one name would not survive several epochs)",
    "hostname": "a runner sandbox's hostname is its session's name",
    "cap_add": "runner keeps a fixed, small capability set; none can be added",
    "cap_drop": "runner keeps a fixed, small capability set; it cannot drop more per service",
    "devices": "runner gives sandboxes no host devices",
    "runtime": "runner runs every sandbox with runc under its own hardened spec",
    "cgroup": "every runner sandbox has a cgroup namespace of its own",
    "shm_size": "runner does not size /dev/shm per sandbox",
    "ulimits": "runner sets the rlimits of its hardened spec itself",
    "extra_hosts": "runner writes /etc/hosts itself",
    "tmpfs": "runner mounts no tmpfs per service",
    "links": "services do not reach each other by name in runner",
    "external_links": "services do not reach each other by name in runner",
    "secrets": "use environment or a bind volume",
    "configs": "use a bind volume",
    "sysctls": "runner allows no sysctls",
    "ipc": "every runner sandbox has an IPC namespace of its own",
    "pid": "every runner sandbox has a PID namespace of its own",
    "userns_mode": "every runner sandbox has a user namespace of its own (hostUsers in x-runner.spec)",
    "dns": "runner's resolver answers a bridge sandbox's DNS",
    "labels": "runner labels its containers itself",
}

# Commands that only keep a container alive: runner's sandbox stays up without one.
_KEEPALIVE = re.compile(r"^(tail -f /dev/null|sleep (infinity|inf|\d+[smhd]?)|cat|sh|bash|/bin/sh|/bin/bash)$")

_VAR = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose's variable substitution: `$VAR`, `${VAR}`, `${VAR:-default}`, `${VAR-default}`,
    `$$` for a dollar. An unset variable without a default is empty (as compose, which warns)."""

    def sub(m: "re.Match[str]") -> str:
        if m.group(1):
            return "$"
        name = m.group(2) or m.group(5)
        op, default = m.group(3), m.group(4)
        value = env.get(name)
        if op == ":-" and not value:
            return default or ""
        if op == "-" and value is None:
            return default or ""
        return value or ""

    return _VAR.sub(sub, text)


@dataclass
class Project:
    """A compose file's sandboxes: in start order (depends_on first), and which is the default."""

    services: List[Service]
    default: str

    def by_name(self) -> Dict[str, Service]:
        return {s.name: s for s in self.services}


def load(path: str, env: Optional[Mapping[str, str]] = None) -> Project:
    """The services of the compose file at `path`. `env`: what `${VAR}` resolves against
    (default: this process's environment)."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as e:
        raise ComposeError("%s: %s" % (path, e.strerror)) from None
    env = dict(os.environ if env is None else env)
    try:
        raw = yaml.safe_load(interpolate(text, env))
    except yaml.YAMLError as e:
        raise ComposeError("%s: not YAML: %s" % (path, e)) from None
    return services(raw, file.parent, env, source=path)


def services(raw: Any, base_dir: Path, env: Mapping[str, str], *, source: str = "compose") -> Project:
    """The sandboxes a parsed compose document asks for."""
    if not isinstance(raw, Mapping) or not isinstance(raw.get("services"), Mapping) or not raw["services"]:
        raise ComposeError("%s: a compose file needs a services: mapping with at least one service" % source)
    for top in ("volumes", "networks", "secrets", "configs"):
        if raw.get(top):
            raise ComposeError("%s: top-level %s: is not supported by runner (%s)" % (source, top, _top_why(top)))
    unknown = [k for k in raw if k not in ("services", "version", "name", "volumes", "networks") and not str(k).startswith("x-")]
    if unknown:
        raise ComposeError("%s: unknown top-level field %r" % (source, unknown[0]))
    out = [_service(str(name), svc, base_dir, env, source) for name, svc in raw["services"].items()]
    defaults = [s for s in out if s.default]
    if len(defaults) > 1:
        raise ComposeError("%s: x-default: true on several services (%s)" % (source, ", ".join(s.name for s in defaults)))
    default = defaults[0] if defaults else next((s for s in out if s.name == "default"), None)
    if default is None:
        raise ComposeError(
            "%s: no 'default' service: name one service 'default' or add 'x-default: true' to it" % source
        )
    return Project(services=_start_order(out, raw["services"], source), default=default.name)


def _top_why(top: str) -> str:
    return {
        "volumes": "named volumes do not exist; bind a host directory in a service's volumes:",
        "networks": "sandboxes do not share compose networks",
    }.get(top, "use environment or bind volumes")


def _service(name: str, svc: Any, base_dir: Path, env: Mapping[str, str], source: str) -> Service:
    where = "%s: service %r" % (source, name)
    if not isinstance(svc, Mapping):
        raise ComposeError("%s: a service is a mapping" % where)
    for key in svc:
        key = str(key)
        if key in _WHY_NOT:
            raise ComposeError("%s: %s: is not supported: %s" % (where, key, _WHY_NOT[key]))
        if key not in _MAPPED and key not in _IGNORED and not key.startswith("x-"):
            raise ComposeError("%s: %s: is not supported by runner" % (where, key))
    image = svc.get("image")
    if not isinstance(image, str) or not image:
        raise ComposeError("%s: image: is required (runner runs prebuilt images)" % where)
    spec: Dict[str, Any] = {"image": image}
    runner_x = svc.get("x-runner") or {}
    if not isinstance(runner_x, Mapping) or not set(runner_x) <= {"pool", "spec"}:
        raise ComposeError("%s: x-runner: takes pool: and spec: only" % where)
    overrides = runner_x.get("spec") or {}
    if not isinstance(overrides, Mapping):
        raise ComposeError("%s: x-runner.spec: a mapping of runner Environment fields" % where)

    environment = _environment(svc, base_dir, env, where)
    if environment:
        spec["env"] = environment
    if svc.get("working_dir") is not None:
        workdir = str(svc["working_dir"])
        if not workdir.startswith("/"):
            raise ComposeError("%s: working_dir: must be absolute" % where)
        spec["workdir"] = workdir
    # The image's own content at the working directory must stay visible (docker mounts
    # nothing there); runner would otherwise put the session's scratch workspace over it.
    spec["mountWorkspace"] = False
    if svc.get("user") is not None:
        spec["user"] = _user(svc["user"], where)
    _network(svc, overrides, where)
    resources = _resources(svc, where)
    if resources:
        spec["resources"] = resources
    policy = svc.get("pull_policy")
    if policy is not None:
        mapped = {"always": "Always", "never": "Never", "missing": "IfNotPresent", "if_not_present": "IfNotPresent"}
        if policy not in mapped:
            raise ComposeError("%s: pull_policy: %r is not supported (always, never, missing)" % (where, policy))
        spec["imagePullPolicy"] = mapped[policy]
    if svc.get("platform") is not None:
        _platform(str(svc["platform"]), where)
    if svc.get("privileged"):
        raise ComposeError("%s: privileged: true is not supported: runner never runs a privileged sandbox" % where)
    if svc.get("read_only"):
        raise ComposeError("%s: read_only: true is not supported: a runner sandbox's root filesystem is writable (bounded by ephemeralStorage)" % where)
    for opt in svc.get("security_opt") or []:
        if str(opt).replace("=", ":") not in ("no-new-privileges", "no-new-privileges:true"):
            raise ComposeError("%s: security_opt: %r is not supported (runner's seccomp, no-new-privileges and capabilities are fixed)" % (where, opt))
    swap = svc.get("memswap_limit")
    if swap is not None and _bytes(swap, where, "memswap_limit") != resources.get("memory"):
        raise ComposeError("%s: memswap_limit: runner gives a sandbox no swap beyond its memory limit: set it equal to mem_limit or leave it out" % where)

    spec = _merge(spec, overrides)
    pool = runner_x.get("pool", 0)
    if isinstance(pool, bool) or not isinstance(pool, int) or pool < 0:
        raise ComposeError("%s: x-runner.pool: a number of warm members (0 for none)" % where)
    default = svc.get("x-default", False)
    if not isinstance(default, bool):
        raise ComposeError("%s: x-default: true or false" % where)
    return Service(
        name=name,
        spec=spec,
        default=default,
        main=_main(svc, where),
        mounts=_mounts(svc.get("volumes"), base_dir, where),
        healthcheck=_healthcheck(svc.get("healthcheck"), where),
        pool=pool,
    )


def _environment(svc: Mapping[str, Any], base_dir: Path, env: Mapping[str, str], where: str) -> Dict[str, str]:
    out: Dict[str, str] = {}
    files = svc.get("env_file") or []
    for entry in [files] if isinstance(files, (str, Mapping)) else files:
        path, required = (entry.get("path"), entry.get("required", True)) if isinstance(entry, Mapping) else (entry, True)
        file = base_dir / str(path)
        try:
            lines = file.read_text(encoding="utf-8").splitlines()
        except OSError as e:
            if not required:
                continue
            raise ComposeError("%s: env_file %s: %s" % (where, file, e.strerror)) from None
        for line in lines:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, sep, value = line.partition("=")
            key = key.strip().removeprefix("export ").strip()
            if not sep:
                if key in env:
                    out[key] = env[key]
                continue
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            out[key] = value
    given = svc.get("environment")
    if isinstance(given, Mapping):
        items: Sequence[Tuple[str, Any]] = list(given.items())
    elif isinstance(given, list):
        items = []
        for entry in given:
            key, sep, value = str(entry).partition("=")
            items.append((key, value if sep else None))
    elif given is None:
        items = []
    else:
        raise ComposeError("%s: environment: a mapping or a list of KEY=VALUE" % where)
    for key, value in items:
        if value is None:
            # `KEY` alone, or `KEY:` with no value: the host's value, if it has one.
            if str(key) in env:
                out[str(key)] = env[str(key)]
            continue
        out[str(key)] = _scalar(value)
    return out


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _user(user: Any, where: str) -> str:
    text = str(user)
    if re.fullmatch(r"\d+:\d+", text):
        return text
    raise ComposeError(
        "%s: user: %r: runner needs numeric ids, uid:gid (e.g. \"1000:1000\"); a name or a lone uid would be resolved in the image, whose files runner does not trust"
        % (where, text)
    )


def _network(svc: Mapping[str, Any], overrides: Mapping[str, Any], where: str) -> None:
    mode = svc.get("network_mode")
    if "network" in overrides:
        if mode not in (None, "none"):
            raise ComposeError("%s: network_mode: %r and x-runner.spec.network: say one of them" % (where, mode))
        return
    if mode == "none":
        return
    if mode is None:
        raise ComposeError(
            "%s: no network_mode: Docker would put the service on a network with internet access and "
            "service-name DNS, which a runner sandbox does not get. Write network_mode: none (no network), "
            "or x-runner: {spec: {network: bridge, egress: {allow: [pypi.org:443, ...]}}} for named destinations"
            % where
        )
    raise ComposeError(
        "%s: network_mode: %r is not supported: use none, or x-runner.spec.network: bridge with its egress" % (where, mode)
    )


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "t": 1 << 40, "tb": 1 << 40}


def _bytes(value: Any, where: str, what: str) -> int:
    """Compose's byte values: 512m, 1g, 2gb, 1024 (bytes); Kubernetes' 512Mi is accepted too."""
    if isinstance(value, bool):
        raise ComposeError("%s: %s: %r is not a size" % (where, what, value))
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    unit = m.group(2).lower() if m else ""
    if unit.endswith("i") and unit[:-1] in ("k", "m", "g", "t"):
        unit = unit[:-1]
    if not m or unit not in _UNITS:
        raise ComposeError("%s: %s: %r is not a size (e.g. 512m, 2g)" % (where, what, value))
    return int(float(m.group(1)) * _UNITS[unit])


def _resources(svc: Mapping[str, Any], where: str) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    deploy = svc.get("deploy") or {}
    if not isinstance(deploy, Mapping) or not set(deploy) <= {"resources"}:
        raise ComposeError("%s: deploy: only deploy.resources is supported" % where)
    res = deploy.get("resources") or {}
    limits = res.get("limits") or {}
    reservations = res.get("reservations") or {}
    if not set(res) <= {"limits", "reservations"} or not set(limits) <= {"memory", "cpus", "pids"}:
        raise ComposeError("%s: deploy.resources: limits of memory, cpus and pids only" % where)
    if reservations.get("devices"):
        raise ComposeError("%s: deploy.resources.reservations.devices: runner gives sandboxes no devices (GPUs)" % where)
    memory = svc.get("mem_limit", limits.get("memory"))
    if memory is not None:
        out["memory"] = _bytes(memory, where, "mem_limit")
    cpus = svc.get("cpus", limits.get("cpus"))
    if cpus is not None:
        try:
            value = float(cpus)
        except (TypeError, ValueError):
            raise ComposeError("%s: cpus: %r is not a number of CPUs" % (where, cpus)) from None
        if value <= 0:
            raise ComposeError("%s: cpus: must be above 0" % where)
        out["cpu"] = "%g" % value
    pids = svc.get("pids_limit", limits.get("pids"))
    if pids is not None:
        if isinstance(pids, bool) or not isinstance(pids, int) or pids <= 0:
            raise ComposeError("%s: pids_limit: %r: runner needs a positive limit (it never runs a sandbox without one)" % (where, pids))
        out["pids"] = pids
    return out


def _platform(value: str, where: str) -> None:
    machine = platform.machine().lower()
    arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(machine, machine)
    wanted = value.split("/")
    if wanted[0] != "linux" or (len(wanted) > 1 and wanted[1] != arch):
        raise ComposeError("%s: platform: %s: this node runs linux/%s" % (where, value, arch))


def _argv(value: Any, where: str, what: str) -> List[str]:
    if isinstance(value, str):
        return shlex.split(value)
    if isinstance(value, list) and all(isinstance(a, (str, int, float)) for a in value):
        return [str(a) for a in value]
    raise ComposeError("%s: %s: a string or a list of strings" % (where, what))


def _main(svc: Mapping[str, Any], where: str) -> Optional[List[str]]:
    entrypoint = _argv(svc["entrypoint"], where, "entrypoint") if svc.get("entrypoint") is not None else []
    command = _argv(svc["command"], where, "command") if svc.get("command") is not None else []
    argv = entrypoint + command
    if not argv or (not entrypoint and _KEEPALIVE.match(" ".join(command))):
        return None
    return argv


def _mounts(volumes: Any, base_dir: Path, where: str) -> List[Dict[str, Any]]:
    out: List[Dict[str, Any]] = []
    for v in volumes or []:
        if isinstance(v, Mapping):
            if v.get("type", "bind") != "bind":
                raise ComposeError("%s: volumes: type %r is not supported: bind a host directory" % (where, v.get("type")))
            source, target, read_only = v.get("source"), v.get("target"), bool(v.get("read_only", False))
        else:
            parts = str(v).split(":")
            if len(parts) == 1:
                raise ComposeError("%s: volumes: %r is an anonymous volume: bind a host directory (SOURCE:TARGET)" % (where, v))
            source, target = parts[0], parts[1]
            options = parts[2].split(",") if len(parts) > 2 else []
            read_only = "ro" in options
        if not isinstance(source, str) or not source or not isinstance(target, str) or not target.startswith("/"):
            raise ComposeError("%s: volumes: %r: a host path and an absolute target" % (where, v))
        if not source.startswith((".", "/", "~")):
            raise ComposeError("%s: volumes: %r names a volume: runner has no named volumes, bind a host directory" % (where, source))
        host = (base_dir / os.path.expanduser(source)).resolve()
        out.append({"source": str(host), "target": target, "readOnly": read_only})
    return out


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)")


def _seconds(value: Any, where: str, what: str) -> float:
    """Compose durations: 1m30s, 10s, 500ms, or a number of seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    text = str(value).strip()
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ComposeError("%s: %s: %r is not a duration (e.g. 10s, 1m30s)" % (where, what, value))
    scale = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 0.000001}
    return sum(float(n) * scale[u] for n, u in parts)


def _healthcheck(hc: Any, where: str) -> Optional[Healthcheck]:
    if hc is None:
        return None
    if not isinstance(hc, Mapping):
        raise ComposeError("%s: healthcheck: a mapping" % where)
    if hc.get("disable"):
        return None
    test = hc.get("test")
    if isinstance(test, str):
        argv = ["/bin/sh", "-c", test]
    elif isinstance(test, list) and test and test[0] == "CMD":
        argv = [str(a) for a in test[1:]]
    elif isinstance(test, list) and test and test[0] == "CMD-SHELL":
        argv = ["/bin/sh", "-c", " ".join(str(a) for a in test[1:])]
    elif isinstance(test, list) and test == ["NONE"]:
        return None
    else:
        raise ComposeError("%s: healthcheck.test: a string, [CMD, ...] or [CMD-SHELL, ...]" % where)
    if not argv:
        raise ComposeError("%s: healthcheck.test: empty" % where)
    out = Healthcheck(test=argv)
    for key in ("interval", "timeout", "start_period", "start_interval"):
        if hc.get(key) is not None:
            setattr(out, key, _seconds(hc[key], where, "healthcheck." + key))
    if hc.get("retries") is not None:
        retries = hc["retries"]
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 1:
            raise ComposeError("%s: healthcheck.retries: a positive number" % where)
        out.retries = retries
    return out


def _merge(base: Dict[str, Any], over: Mapping[str, Any]) -> Dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def _start_order(services: List[Service], raw: Mapping[str, Any], source: str) -> List[Service]:
    """Services in an order where each comes after what it depends_on."""
    by_name = {s.name: s for s in services}
    deps: Dict[str, List[str]] = {}
    for s in services:
        d = raw[s.name].get("depends_on") or []
        names = list(d.keys()) if isinstance(d, Mapping) else [str(x) for x in d]
        for n in names:
            if n not in by_name:
                raise ComposeError("%s: service %r depends_on %r, which is not a service" % (source, s.name, n))
        deps[s.name] = names
    ordered: List[Service] = []
    state: Dict[str, int] = {}

    def visit(name: str, path: List[str]) -> None:
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            raise ComposeError("%s: depends_on makes a cycle: %s" % (source, " -> ".join(path + [name])))
        state[name] = 1
        for d in deps[name]:
            visit(d, path + [name])
        state[name] = 2
        ordered.append(by_name[name])

    for s in services:
        visit(s.name, [])
    return ordered
