"""The rollout worker against a small aiohttp stand-in for the daemon's two routes: version
switches between batches, push-back, retries without loss or duplicates, graceful SIGTERM."""

import asyncio
import contextlib
import json
import os
import signal
import sys
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from rollout.engine_torch import TorchEngine
from rollout.tasks import load_task
from rollout.worker import RejectedError, RolloutWorker, WorkerConfig
from tests.support import async_wait_until

TOKEN = "tok"


class StandInDaemon:
    """`GET /v1/weights/current` (long-poll) and `POST /v1/trajectories` with scripted replies."""

    def __init__(self, versions: dict[int, Path], script: list[str]) -> None:
        self.versions = versions
        self.current = 0
        self.script = list(script)
        self.attempts: list[list[str]] = []
        self.accepted: list[dict] = []
        self.changed = asyncio.Event()
        self.flip_after_first_batch = True

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/weights/current", self.weights)
        app.router.add_post("/v1/trajectories", self.trajectories)
        return app

    async def weights(self, request: web.Request) -> web.Response:
        assert request.headers["Authorization"] == f"Bearer {TOKEN}"
        after = int(request.query["after"])
        if self.current <= after:
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), float(request.query["timeout"]))
        v = self.current
        return web.json_response({"version": v, "state_digest": f"d{v}",
                                  "path": str(self.versions[v])})

    async def trajectories(self, request: web.Request) -> web.StreamResponse:
        lines = [json.loads(x) for x in (await request.read()).splitlines()]
        self.attempts.append([t["id"] for t in lines])
        action = self.script.pop(0) if self.script else "ok"
        if action == "429":
            return web.json_response({"error": "spool full"}, status=429,
                                     headers={"Retry-After": "0.05"})
        if action == "drop":
            request.transport.close()
            return web.Response()
        if action == "500":
            return web.json_response({"error": "disk busy"}, status=500)
        if action == "400":
            return web.json_response({"error": "line 1: field reward"}, status=400)
        known = {t["id"] for t in self.accepted}
        self.accepted += [t for t in lines if t["id"] not in known]
        if self.flip_after_first_batch and self.current == 0:
            self.current = 1
            self.changed.set()
        return web.json_response({"held": [t["id"] for t in lines]})


def config(url: str, **over: object) -> WorkerConfig:
    base = {"daemon": url, "token": TOKEN, "region": "eu", "worker": "w1",
            "prompts_per_batch": 2, "group_size": 3, "max_tokens": 4, "max_batches": 3,
            "poll_timeout_s": 2.0, "retry_max_s": 0.2}
    base.update(over)
    return WorkerConfig(**base)


async def run_worker(versions: dict[int, Path], script: list[str], **over: object
                     ) -> tuple[StandInDaemon, RolloutWorker]:
    daemon = StandInDaemon(versions, script)
    server = TestServer(daemon.app())
    await server.start_server()
    try:
        engine = TorchEngine()
        worker = RolloutWorker(config(str(server.make_url("")), **over), engine,
                               load_task("rollout.tasks.arithmetic"))
        await asyncio.wait_for(worker.run(), 60)
        return daemon, worker
    finally:
        await server.close()


async def test_worker_switches_version_between_batches_and_tags_trajectories(
        hf_versions) -> None:
    daemon, worker = await run_worker(hf_versions, [])
    versions = [t["version"] for t in daemon.accepted]
    assert len(daemon.accepted) == 3 * 2 * 3
    assert versions[:6] == [0] * 6 and versions[-6:] == [1] * 6
    assert versions == sorted(versions)
    assert worker.stats["loads"] == 2 and worker.engine.loads == 2
    first = daemon.accepted[0]
    assert {"id", "version", "group", "prompt", "completion", "prompt_ids", "completion_ids",
            "logprobs", "reward", "region", "worker", "created"} <= set(first)
    assert first["region"] == "eu" and first["worker"] == "w1"
    groups = [t["group"] for t in daemon.accepted]
    assert all(groups.count(g) == 3 for g in groups) and len(set(groups)) == 6


async def test_pushback_and_dropped_connections_resend_the_same_ids(hf_versions) -> None:
    daemon, worker = await run_worker(hf_versions, ["429", "drop", "ok", "500", "ok"])
    assert daemon.attempts[0] == daemon.attempts[1] == daemon.attempts[2]
    assert daemon.attempts[3] == daemon.attempts[4]
    ids = [t["id"] for t in daemon.accepted]
    assert len(ids) == len(set(ids)) == 18
    assert worker.stats["pushbacks"] == 1 and worker.stats["retries"] == 3
    assert worker.stats["posted"] == 18 and worker.stats["undelivered"] == 0


async def test_a_rejected_batch_stops_the_worker_with_the_reason(hf_versions) -> None:
    with pytest.raises(RejectedError, match="field reward"):
        await run_worker(hf_versions, ["400"])


async def test_sigterm_stops_the_worker_process_cleanly(hf_versions) -> None:
    daemon = StandInDaemon(hf_versions, [])
    daemon.flip_after_first_batch = False
    server = TestServer(daemon.app())
    await server.start_server()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollout.worker", "--daemon", str(server.make_url("")),
        "--token", TOKEN, "--prompts-per-batch", "2", "--group-size", "2",
        "--max-tokens", "4", "--threads", "1",
        cwd=Path(__file__).resolve().parents[3], stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        await async_wait_until(lambda: daemon.accepted, 90, "the worker to post a batch")
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.wait_for(proc.wait(), 20)
        n = len(daemon.accepted)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await server.close()
    assert rc == 0 and n % 4 == 0
