"""Trajectory ingest over a real aiohttp server: durable, deduplicated, validated, resumable."""

import asyncio
import json
import uuid
from pathlib import Path

import aiohttp
from aiohttp.test_utils import TestServer

from trainer.ingest import IngestStore, make_ingest_app

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def traj(**over: object) -> dict:
    t = {"id": uuid.uuid4().hex, "version": 3, "group": "g1", "prompt": "1+2=",
         "completion": "3", "prompt_ids": [1, 5, 14, 6, 17], "completion_ids": [7, 2],
         "logprobs": [-0.5, -0.1], "reward": 1.0, "region": "eu", "worker": "w0",
         "created": 1700000000.0}
    t.update(over)
    return t


def ndjson(items: list[dict]) -> bytes:
    return b"".join(json.dumps(t).encode() + b"\n" for t in items)


async def post(root: Path, body: bytes, headers: dict | None = None) -> tuple[int, dict, dict]:
    """POST to a fresh server over `root`; returns status, reply, and the store's stats."""
    store = IngestStore(root)
    server = TestServer(make_ingest_app(store, TOKEN))
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as s, s.post(
            server.make_url("/v1/ingest"), data=body, headers=AUTH if headers is None else headers
        ) as r:
            return r.status, await r.json(), store.stats()
    finally:
        await server.close()


def test_ingest_acknowledges_held_ids_and_dedupes(tmp_path: Path) -> None:
    a, b = traj(), traj()
    status, reply, stats = asyncio.run(post(tmp_path, ndjson([a, b, a])))
    assert status == 200
    assert reply == {"held": [a["id"], b["id"]]}
    assert stats["held"] == 2 and stats["pending"] == 2


def test_ids_survive_restart_and_are_acknowledged_again_without_storing_twice(
        tmp_path: Path) -> None:
    a, b = traj(), traj()
    asyncio.run(post(tmp_path, ndjson([a])))
    status, reply, stats = asyncio.run(post(tmp_path, ndjson([a, b])))
    assert status == 200 and reply["held"] == [a["id"], b["id"]]
    assert stats["held"] == 2
    lines = b"".join(p.read_bytes() for p in sorted((tmp_path / "segments").iterdir()))
    assert lines.count(a["id"].encode()) == 1


def test_bad_line_is_rejected_naming_line_and_field_and_nothing_is_stored(
        tmp_path: Path) -> None:
    good, bad = traj(), traj(logprobs=[-0.5])
    status, reply, stats = asyncio.run(post(tmp_path, ndjson([good, bad])))
    assert status == 400
    assert "line 2" in reply["error"] and "logprobs" in reply["error"]
    assert stats["held"] == 0
    status, reply, _ = asyncio.run(post(tmp_path, ndjson([good]) + b"{not json\n"))
    assert status == 400 and "line 2" in reply["error"]
    status, reply, _ = asyncio.run(post(tmp_path, ndjson([traj(version="3")])))
    assert status == 400 and "line 1: field version" in reply["error"]
    assert IngestStore(tmp_path).stats()["held"] == 0


def test_wrong_or_missing_token_is_refused(tmp_path: Path) -> None:
    status, _, stats = asyncio.run(post(tmp_path, ndjson([traj()]), headers={}))
    assert status == 401 and stats["held"] == 0
    status, _, _ = asyncio.run(post(tmp_path, ndjson([traj()]),
                                    headers={"Authorization": "Bearer nope"}))
    assert status == 401


def test_take_returns_arrival_order_and_consumption_survives_restart(tmp_path: Path) -> None:
    items = [traj(group=f"g{i}") for i in range(5)]
    asyncio.run(post(tmp_path, ndjson(items)))

    async def take(n: int, commit: bool = True) -> list[str]:
        store = IngestStore(tmp_path)
        return [t["id"] for t in await store.take(n, timeout=0.1, commit=commit)]

    assert asyncio.run(take(2)) == [items[0]["id"], items[1]["id"]]
    assert asyncio.run(take(1, commit=False)) == [items[2]["id"]]
    assert asyncio.run(take(10)) == [t["id"] for t in items[2:]]
    assert asyncio.run(take(10)) == []


def test_take_waits_for_a_trajectory_to_arrive(tmp_path: Path) -> None:
    async def run() -> list[dict]:
        store = IngestStore(tmp_path)
        waiter = asyncio.create_task(store.take(4, timeout=5.0))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        await store.append([traj()])
        return await asyncio.wait_for(waiter, 2.0)

    assert len(asyncio.run(run())) == 1


def test_torn_last_line_is_dropped_on_start(tmp_path: Path) -> None:
    a = traj()
    asyncio.run(post(tmp_path, ndjson([a])))
    seg = sorted((tmp_path / "segments").iterdir())[-1]
    with seg.open("ab") as f:
        f.write(b'{"id": "half-writ')
    store = IngestStore(tmp_path)
    assert store.stats()["held"] == 1
    assert seg.read_bytes().endswith(b"\n")


def test_take_completes_a_cut_group_and_waits_for_min_n(tmp_path: Path) -> None:
    items = [traj(group="a"), traj(group="a"), traj(group="b"), traj(group="b"), traj(group="c")]

    async def run() -> tuple[list[str], list[str], float]:
        store = IngestStore(tmp_path)
        await store.append(items)
        first = [t["group"] for t in await store.take(1, timeout=0.1)]
        second = [t["group"] for t in await store.take(3, timeout=0.1, whole_groups=False)]
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await store.take(10, timeout=0.3, min_n=5)
        return first, second, loop.time() - t0

    first, second, waited = asyncio.run(run())
    assert first == ["a", "a"] and second == ["b", "b", "c"]
    assert waited >= 0.25
