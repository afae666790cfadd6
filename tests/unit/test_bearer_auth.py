"""Both HTTP surfaces (the daemon's control plane and the trainer's ingest) use the one bearer
check in chain/auth.py: over a real socket, raw undecodable bytes in `Authorization` get 401 like
any wrong token (not a 500), and the right token gets through."""

import asyncio
from types import SimpleNamespace

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from daemon.app import build_app
from trainer.ingest import IngestStore, make_ingest_app

TOKEN = "secret-token"


def daemon_app(tmp_path) -> tuple[web.Application, str]:
    node = SimpleNamespace(token=TOKEN, book=None, status=lambda: {"ok": True},
                           max_body_bytes=1 << 20)
    return build_app(node), "/v1/status"


def ingest_app(tmp_path) -> tuple[web.Application, str]:
    return make_ingest_app(IngestStore(tmp_path / "ingest"), TOKEN), "/v1/ingest/stats"


async def get_status(server: TestServer, path: str, authorization: bytes) -> int:
    """GET `path` with `authorization` sent as raw header bytes; the HTTP status code."""
    reader, writer = await asyncio.open_connection(server.host, server.port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n".encode()
                     + b"Authorization: " + authorization + b"\r\n\r\n")
        await writer.drain()
        status_line = await reader.readline()
    finally:
        writer.close()
        await writer.wait_closed()
    return int(status_line.split()[1])


@pytest.mark.parametrize("make_app", [daemon_app, ingest_app], ids=["daemon", "ingest"])
async def test_raw_bytes_in_authorization_get_401_and_the_token_gets_through(make_app, tmp_path):
    app, path = make_app(tmp_path)
    async with TestServer(app) as server:
        for raw in (b"Bearer \xff\xfe\x80", b"Bearer secret-tok\xc3\xa9", b"\xff",
                    b"Bearer wrong-token"):
            assert await get_status(server, path, raw) == 401, raw
        assert await get_status(server, path, f"Bearer {TOKEN}".encode()) == 200
