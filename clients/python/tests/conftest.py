"""Fixtures: the servers `run-tests.sh` started (TCP and unix socket), clients of both
flavours. Nothing here skips: a test that cannot run fails."""

from __future__ import annotations

import os
import uuid
from typing import Any, Dict, Iterator

import pytest

from runner_client import Client

HOST_ENV: Dict[str, Any] = {"backend": "host"}


def _required(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        pytest.fail(
            "%s is not set: run these tests with clients/python/run-tests.sh RUNNER_BIN" % name,
            pytrace=False,
        )
    return value


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Iterator[None]:
    """A skipped test is a failed one: every test here must run."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = "skipped, which this suite does not allow: %s" % (report.longrepr,)


@pytest.fixture(scope="session")
def token() -> str:
    return _required("RUNNER_TEST_TOKEN")


@pytest.fixture(scope="session")
def tcp_url() -> str:
    return _required("RUNNER_TEST_URL")


@pytest.fixture(scope="session")
def socket_path() -> str:
    path = _required("RUNNER_TEST_SOCKET")
    if not os.path.exists(path):
        pytest.fail("RUNNER_TEST_SOCKET=%s does not exist" % path, pytrace=False)
    return path


@pytest.fixture(scope="session")
def scratch() -> str:
    """A directory the servers can read too (the test run's temporary directory)."""
    return _required("RUNNER_TEST_SCRATCH")


@pytest.fixture(params=["tcp", "unix"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def address(transport: str, tcp_url: str, socket_path: str) -> Dict[str, str]:
    """Client arguments for the server of `transport`."""
    return {"url": tcp_url} if transport == "tcp" else {"socket": socket_path}


@pytest.fixture
def client(address: Dict[str, str], token: str) -> Iterator[Client]:
    with Client(token=token, **address) as c:
        yield c


@pytest.fixture
def async_client_args(address: Dict[str, str], token: str) -> Dict[str, str]:
    """`AsyncClient(**args)` inside a test's own event loop (each test runs `asyncio.run`)."""
    return dict(address, token=token)


@pytest.fixture
def unique() -> str:
    """A name no other test uses (Jobs share the server's store)."""
    return "t-" + uuid.uuid4().hex[:10]
