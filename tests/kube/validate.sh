#!/usr/bin/env bash
# Validates Kubernetes YAML offline against the Kubernetes OpenAPI schemas (as JSON schemas,
# shipped inside the PyPI package kubernetes-validate), in strict mode (unknown fields are
# errors), for two pinned Kubernetes versions.
#
# Usage: tests/kube/validate.sh FILE...
#   Each FILE may hold several YAML documents (---); `kind: List` documents are expanded.
#   Prints one line per FILE and Kubernetes version: "ok ..." on stdout, "FAIL ..." on stderr
#   followed by one line per invalid object. Exit 0 when all pass, 1 when an object is
#   invalid, 2 when the tool cannot run (no venv, install failed, unreadable file, bad YAML).
#
# The package lives in a venv under ${RUNNER_CACHE:-/var/cache/runner}/kube-validate-venv,
# created (needs PyPI) on first use and reused afterwards with no network access.
#
# Environment:
#   KUBE_VALIDATE_VERSIONS       Kubernetes versions to check (default: "1.33 1.37")
#   KUBE_VALIDATE_ALLOW_UNKNOWN  objects the package has no schema for (custom resources) fail
#                                by default; list "apiVersion/Kind" entries (space or comma
#                                separated, e.g. "agents.x-k8s.io/v1alpha1/Sandbox") or "*" to
#                                skip them with a notice instead
#   KUBE_VALIDATE_PYTHON         interpreter used to create the venv (default: python3)
set -euo pipefail

die() { echo "kube-validate: $*" >&2; exit 2; }

# Pinned: the package and everything it pulls in. Bumping any line rebuilds the cached venv.
REQUIREMENTS=(
  kubernetes-validate==1.37.0
  attrs==26.1.0
  importlib_resources==7.1.0
  jsonschema==4.26.0
  jsonschema-specifications==2025.9.1
  packaging==26.3
  PyYAML==6.0.3
  referencing==0.37.0
  rpds-py==2026.9.1
  typing_extensions==4.16.0
)
read -r -a KUBE_VERSIONS <<<"${KUBE_VALIDATE_VERSIONS:-1.33 1.37}"

[[ $# -gt 0 ]] || { echo "usage: $0 FILE..." >&2; exit 2; }
[[ ${#KUBE_VERSIONS[@]} -gt 0 ]] || die "KUBE_VALIDATE_VERSIONS is empty"
for f in "$@"; do
  [[ -f $f && -r $f ]] || die "cannot read file: $f"
done

cache="${RUNNER_CACHE:-/var/cache/runner}"
venv="$cache/kube-validate-venv"
stamp="$venv/.requirements"
want=$(printf '%s\n' "${REQUIREMENTS[@]}")

mkdir -p "$cache" 2>/dev/null || die "cannot create cache dir $cache (set RUNNER_CACHE to a writable dir)"
# One installer at a time; concurrent runs wait for the first to finish.
exec 9>"$venv.lock" || die "cannot write lock file $venv.lock (set RUNNER_CACHE to a writable dir)"
flock -w 900 9 || die "timed out waiting for another run to finish installing into $venv"

venv_ok() {
  [[ -x $venv/bin/python && -f $stamp && "$(cat "$stamp")" == "$want" ]] &&
    "$venv/bin/python" -I -c 'import kubernetes_validate.utils' >/dev/null 2>&1
}

if ! venv_ok; then
  python=${KUBE_VALIDATE_PYTHON:-python3}
  command -v "$python" >/dev/null || die "$python not found"
  "$python" -m venv --help >/dev/null 2>&1 || die "$python has no venv module (apt-get install python3-venv)"
  echo "kube-validate: installing ${REQUIREMENTS[0]} into $venv" >&2
  rm -rf "$venv"
  "$python" -m venv "$venv" >&2 || die "could not create venv $venv (apt-get install python3-venv?)"
  "$venv/bin/python" -m pip install --quiet --no-input --disable-pip-version-check \
    --only-binary=:all: "${REQUIREMENTS[@]}" >&2 ||
    { rm -rf "$venv"; die "pip install of ${REQUIREMENTS[*]} failed"; }
  printf '%s\n' "$want" >"$stamp"
  venv_ok || die "venv $venv is unusable after install"
fi
exec 9>&-

# Uses the package's Python API rather than its CLI: the CLI only warns (exit 0) on objects it
# has no schema for, prints failures on stdout, and crashes on documents without metadata.name.
read -r -d '' DRIVER <<'PY' || true
import os
import sys
import traceback


def crash(kind, value, tb):  # a crash of the tool means "cannot run" (2), never "invalid" (1)
    traceback.print_exception(kind, value, tb)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(2)


sys.excepthook = crash

import yaml
import kubernetes_validate
from kubernetes_validate import utils

versions = sys.argv[1].split()
allow = set(sys.argv[2].replace(",", " ").split())
files = sys.argv[3:]

shipped = sorted({utils.major_minor(v) for v in utils.all_versions()},
                 key=lambda v: tuple(int(p) for p in v.split(".")))
for v in versions:
    if utils.major_minor(v.lstrip("v")) not in shipped:
        print("kube-validate: kubernetes-validate %s has no schemas for Kubernetes %s (it has %s)"
              % (utils.__version__, v, " ".join(shipped)), file=sys.stderr)
        sys.exit(2)

# Same YAML handling as the package's CLI (values starting with '=').
yaml.SafeLoader.add_constructor("tag:yaml.org,2002:value", utils.construct_value)


def objects(path):
    with open(path) as f:
        docs = list(yaml.load_all(f, Loader=yaml.SafeLoader))
    for n, doc in enumerate(docs, 1):
        if doc is None:
            continue
        if isinstance(doc, dict) and doc.get("kind") == "List" and isinstance(doc.get("items"), list):
            for i, item in enumerate(doc["items"]):
                yield "doc %d item %d" % (n, i), item
        else:
            yield "doc %d" % n, doc


def describe(obj):
    meta = obj.get("metadata")
    name = meta.get("name") if isinstance(meta, dict) else None
    return "%s %s/%s" % (obj.get("apiVersion"), obj.get("kind"), name or "<no name>")


def main():
    parsed = []
    for path in files:  # parse everything first: unreadable YAML means the run cannot happen
        try:
            objs = list(objects(path))
        except (OSError, yaml.YAMLError) as e:
            print("kube-validate: cannot parse %s: %s" % (path, e), file=sys.stderr)
            return 2
        if not objs:
            print("kube-validate: %s holds no objects" % path, file=sys.stderr)
            return 2
        parsed.append((path, objs))
    invalid = 0
    for path, objs in parsed:
        for version in versions:
            errors, skipped = [], []
            for where, obj in objs:
                if not isinstance(obj, dict):
                    errors.append("%s: not a mapping" % where)
                    continue
                if not isinstance(obj.get("apiVersion"), str) or not isinstance(obj.get("kind"), str):
                    errors.append("%s: apiVersion and kind must be strings" % where)
                    continue
                what = "%s %s" % (where, describe(obj))
                try:
                    got = kubernetes_validate.validate(obj, version, strict=True)
                    if got != utils.major_minor(version.lstrip("v")):
                        errors.append("%s: validated against %s, not %s" % (what, got, version))
                except kubernetes_validate.ValidationError as e:
                    field = ".".join(str(p) for p in e.path) or "<root>"
                    errors.append("%s: %s: %s" % (what, field, e.message))
                except utils.SchemaNotFoundError:
                    key = "%s/%s" % (obj["apiVersion"], obj["kind"])
                    if "*" in allow or key in allow:
                        skipped.append(key)
                    else:
                        errors.append("%s: no schema for %s in Kubernetes %s (custom resource? "
                                      "list it in KUBE_VALIDATE_ALLOW_UNKNOWN to skip it)"
                                      % (what, key, version))
                except Exception as e:  # the tool itself failed: say so, never pass
                    errors.append("%s: validator error: %s: %s" % (what, type(e).__name__, e))
            note = " (%d skipped, no schema: %s)" % (len(skipped), ", ".join(sorted(set(skipped)))) if skipped else ""
            if errors:
                invalid += len(errors)
                print("FAIL k8s-%s %s: %d of %d objects invalid%s" % (version, path, len(errors), len(objs), note),
                      file=sys.stderr)
                for err in errors:
                    print("  %s" % err, file=sys.stderr)
            else:
                print("ok   k8s-%s %s: %d objects%s" % (version, path, len(objs), note), flush=True)
                if skipped:
                    print("kube-validate: NOT validated in %s: %s" % (path, ", ".join(sorted(set(skipped)))),
                          file=sys.stderr)
    if invalid:
        print("kube-validate: %d invalid object(s)" % invalid, file=sys.stderr)
        return 1
    return 0


sys.exit(main())
PY

"$venv/bin/python" -I -c "$DRIVER" "${KUBE_VERSIONS[*]}" "${KUBE_VALIDATE_ALLOW_UNKNOWN:-}" "$@"
