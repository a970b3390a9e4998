"""Reading manifests on the client side: picking an Environment document out of a manifest
file (to start a session in it), and turning documents into text the server accepts.

JSON manifests need nothing. YAML manifests need PyYAML (`pip install 'runner-client[yaml]'`),
read with YAML 1.2 core-schema rules like the server's parser: `yes`/`on` stay strings, `010`
is ten, `1000:1000` and dates stay strings (PyYAML's default YAML 1.1 rules would turn them
into booleans, octals, base-60 integers and dates).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

__all__ = ["load_documents", "parse_documents", "environment_from_manifest", "dump_documents"]

PathLike = Union[str, "os.PathLike[str]"]

_SEPARATOR = re.compile(r"^---[ \t]*(?:#.*)?$", re.MULTILINE)


def load_documents(path: PathLike) -> List[Dict[str, Any]]:
    """The documents of a manifest file (YAML or JSON)."""
    with open(path, "r", encoding="utf-8") as f:
        text = f.read()
    return parse_documents(text, source=os.fspath(path))


def parse_documents(text: str, source: str = "<manifest>") -> List[Dict[str, Any]]:
    """The documents of a manifest's text: YAML (`---`-separated) or JSON (one object, or an
    array of them). Empty documents are dropped; anything else that is not a mapping is an
    error."""
    docs = _parse_json(text)
    if docs is None:
        docs = _parse_yaml(text, source)
    out: List[Dict[str, Any]] = []
    for i, doc in enumerate(docs):
        if doc is None:
            continue
        if not isinstance(doc, dict):
            raise ValueError("%s: document %d is not a mapping" % (source, i + 1))
        out.append(doc)
    return out


def environment_from_manifest(path: PathLike, name: Optional[str] = None) -> Dict[str, Any]:
    """The whole Environment document of a manifest file: the one named `name`, or its only
    one."""
    docs = load_documents(path)
    envs = [d for d in docs if d.get("kind") == "Environment"]
    names = [_name(d) for d in envs]
    source = os.fspath(path)
    if name is not None:
        for doc, n in zip(envs, names):
            if n == name:
                return doc
        raise ValueError(
            "%s: no Environment named %r (it has: %s)" % (source, name, ", ".join(map(repr, names)) or "none")
        )
    if len(envs) == 1:
        return envs[0]
    if not envs:
        raise ValueError("%s: no Environment document" % source)
    raise ValueError(
        "%s: %d Environments (%s): say which with environment_name="
        % (source, len(envs), ", ".join(map(repr, names)))
    )


def dump_documents(docs: Sequence[Mapping[str, Any]]) -> str:
    """Documents as one manifest text: each as JSON (which is YAML), separated by `---`."""
    return "\n---\n".join(json.dumps(dict(d)) for d in docs) + "\n"


def _name(doc: Mapping[str, Any]) -> Optional[str]:
    meta = doc.get("metadata")
    name = meta.get("name") if isinstance(meta, dict) else None
    return name if isinstance(name, str) else None


def _parse_json(text: str) -> Optional[List[Any]]:
    """JSON documents, or None when the text is not JSON (so YAML is tried). Also takes
    `---`-separated JSON documents, which are YAML every parser agrees on."""
    parts = [p for p in _SEPARATOR.split(text) if p.strip()]
    if not parts:
        return []
    docs: List[Any] = []
    for part in parts:
        try:
            value = json.loads(part)
        except ValueError:
            return None
        if isinstance(value, list) and len(parts) == 1:
            return value
        docs.append(value)
    return docs


def _parse_yaml(text: str, source: str) -> List[Any]:
    try:
        import yaml  # noqa: F401  (an optional dependency: the `yaml` extra)
    except ImportError:
        raise ValueError(
            "%s is YAML, and reading YAML needs PyYAML: pip install 'runner-client[yaml]' "
            "(or give the manifest as JSON)" % source
        ) from None
    try:
        return list(yaml.load_all(text, Loader=_loader()))
    except yaml.YAMLError as e:
        raise ValueError("%s: %s" % (source, e)) from None


_LOADER: Any = None


def _loader() -> Any:
    """A safe loader with YAML 1.2 core-schema scalars (built once, on first use)."""
    global _LOADER
    if _LOADER is not None:
        return _LOADER
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    # Only the core schema's implicit types; everything else is a string.
    Loader.yaml_implicit_resolvers = {}
    resolvers = [
        ("tag:yaml.org,2002:null", r"^(?:~|null|Null|NULL|)$", ["~", "n", "N", ""]),
        ("tag:yaml.org,2002:bool", r"^(?:true|True|TRUE|false|False|FALSE)$", list("tTfF")),
        ("tag:yaml.org,2002:int", r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$", list("-+0123456789")),
        (
            "tag:yaml.org,2002:float",
            r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
            r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$",
            list("-+0123456789."),
        ),
    ]
    for tag, pattern, first in resolvers:
        Loader.add_implicit_resolver(tag, re.compile(pattern), first)

    def construct_int(loader: Any, node: Any) -> int:
        value = loader.construct_scalar(node)
        if value.startswith("0o"):
            return int(value[2:], 8)
        if value.startswith("0x"):
            return int(value[2:], 16)
        return int(value, 10)

    def construct_float(loader: Any, node: Any) -> float:
        value = loader.construct_scalar(node).lower()
        if value.endswith(".inf"):
            return float("-inf") if value.startswith("-") else float("inf")
        if value == ".nan":
            return float("nan")
        return float(value)

    Loader.add_constructor("tag:yaml.org,2002:int", construct_int)
    Loader.add_constructor("tag:yaml.org,2002:float", construct_float)
    _LOADER = Loader
    return Loader
