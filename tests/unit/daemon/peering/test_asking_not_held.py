"""first_good against real aiohttp peers on loopback (chaos finding: ten concurrent downloads
asked a region for torrents it did not hold yet, its 404s reached BAN_FAILURES at once and an
innocent peer was banned for 600 s): 'not held' is no strike, overlapping failures count once,
and a peer that keeps serving bad replies is still banned."""

import asyncio
import socket

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from daemon.peering.asking import first_good
from daemon.peering.peer_client import BadReply, PeerClient
from daemon.peering.peers import BAN_FAILURES, Peer, PeerBook

HELD = {"v00000003.delta"}


def peer_app(held: set[str]) -> web.Application:
    """A daemon's torrent route: 404 for what it lacks (as daemon/app.py answers)."""

    async def torrent(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        await asyncio.sleep(0.02)
        if name not in held:
            raise web.HTTPNotFound(text='{"error": "no torrent"}', content_type="application/json")
        return web.Response(body=b"torrent of " + name.encode())

    app = web.Application()
    app.add_routes([web.get("/v1/chain/torrents/{name}", torrent)])
    return app


def book_with(urls: list[str]) -> PeerBook:
    book = PeerBook("http://127.0.0.1:1", ("127.0.0.1", 6881), "me", [], 16)
    for url in urls:
        book.learn(url).proven = True
    return book


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def ask_all(book: PeerBook, client: PeerClient, names: list[str]) -> list[bytes | None]:
    async def one(name: str) -> bytes | None:
        async def ask(peer: Peer) -> bytes:
            return await client.get(f"{peer.url}/v1/chain/torrents/{name}", "torrent",
                                    timeout=5.0)
        return await first_good(book.by_head(), ask, book, settle=False)

    return await asyncio.gather(*(one(n) for n in names))


async def test_a_peer_answering_404_for_what_it_lacks_is_never_banned() -> None:
    names = [f"v{v:08d}.delta" for v in range(1, 13)]
    async with TestServer(peer_app(set()), host="127.0.0.1") as lacking, \
            TestServer(peer_app(set(names)), host="127.0.0.1") as holder, \
            aiohttp.ClientSession() as session:
        urls = [str(lacking.make_url("")).rstrip("/"), str(holder.make_url("")).rstrip("/")]
        book = book_with(urls)
        client = PeerClient(session, "tok")
        for _ in range(3):  # three waves of twelve concurrent downloads
            got = await ask_all(book, client, names)
            assert got == [b"torrent of " + n.encode() for n in names]
        lacking_peer = book.peers[urls[0]]
        assert not lacking_peer.banned() and lacking_peer.failures == 0
        assert lacking_peer.retry_at == 0.0 and lacking_peer.misses > 0
        assert not book.bans


async def test_concurrent_failures_of_one_unreachable_peer_count_once() -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    async with aiohttp.ClientSession() as session:
        book = book_with([url])
        got = await ask_all(book, PeerClient(session, "tok"), [f"v{v:08d}.delta"
                                                                for v in range(1, 11)])
        peer = book.peers[url]
        assert got == [None] * 10
        assert peer.failures == 1 and not peer.banned()
        assert "PeerUnreachable" in peer.last_error


async def test_a_peer_serving_bad_replies_again_and_again_is_banned() -> None:
    async with TestServer(peer_app(HELD), host="127.0.0.1") as liar, \
            aiohttp.ClientSession() as session:
        url = str(liar.make_url("")).rstrip("/")
        book = book_with([url])
        client = PeerClient(session, "tok")

        async def ask(peer: Peer) -> bytes:
            await client.get(f"{peer.url}/v1/chain/torrents/v00000003.delta", "torrent")
            raise BadReply(peer.url, "torrent does not match its signed manifest")

        for _ in range(BAN_FAILURES):
            book.peers[url].retry_at = 0.0  # ask again now instead of after the backoff
            await first_good([book.peers[url]], ask, book)
        assert book.peers[url].banned() and url in book.bans
