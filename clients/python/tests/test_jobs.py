"""Jobs through the sync client, on both servers (TCP and unix socket); host backend."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest

from runner_client import Client, Conflict, Job, NotFound, RunnerError, WaitTimeout


def manifest(name: str, script: str, labels: str = "{suite: pyclient}") -> str:
    """An Environment on the host backend and one Job running `script` under sh."""
    return """\
apiVersion: runner/v1alpha1
kind: Environment
metadata: {name: %(name)s-env}
spec:
  backend: host
  env: {GREETING: hello}
---
apiVersion: runner/v1alpha1
kind: Job
metadata: {name: %(name)s, labels: %(labels)s}
spec:
  environment: %(name)s-env
  command: ["sh", "-c", %(script)s]
  timeoutSeconds: 60
""" % {"name": name, "labels": labels, "script": json.dumps(script)}


def documents(name: str, script: str, labels: Dict[str, str]) -> List[Dict[str, Any]]:
    return [
        {
            "apiVersion": "runner/v1alpha1",
            "kind": "Environment",
            "metadata": {"name": name + "-env"},
            "spec": {"backend": "host"},
        },
        {
            "apiVersion": "runner/v1alpha1",
            "kind": "Job",
            "metadata": {"name": name, "labels": labels},
            "spec": {"environment": name + "-env", "command": ["sh", "-c", script]},
        },
    ]


def test_apply_get_wait_logs_delete(client: Client, unique: str) -> None:
    created = client.jobs.apply(manifest(unique, 'echo "$GREETING from the job"; echo to-stderr >&2'))
    assert created == [unique]
    job = client.jobs.get(unique)
    assert isinstance(job, Job) and job.name == unique
    assert job.phase in ("Pending", "Running", "Succeeded")
    assert job.labels == {"suite": "pyclient"}
    done = client.jobs.wait(unique, timeout=60)
    assert done.phase == "Succeeded" and done.succeeded and done.finished
    assert done.reason == "Completed"
    assert done.result is not None
    assert (done.result.exit_code, done.result.stdout, done.result.stderr) == (
        0,
        "hello from the job\n",
        "to-stderr\n",
    )
    assert done.raw["kind"] == "Job" and done.status["phase"] == "Succeeded"
    assert client.jobs.logs(unique) == "hello from the job\n"
    assert unique in [j.name for j in client.jobs.list()]
    client.jobs.delete(unique)
    with pytest.raises(NotFound):
        client.jobs.get(unique)
    with pytest.raises(NotFound):
        client.jobs.logs(unique)
    with pytest.raises(NotFound):
        client.jobs.delete(unique)


def test_failing_job(client: Client, unique: str) -> None:
    client.jobs.apply(manifest(unique, "echo partial; exit 3"))
    try:
        done = client.jobs.wait(unique, timeout=60)
        assert done.phase == "Failed" and not done.succeeded and done.finished
        assert done.result is not None and done.result.exit_code == 3
        assert client.jobs.logs(unique) == "partial\n"
    finally:
        client.jobs.delete(unique)


def test_reapply_running_job_conflicts(client: Client, unique: str) -> None:
    text = manifest(unique, "sleep 30")
    client.jobs.apply(text)
    try:
        with pytest.raises(Conflict) as info:
            client.jobs.apply(text)
        assert info.value.status == 409 and unique in info.value.message
        with pytest.raises(WaitTimeout) as waited:
            client.jobs.wait(unique, timeout=0.5)
        assert isinstance(waited.value, TimeoutError)
        assert waited.value.job is not None and waited.value.job.phase in ("Pending", "Running")
    finally:
        start = time.monotonic()
        client.jobs.delete(unique)  # stops it
        assert time.monotonic() - start < 30
    with pytest.raises(NotFound):
        client.jobs.get(unique)


def test_reapply_finished_job_conflicts_unless_replaced(client: Client, unique: str) -> None:
    client.jobs.apply(manifest(unique, "echo one"))
    try:
        assert client.jobs.wait(unique, timeout=60).succeeded
        with pytest.raises(Conflict) as info:
            client.jobs.apply(manifest(unique, "echo two"))
        assert info.value.status == 409 and "already exists" in info.value.message
        assert client.jobs.logs(unique) == "one\n"
        client.jobs.apply(manifest(unique, "echo two"), replace=True)
        assert client.jobs.wait(unique, timeout=60).succeeded
        assert client.jobs.logs(unique) == "two\n"
    finally:
        client.jobs.delete(unique)


def test_apply_documents_file_and_labels(client: Client, unique: str, tmp_path: Path) -> None:
    first, second = unique + "-a", unique + "-b"
    assert client.jobs.apply(documents(first, "echo docs", {"batch": unique})) == [first]
    path = tmp_path / "job.yaml"
    path.write_text(manifest(second, "echo file", labels="{batch: %s, kind: file}" % unique))
    assert client.jobs.apply_file(path) == [second]
    try:
        assert client.jobs.wait(first, timeout=60).succeeded
        assert client.jobs.wait(second, timeout=60).succeeded
        assert sorted(j.name for j in client.jobs.list({"batch": unique})) == [first, second]
        assert [j.name for j in client.jobs.list("batch=%s,kind=file" % unique)] == [second]
        assert client.jobs.list({"batch": unique + "-none"}) == []
        assert client.jobs.logs(first) == "docs\n"
    finally:
        client.jobs.delete(first)
        client.jobs.delete(second)


def test_bad_manifest(client: Client, unique: str) -> None:
    with pytest.raises(RunnerError) as info:
        client.jobs.apply("apiVersion: runner/v1alpha1\nkind: Job\nmetadata: {name: %s}\nspec: {}\n" % unique)
    assert info.value.status in (400, 422)
    assert info.value.message
    with pytest.raises(NotFound):
        client.jobs.get(unique)


def test_missing_job(client: Client) -> None:
    with pytest.raises(NotFound) as info:
        client.jobs.get("no-such-job")
    assert info.value.status == 404 and "no-such-job" in info.value.message
