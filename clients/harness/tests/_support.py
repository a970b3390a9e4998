"""What the server tests share (imported as a module: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Coroutine, TypeVar

from runner_harness import Sandbox, Server

BUSYBOX = "local/busybox:1.35"
PYTHON = "local/python:3.11"
T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


async def with_sandbox(server: Server, environment: dict[str, Any], body: Callable[[Sandbox], Coroutine[Any, Any, T]]) -> T:
    client = server.async_client()
    sandbox = await Sandbox.start(client, environment)
    try:
        return await body(sandbox)
    finally:
        await sandbox.delete()
        await client.aclose()
