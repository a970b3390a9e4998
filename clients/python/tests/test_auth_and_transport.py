"""Tokens, addresses and unreachable servers (sync flavour)."""

from __future__ import annotations

import asyncio
import os
from typing import Dict

import pytest

from runner_client import AsyncClient, Client, RunnerError, TransportError, Unauthorized

from conftest import HOST_ENV


def test_wrong_token(address: Dict[str, str]) -> None:
    with Client(token="wrong-token-wrong-token", **address) as client:
        for call in (
            client.sessions.list,
            lambda: client.session(HOST_ENV),
            lambda: client.jobs.get("x"),
            lambda: client.jobs.apply("kind: Job"),
        ):
            with pytest.raises(Unauthorized) as info:
                call()
            assert info.value.status == 401
            assert "token" in info.value.message
            assert isinstance(info.value, RunnerError)
        assert client.health() == {"status": "ok"}


def test_no_token(address: Dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RUNNER_TOKEN", raising=False)
    with Client(**address) as client:
        with pytest.raises(Unauthorized):
            client.sessions.list()


def test_token_and_url_from_environment(
    transport: str, tcp_url: str, socket_path: str, token: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RUNNER_TOKEN", token + "\n")  # as read from a file: whitespace dropped
    monkeypatch.setenv("RUNNER_URL", tcp_url if transport == "tcp" else "unix:" + socket_path)
    with Client() as client:
        assert isinstance(client.sessions.list(), list)
        with client.session(HOST_ENV) as s:
            assert s.exec("echo env").stdout == "env\n"

    async def main() -> None:
        async with AsyncClient() as client:
            assert isinstance(await client.sessions.list(), list)

    asyncio.run(main())


def test_url_forms(socket_path: str, token: str, tcp_url: str) -> None:
    for url in ("unix:" + socket_path, "unix://" + socket_path, tcp_url + "/"):
        with Client(url, token=token) as client:
            assert isinstance(client.sessions.list(), list)
    with pytest.raises(ValueError):
        Client("ftp://example", token=token)
    with pytest.raises(ValueError):
        Client(tcp_url, socket=socket_path, token=token)


def test_unreachable(scratch: str) -> None:
    with Client(socket=os.path.join(scratch, "nothing-here.sock"), token="x") as client:
        with pytest.raises(TransportError) as info:
            client.sessions.list()
        assert info.value.status == 0 and isinstance(info.value, ConnectionError)
    with Client("http://127.0.0.1:1", token="x") as client:
        with pytest.raises(TransportError):
            client.health()

    async def main() -> None:
        async with AsyncClient(socket=os.path.join(scratch, "nothing-here.sock"), token="x") as client:
            with pytest.raises(TransportError):
                await client.health()

    asyncio.run(main())


def test_closed_client(address: Dict[str, str], token: str) -> None:
    client = Client(token=token, **address)
    client.close()
    with pytest.raises(TransportError):
        client.health()
