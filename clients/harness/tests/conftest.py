"""Fixtures for the runner-harness tests. The server tests run against the `runner serve`
that tests/harness/run.sh started (RUNNER_URL, RUNNER_TOKEN_FILE) on a containerd with the
busybox and Python test images; nothing here skips: a test that cannot run fails."""

from __future__ import annotations

import os
from typing import Any, Iterator

import pytest

from runner_harness import Server, server_from_env


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Iterator[None]:
    """A skipped test is a failed one."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = "skipped, which this suite does not allow: %s" % (report.longrepr,)


@pytest.fixture(scope="session")
def server() -> Server:
    if not os.environ.get("RUNNER_URL") or not os.environ.get("RUNNER_TOKEN_FILE"):
        pytest.fail("RUNNER_URL and RUNNER_TOKEN_FILE are not set: run tests/harness/run.sh RUNNER_BIN", pytrace=False)
    return server_from_env()
