"""HeadWatcher against real aiohttp peers on loopback: a peer this node hears through another
(a region's fetcher hears the trainer through the fleet's, daemon/versions/sync.py) is not
long-polled but glanced at, `timeout=0` every `glance_s`, so two nodes whose views each make the
other their way to the trainer still learn its heads; the peer they hear through is
long-polled. Without a glance period such a peer is never asked."""

import asyncio
from collections.abc import Callable

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from daemon.peering.asking import HeadWatcher
from daemon.peering.peer_client import PeerClient
from daemon.peering.peers import Peer, PeerBook


def head_app(version: int, asked: list[str]) -> web.Application:
    """A daemon's head route: answers at once with `version`, recording each poll's timeout."""

    async def head(request: web.Request) -> web.Response:
        asked.append(request.query["timeout"])
        return web.json_response({"version": version})

    app = web.Application()
    app.add_routes([web.get("/v1/chain/head", head)])
    return app


async def watch(glance_s: float | Callable[[dict], float] | None, seconds: float,
                max_peers: int = 16) -> tuple[list[str], list[str], dict]:
    """`glance_s`: the period, or a function of what has been heard so far (peer -> version)."""
    trainer_asked: list[str] = []
    fetcher_asked: list[str] = []
    heard: dict[str, int | None] = {}
    async with TestServer(head_app(7, trainer_asked), host="127.0.0.1") as trainer, \
            TestServer(head_app(6, fetcher_asked), host="127.0.0.1") as fetcher, \
            aiohttp.ClientSession() as session:
        t_url, f_url = str(trainer.make_url("")).rstrip("/"), str(fetcher.make_url("")).rstrip("/")
        book = PeerBook("http://127.0.0.1:1", ("127.0.0.1", 6881), "me", [], 16)
        for url in (t_url, f_url):
            book.learn(url).proven = True

        async def on_head(peer: Peer, version: int | None) -> None:
            heard[peer.url] = version

        watcher = HeadWatcher(book, PeerClient(session, "t"), on_head, lambda: None, max_peers, 5.0,
                              elsewhere=lambda p: p.url == t_url, through=lambda: [f_url],
                              glance_s=None if glance_s is None else
                              (lambda: glance_s(heard)) if callable(glance_s) else
                              (lambda: glance_s))
        task = asyncio.create_task(watcher.run())
        await asyncio.sleep(seconds)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return trainer_asked, fetcher_asked, {("trainer" if u == t_url else "fetcher"): v
                                          for u, v in heard.items()}


@pytest.mark.parametrize("max_peers", [16, 0])
async def test_a_peer_heard_elsewhere_is_glanced_at_without_holding_the_request(
        max_peers: int) -> None:
    """Also when the book watches fewer peers than it knows (`max_peers` 0 here: at a large
    fleet neither the trainer nor the upstream need rank among those watched)."""
    trainer_asked, fetcher_asked, heard = await watch(glance_s=0.3, seconds=1.5,
                                                      max_peers=max_peers)
    assert trainer_asked and set(trainer_asked) == {"0"}, trainer_asked
    assert 2 <= len(trainer_asked) <= 7, trainer_asked  # about every 0.3 s, not continuously
    assert fetcher_asked and set(fetcher_asked) == {"5.0"}, fetcher_asked
    assert heard == {"trainer": 7, "fetcher": 6}


async def test_without_a_glance_period_a_peer_heard_elsewhere_is_never_asked() -> None:
    trainer_asked, fetcher_asked, heard = await watch(glance_s=None, seconds=0.8)
    assert trainer_asked == [] and fetcher_asked
    assert heard == {"fetcher": 6}


@pytest.mark.parametrize("learns", [False, True])
async def test_the_first_glance_waits_on_the_period_as_it_is_learned(monkeypatch, learns: bool
                                                                     ) -> None:
    """The first glance comes after a share of the period drawn once (half here), the period
    read again as the node learns the fleet's size: once the upstream's first reply makes it
    1,000 s, the trainer is not asked in the next second and a half; kept at 1 s, it is (at
    0.5 s: the upstream has that long to answer first)."""
    monkeypatch.setattr("daemon.peering.asking.random.random", lambda: 0.5)

    def period(heard: dict) -> float:  # `heard`: the replies so far, the upstream's first
        return 1000.0 if learns and heard else 1.0

    trainer_asked, fetcher_asked, _ = await watch(glance_s=period, seconds=1.5)
    assert fetcher_asked
    assert (trainer_asked == []) is learns, trainer_asked
