"""Warm pools through the client: request shapes here, and what the servers of run-tests.sh
(host backend, no containerd) answer. Making and claiming real pools needs containerd: the
harness suite (tests/harness/run.sh) does that through Inspect's task_init."""

from __future__ import annotations

import asyncio
import json
from typing import Dict

import pytest

from runner_client import AsyncClient, BadRequest, Client, NotFound, Pool, Unavailable
from runner_client import _core


def test_pool_request_body() -> None:
    op = _core.create_pool("eval-1", {"image": "local/python:3.11"}, 3, True, False)
    assert op.request.method == "POST" and op.request.path == "/v1/pools"
    assert json.loads(op.request.body or b"") == {
        "name": "eval-1",
        "environment": {"image": "local/python:3.11"},
        "workspace": True,
        "size": 3,
    }
    op = _core.create_pool("named", "python", None, False, True)
    assert json.loads(op.request.body or b"") == {
        "name": "named",
        "environment": "python",
        "workspace": False,
        "staticAssets": True,
    }
    op = _core.create_pool("prepared", "python", 1, True, False, snapshot="deps")
    assert json.loads(op.request.body or b"")["snapshot"] == "deps"
    with pytest.raises(ValueError):
        _core.create_pool("p", {"image": "x"}, None, True, False, snapshot="")
    assert _core.delete_pool("a b").request.path == "/v1/pools/a%20b"
    with pytest.raises(ValueError):
        _core.create_pool("", {"image": "x"}, None, True, False)
    with pytest.raises(ValueError):
        _core.create_pool("p", {"image": "x"}, -1, True, False)
    with pytest.raises(TypeError):
        _core.create_pool("p", 42, None, True, False)  # type: ignore[arg-type]


def test_pool_from_json() -> None:
    pool = Pool.from_json(
        {"name": "p", "environment": "p", "size": 2, "ready": 1, "broken": 0, "workspace": True,
         "staticAssets": False, "key": "k", "created": "t", "later": 1}
    )
    assert (pool.name, pool.size, pool.ready, pool.workspace, pool.raw["later"]) == ("p", 2, 1, True, 1)
    assert pool.snapshot is None
    assert Pool.from_json({"name": "p", "snapshot": "deps"}).snapshot == "deps"


def test_pools_on_a_server_without_containerd(client: Client) -> None:
    assert client.pools.list() == []
    # A host Environment can have no pool; said before containerd is asked.
    with pytest.raises(BadRequest) as refused:
        client.pools.create("host-pool", {"backend": "host"})
    assert "only containerd Environments have pools" in refused.value.message
    # A containerd one needs containerd, which this server does not have.
    with pytest.raises(Unavailable):
        client.pools.create("ctd-pool", {"image": "local/busybox:1.35"}, size=1)
    with pytest.raises(NotFound):
        client.pools.delete("ctd-pool")


def test_async_pools(async_client_args: Dict[str, str]) -> None:
    async def main() -> None:
        async with AsyncClient(**async_client_args) as client:
            assert await client.pools.list() == []
            with pytest.raises(BadRequest):
                await client.pools.create("Bad_Name", {"image": "x"})

    asyncio.run(main())
