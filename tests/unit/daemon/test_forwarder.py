"""The forwarder against a real aiohttp upstream: a trajectory the upstream refuses as invalid
goes to the rejected store and the stream moves on (the good ones beside it still arrive), and a
hostile Retry-After can neither kill it nor make it spin."""

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from daemon.config import Trajectories
from daemon.spool import Forwarder, Spool, parse_batch
from tests.trajectories import batch, ids, ndjson


async def forward(spool: Spool, handler, until, seconds: float, **cfg: object) -> Forwarder:
    """Run a Forwarder from `spool` to an upstream app serving `handler` until `until()` holds
    or `seconds` pass; the forwarder task must still be alive at the end."""
    app = web.Application()
    app.router.add_post("/v1/ingest", handler)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            settings = {"upstream": str(server.make_url("/v1/ingest")), "retry_initial_s": 0.05,
                        "retry_max_s": 0.2, "batch_size": 8, **cfg}
            f = Forwarder(spool, Trajectories(**settings), "token-123456", session, {})
            task = asyncio.create_task(f.run())
            deadline = time.monotonic() + seconds
            while not until() and time.monotonic() < deadline and not task.done():
                await asyncio.sleep(0.02)
            assert not task.done(), f"the forwarder died: {task.exception()!r}"
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return f
    finally:
        await server.close()


def test_trajectories_the_upstream_refuses_are_set_aside_and_the_rest_arrive(
        tmp_path: Path) -> None:
    trajs = batch(20)
    for i in (5, 13):
        trajs[i]["worker"] = "poison"
    spool = Spool(tmp_path, 1 << 20)
    spool.append(parse_batch(ndjson(trajs)))
    held: list[str] = []

    async def upstream(request: web.Request) -> web.Response:
        lines = [json.loads(x) for x in (await request.read()).splitlines() if x.strip()]
        bad = [n for n, t in enumerate(lines, 1) if t["worker"] == "poison"]
        if bad:
            return web.json_response({"error": f"line {bad[0]}: field worker"}, status=400)
        held.extend(t["id"] for t in lines)
        return web.json_response({"held": [t["id"] for t in lines]})

    f = asyncio.run(forward(spool, upstream, lambda: spool.depth() == 0, 10))
    poisoned = [trajs[i]["id"] for i in (5, 13)]
    assert spool.depth() == 0 and spool.bytes == 0
    assert sorted(held) == sorted(set(ids(trajs)) - set(poisoned)) and len(held) == 18
    assert f.forwarded == 18 and spool.rejected == 2
    assert f.status()["rejected"] == 2 and "HTTP 400" in f.status()["last_rejected"]
    assert sorted(r["id"] for r in spool.rejected_items()) == sorted(poisoned)
    assert all("field worker" in r["reason"] for r in spool.rejected_items())


def test_a_misconfigured_forwarder_keeps_the_stream_instead_of_rejecting_it(
        tmp_path: Path) -> None:
    spool = Spool(tmp_path, 1 << 20)
    spool.append(parse_batch(ndjson(batch(5))))

    async def upstream(request: web.Request) -> web.Response:
        return web.json_response({"error": "missing or wrong bearer token"}, status=401)

    f = asyncio.run(forward(spool, upstream, lambda: False, 0.5))
    assert spool.depth() == 5 and spool.rejected == 0
    assert f.errors >= 2 and "HTTP 401" in f.last_error


@pytest.mark.parametrize("retry_after", ["nan", "-1", "inf", "1e400", "0", "soon",
                                         "Wed, 21 Oct 2015 07:28:00 GMT",
                                         "Fri, 01 Jan 9999 00:00:00 GMT"])
def test_hostile_retry_after_neither_kills_nor_spins_the_forwarder(tmp_path: Path,
                                                                   retry_after: str) -> None:
    spool = Spool(tmp_path, 1 << 20)
    spool.append(parse_batch(ndjson(batch(3))))
    posts: list[float] = []

    async def upstream(request: web.Request) -> web.Response:
        posts.append(time.monotonic())
        return web.json_response({"error": "full"}, status=429,
                                 headers={"Retry-After": retry_after})

    f = asyncio.run(forward(spool, upstream, lambda: False, 0.8, retry_initial_s=0.1,
                            retry_max_s=0.3))
    # waits stay within [retry_initial_s, retry_max_s]: 0.8 s holds about 3-9 posts
    assert 2 <= len(posts) <= 10, posts
    assert 0.1 <= f.backoff_s <= 0.3 and spool.depth() == 3
