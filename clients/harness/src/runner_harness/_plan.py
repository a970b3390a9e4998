"""What sandboxes a harness config asks for, whatever its form: a compose file, a runner
manifest (`environment.yaml`: Environment documents, WarmPool documents for warm pools), or
specs given in code. Pure apart from reading the named file."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from runner_client import load_documents

from . import compose
from .compose import ComposeError, Service

IMAGE_ENV = "RUNNER_SANDBOX_IMAGE"
"""The image of a sandbox no config describes (Inspect's `sandbox="runner"` with no file)."""

MANIFEST_FILES = ["environment.yaml", "environment.yml"]


class ConfigError(ValueError):
    """A sandbox configuration runner cannot run as written."""


@dataclass
class Plan:
    """The sandboxes of one sample, in start order, and the default's name."""

    services: List[Service]
    default: str
    source: str = "config"
    env: Dict[str, str] = field(default_factory=dict)

    def ordered_for_inspect(self, started: Mapping[str, Any]) -> Dict[str, Any]:
        """`started` (by service name) with the default first, as Inspect requires."""
        out = {self.default: started[self.default]}
        out.update((k, v) for k, v in started.items() if k != self.default)
        return out


def default_plan() -> Plan:
    image = os.environ.get(IMAGE_ENV)
    if not image:
        raise ConfigError(
            "sandbox 'runner' has no configuration: put a compose.yaml or environment.yaml (a runner "
            "Environment) next to the task, pass one (sandbox=(\"runner\", \"compose.yaml\")), or set "
            "%s to the image of a default sandbox" % IMAGE_ENV
        )
    return Plan([Service(name="default", spec={"image": image})], "default", source=IMAGE_ENV)


def load_file(path: str, env: Optional[Mapping[str, str]] = None) -> Plan:
    """A compose file or a runner manifest, by its content: runner manifests have `kind:`."""
    name = Path(path).name
    if name == "Dockerfile" or name.endswith(".Dockerfile") or name.startswith("Dockerfile."):
        raise ConfigError(
            "%s: runner does not build images: build it elsewhere, `runner image import` it, and name it "
            "in a compose.yaml (image:) or an environment.yaml" % path
        )
    if not os.path.isfile(path):
        raise ConfigError("%s: no such file" % path)
    try:
        with open(path, encoding="utf-8") as f:
            head = f.read()
    except OSError as e:
        raise ConfigError("%s: %s" % (path, e.strerror)) from None
    if _is_manifest(head):
        return load_manifest(path)
    try:
        project = compose.load(path, env)
    except ComposeError as e:
        raise ConfigError(str(e)) from None
    return Plan(project.services, project.default, source=path)


def _is_manifest(text: str) -> bool:
    return any(line.startswith(("kind:", "apiVersion:")) for line in text.splitlines())


def from_compose_dict(raw: Mapping[str, Any], base_dir: str, env: Optional[Mapping[str, str]] = None) -> Plan:
    try:
        project = compose.services(raw, Path(base_dir), dict(os.environ if env is None else env))
    except ComposeError as e:
        raise ConfigError(str(e)) from None
    return Plan(project.services, project.default, source="compose config")


def load_manifest(path: str) -> Plan:
    """A runner manifest: each `kind: Environment` is a sandbox named by metadata.name (the
    one named `default`, else the first, is the default); a `kind: WarmPool` naming one of them
    gives it a warm pool of `spec.size` members for the task. Other kinds are refused."""
    try:
        docs = load_documents(path)
    except (OSError, ValueError) as e:
        raise ConfigError("%s: %s" % (path, e)) from None
    services: List[Service] = []
    pools: Dict[str, int] = {}
    base = Path(path).resolve().parent
    for i, doc in enumerate(docs):
        where = "%s: document %d" % (path, i + 1)
        if not isinstance(doc, Mapping):
            raise ConfigError("%s: not a mapping" % where)
        kind = doc.get("kind")
        meta = doc.get("metadata") if isinstance(doc.get("metadata"), Mapping) else {}
        name = meta.get("name") if isinstance(meta, Mapping) else None
        if kind == "Environment":
            if not isinstance(name, str) or not name:
                raise ConfigError("%s: an Environment needs metadata.name (the sandbox's name)" % where)
            spec = doc.get("spec")
            if not isinstance(spec, Mapping):
                raise ConfigError("%s: Environment %r has no spec" % (where, name))
            services.append(Service(name=name, spec=_absolute_mounts(dict(spec), base)))
        elif kind == "WarmPool":
            pool_spec = doc.get("spec")
            if not isinstance(pool_spec, Mapping):
                pool_spec = {}
            env_name, size = pool_spec.get("environment"), pool_spec.get("size")
            if not isinstance(env_name, str) or isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise ConfigError("%s: a WarmPool needs spec.environment (a name) and spec.size" % where)
            pools[env_name] = size
        else:
            raise ConfigError(
                "%s: kind %r: a sandbox manifest holds Environment documents (one per sandbox) and "
                "WarmPool documents (a pool for one of them)" % (where, kind)
            )
    if not services:
        raise ConfigError("%s: no Environment document" % path)
    names = [s.name for s in services]
    if len(set(names)) != len(names):
        raise ConfigError("%s: two Environments have the same name" % path)
    for env_name, size in pools.items():
        if env_name not in names:
            raise ConfigError("%s: WarmPool for %r, which is not an Environment of the file" % (path, env_name))
        next(s for s in services if s.name == env_name).pool = size
    default = "default" if "default" in names else names[0]
    return Plan(services, default, source=path)


def _absolute_mounts(spec: Dict[str, Any], base: Path) -> Dict[str, Any]:
    """Relative mount sources of a manifest resolve against its own directory (the server
    would resolve them against its own working directory)."""
    mounts = spec.get("mounts")
    if isinstance(mounts, list):
        spec["mounts"] = [
            dict(m, source=str((base / m["source"]).resolve()))
            if isinstance(m, Mapping) and isinstance(m.get("source"), str) and not m["source"].startswith("/")
            else m
            for m in mounts
        ]
    return spec


def from_specs(environments: Mapping[str, Mapping[str, Any]], default: Optional[str], pool: int) -> Plan:
    if not environments:
        raise ConfigError("a runner sandbox config needs at least one environment")
    names = list(environments)
    chosen = default or ("default" if "default" in names else names[0])
    if chosen not in names:
        raise ConfigError("default %r is not one of the environments (%s)" % (chosen, ", ".join(names)))
    return Plan(
        [Service(name=n, spec=dict(s), pool=pool) for n, s in environments.items()],
        chosen,
        source="config",
    )
