"""PeerClient against a real aiohttp server on loopback: whole bodies up to the cap, typed
errors, hostile JSON, no echo of reply text, the hello proof; and the pure helpers."""

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from daemon.peering.peer_client import (
    CAPS,
    BadReply,
    PeerClient,
    PeerHttpError,
    PeerUnreachable,
    ReplyTooLarge,
    bounded_int,
    decode_json,
    hello_proof,
    torrent_cap,
)

SECRET = "THIRD-PARTY-TEXT"


def app() -> web.Application:
    async def body(request: web.Request) -> web.StreamResponse:
        n = int(request.match_info["n"])
        resp = web.StreamResponse()  # chunked, no Content-Length, written in small pieces
        await resp.prepare(request)
        sent = 0
        while sent < n:
            piece = min(7919, n - sent)
            await resp.write(b"a" * piece)
            sent += piece
            if sent % (64 * 7919) == 0:
                await asyncio.sleep(0)
        return resp

    async def sized(request: web.Request) -> web.Response:
        return web.Response(body=b"b" * int(request.match_info["n"]))

    async def err(request: web.Request) -> web.Response:
        return web.Response(status=500, text=SECRET * 10_000)

    async def deep(request: web.Request) -> web.Response:
        return web.Response(body=b"[" * 10_240)

    async def hello(request: web.Request) -> web.Response:
        url = str(request.url.origin())
        return web.json_response({"proof": hello_proof("tok-12345", request.query["challenge"],
                                                       url),
                                  "auth": request.headers.get("Authorization")})

    a = web.Application()
    a.add_routes([web.get("/body/{n}", body), web.get("/sized/{n}", sized),
                  web.get("/err", err), web.get("/deep", deep), web.get("/healthz", hello)])
    return a


async def run(coro_fn):
    """`coro_fn(client, url)` against a fresh server, with a fresh PeerClient."""
    async with TestServer(app(), host="127.0.0.1") as server, aiohttp.ClientSession() as s:
        client = PeerClient(s, "tok-12345", lambda: {"X-Deltaswarm-Peer": "x"})
        return await coro_fn(client, str(server.make_url("")).rstrip("/"))


@pytest.mark.parametrize("n", [300_000, 5_000_000])
async def test_a_streamed_reply_is_read_whole(n: int) -> None:
    got = await run(lambda c, u: c.get(f"{u}/body/{n}", "manifest"))
    assert len(got) == n


async def test_a_reply_past_its_cap_is_refused_whether_streamed_or_sized() -> None:
    with pytest.raises(ReplyTooLarge):
        await run(lambda c, u: c.get(f"{u}/body/{CAPS['head'] + 1}", "head"))
    with pytest.raises(ReplyTooLarge):
        await run(lambda c, u: c.get(f"{u}/sized/{CAPS['head'] + 1}", "head"))
    assert len(await run(lambda c, u: c.get(f"{u}/sized/{CAPS['head']}", "head"))) == CAPS["head"]


async def test_an_error_status_is_typed_bounded_and_its_text_not_in_the_message() -> None:
    with pytest.raises(PeerHttpError) as e:
        await run(lambda c, u: c.get(f"{u}/err", "head"))
    assert e.value.status == 500
    assert len(e.value.body) <= CAPS["error"]
    assert SECRET not in str(e.value)


async def test_unreachable_and_hostile_json_are_typed() -> None:
    with pytest.raises(PeerUnreachable):
        await run(lambda c, u: c.get("http://127.0.0.1:1/x", "head", timeout=2))
    with pytest.raises(BadReply):
        await run(lambda c, u: c.get_json(f"{u}/deep", "head"))


async def test_the_hello_proof_is_checked_and_sends_no_token() -> None:
    async def both(c: PeerClient, u: str):
        ok = await c.prove(u)
        raw = await c.get_json(f"{u}/healthz", "hello", auth=False, params={"challenge": "0"})
        c.reconfigure("another-token")
        return ok, raw["auth"], await c.prove(u)

    ok, auth, after = await run(both)
    assert ok and auth is None and not after


def test_decode_json_refuses_depth_nan_bad_utf8_and_huge_numbers() -> None:
    for raw in (b"[" * 10_000, b"]" * 3 + b"[" * 100, b'{"a": NaN}', b"\xff\xfe",
                b"1" * 5000, b'{"a": Infinity}'):
        with pytest.raises(BadReply):
            decode_json(raw)
    assert decode_json(json.dumps({"a": [[1]]}).encode()) == {"a": [[1]]}
    assert decode_json(b'{"s": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}')


def test_bounded_int_refuses_bools_negatives_and_huge_values() -> None:
    for v in (True, -1, 10**400, 2**62, 1.0, "3", None):
        with pytest.raises(BadReply):
            bounded_int(v)
    assert bounded_int(2**62 - 1) == 2**62 - 1


def test_torrent_cap_covers_a_1t_model_at_1mib_pieces_and_stays_bounded() -> None:
    blocks = [8 << 20] * 238_419  # 1T bf16 params in 8 MiB blocks
    cap = torrent_cap(blocks, 1 << 20)
    assert 238_419 * (32 * 8) < cap <= CAPS["torrent"]
    assert torrent_cap(blocks, 1 << 14) == CAPS["torrent"]
