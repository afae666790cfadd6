"""The forwarder against a real aiohttp upstream: a trajectory the upstream refuses as invalid
goes to the rejected store and the stream moves on (the good ones beside it still arrive), and a
hostile Retry-After can neither kill it nor make it spin."""

import asyncio
import itertools
import json
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from daemon.config import Trajectories
from daemon.trajectories.spool import Forwarder, Spool, parse_batch
from tests.trajectories import batch, ids, ndjson
from trainer.ingest import IngestStore, make_ingest_app


async def forward(spool: Spool, upstream, until, seconds: float, **cfg: object) -> Forwarder:
    """Run a Forwarder from `spool` to `upstream` (an app, or a handler of /v1/ingest) until
    `until(forwarder)` holds or `seconds` pass; the forwarder task must still be alive at the
    end. Wait for what a test needs with `until`, not for a fixed window a loaded host can
    outlast."""
    app = upstream
    if not isinstance(upstream, web.Application):
        app = web.Application()
        app.router.add_post("/v1/ingest", upstream)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            settings = {"upstream": str(server.make_url("/v1/ingest")), "retry_initial_s": 0.05,
                        "retry_max_s": 0.2, "batch_size": 8, **cfg}
            f = Forwarder(spool, Trajectories(**settings), "token-123456", session, {})
            task = asyncio.create_task(f.run())
            deadline = time.monotonic() + seconds
            while not until(f) and time.monotonic() < deadline and not task.done():
                await asyncio.sleep(0.02)
            assert not task.done(), f"the forwarder died: {task.exception()!r}"
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return f
    finally:
        await server.close()


async def test_trajectories_the_upstream_refuses_are_set_aside_and_the_rest_arrive(
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

    f = await forward(spool, upstream, lambda f: spool.depth() == 0, 10)
    poisoned = [trajs[i]["id"] for i in (5, 13)]
    assert spool.depth() == 0 and spool.bytes == 0
    assert sorted(held) == sorted(set(ids(trajs)) - set(poisoned)) and len(held) == 18
    assert f.forwarded == 18 and spool.rejected == 2
    assert f.status()["rejected"] == 2 and "HTTP 400" in f.status()["last_rejected"]
    assert sorted(r["id"] for r in spool.rejected_items()) == sorted(poisoned)
    assert all("field worker" in r["reason"] for r in spool.rejected_items())


async def test_a_misconfigured_forwarder_keeps_the_stream_instead_of_rejecting_it(
        tmp_path: Path) -> None:
    spool = Spool(tmp_path, 1 << 20)
    spool.append(parse_batch(ndjson(batch(5))))

    async def upstream(request: web.Request) -> web.Response:
        return web.json_response({"error": "missing or wrong bearer token"}, status=401)

    f = await forward(spool, upstream, lambda f: f.errors >= 2, 10)
    assert spool.depth() == 5 and spool.rejected == 0
    assert f.errors >= 2 and "HTTP 401" in f.last_error


@pytest.mark.parametrize("retry_after", ["nan", "-1", "0", "Fri, 01 Jan 9999 00:00:00 GMT"])
async def test_hostile_retry_after_neither_kills_nor_spins_the_forwarder(
        tmp_path: Path, retry_after: str) -> None:
    """Issue 10 item 2: `nan` killed the forwarder, `-1` made thousands of resends. (More values:
    tests/unit/chain/test_trajectory.py.)"""
    spool = Spool(tmp_path, 1 << 20)
    spool.append(parse_batch(ndjson(batch(3))))
    posts: list[float] = []

    async def upstream(request: web.Request) -> web.Response:
        posts.append(time.monotonic())
        return web.json_response({"error": "full"}, status=429,
                                 headers={"Retry-After": retry_after})

    f = await forward(spool, upstream, lambda f: len(posts) >= 4 and f.backoff_s > 0, 10,
                      retry_initial_s=0.1, retry_max_s=0.3)
    # waits stay within [retry_initial_s, retry_max_s]. Only bounds a loaded host cannot break
    # are asserted: a sleep never ends early, so consecutive posts are >= 0.1 s apart (the bug:
    # thousands of resends), and the forwarder kept resending (a wait of 9999 years would not).
    assert len(posts) >= 4, posts
    assert all(b - a >= 0.1 for a, b in itertools.pairwise(posts)), posts
    assert 0.1 <= f.backoff_s <= 0.3 and spool.depth() == 3


async def test_a_region_stuck_on_a_bad_trajectory_drains_into_the_real_ingest_after_upgrade(
        tmp_path: Path) -> None:
    """Issue 10 item 6 as a region upgraded from the old spool would see it: its segment files
    hold a `-Infinity` log-prob the old spool took. The real ingest names that trajectory in its
    400; it alone is set aside, in one extra request, and every other trajectory arrives."""
    trajs = batch(12)
    trajs[4]["logprobs"] = [-0.5, float("-inf"), -0.1]
    (tmp_path / "spool").mkdir()
    (tmp_path / "spool" / "seg-000000000001.ndjson").write_bytes(ndjson(trajs))
    spool = Spool(tmp_path / "spool", 1 << 20)
    store = IngestStore(tmp_path / "ingest")
    posts: list[int] = []

    @web.middleware
    async def count(request: web.Request, handler):
        posts.append(1)
        return await handler(request)

    ingest = make_ingest_app(store, "token-123456")
    ingest.middlewares.append(count)
    f = await forward(spool, ingest, lambda f: spool.depth() == 0, 10, batch_size=100)
    assert spool.depth() == 0 and spool.rejected == 1 and f.forwarded == 11
    assert store.held_ids() == [t["id"] for i, t in enumerate(trajs) if i != 4]
    assert [r["id"] for r in spool.rejected_items()] == [trajs[4]["id"]]
    assert len(posts) == 2


@pytest.mark.parametrize("status", [200, 400])
async def test_a_hostile_reply_body_is_a_retried_error_not_a_dead_forwarder(
        tmp_path: Path, status: int) -> None:
    spool = Spool(tmp_path, 1 << 20)
    spool.append(parse_batch(ndjson(batch(3))))

    async def upstream(request: web.Request) -> web.Response:
        return web.Response(body=b"[" * 4000, status=status, content_type="application/json")

    f = await forward(spool, upstream, lambda f: (f.errors >= 1 if status == 200
                                                  else spool.rejected == 3), 10)
    if status == 200:
        assert f.errors >= 1 and "nested too deeply" in f.last_error and spool.depth() == 3
    else:  # a refusal that names no trajectory: each is tried alone, then set aside
        assert spool.rejected == 3 and spool.depth() == 0
