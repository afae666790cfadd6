"""Worker pacing: with `pace_per_version`, a worker generates its share per version the trainer
publishes (plus `pace_ahead` versions' worth) and then waits for a newer version, instead of
generating trajectories the trainer would drop as stale."""

import asyncio
import contextlib
import json
from pathlib import Path

from aiohttp import web
from aiohttp.test_utils import TestServer

from rollout.engine_torch import TorchEngine
from rollout.tasks import load_task
from rollout.worker import RolloutWorker, WorkerConfig

TOKEN = "tok"


class Daemon:
    """The two daemon routes a worker uses; the test decides when a new version appears."""

    def __init__(self, versions: dict[int, Path]) -> None:
        self.versions = versions
        self.current = 0
        self.changed = asyncio.Event()
        self.accepted: list[dict] = []
        self.posted = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/weights/current", self.weights)
        app.router.add_post("/v1/trajectories", self.trajectories)
        return app

    def publish(self, version: int) -> None:
        self.current = version
        self.changed.set()

    async def weights(self, request: web.Request) -> web.Response:
        if self.current <= int(request.query["after"]):
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), float(request.query["timeout"]))
        v = self.current
        return web.json_response({"version": v, "path": str(self.versions[v])})

    async def trajectories(self, request: web.Request) -> web.Response:
        lines = [json.loads(x) for x in (await request.read()).splitlines()]
        self.accepted += lines
        self.posted.set()
        return web.json_response({"held": [t["id"] for t in lines]})


async def _settle(daemon: Daemon, count: int, quiet_s: float = 0.6) -> None:
    """Wait until `count` trajectories arrived and then nothing more for `quiet_s`."""
    async with asyncio.timeout(30):
        while len(daemon.accepted) < count:
            daemon.posted.clear()
            await daemon.posted.wait()
    await asyncio.sleep(quiet_s)


def _run(hf_versions: dict[int, Path], **pace: int) -> tuple[list[list[int]], dict]:
    """Trajectory versions seen after each pause, publishing v1 then v2 between pauses."""

    async def main() -> tuple[list[list[int]], dict]:
        daemon = Daemon({0: hf_versions[0], 1: hf_versions[1], 2: hf_versions[1]})
        server = TestServer(daemon.app())
        await server.start_server()
        cfg = WorkerConfig(daemon=str(server.make_url("")), token=TOKEN, region="eu",
                           worker="w1", prompts_per_batch=2, group_size=3, max_tokens=4,
                           max_batches=4, poll_timeout_s=2.0, retry_max_s=0.2, **pace)
        worker = RolloutWorker(cfg, TorchEngine(), load_task("rollout.tasks.arithmetic"))
        run = asyncio.create_task(worker.run())
        snapshots = []
        try:
            await _settle(daemon, 12)
            snapshots.append([t["version"] for t in daemon.accepted])
            daemon.publish(1)
            await _settle(daemon, 18)
            snapshots.append([t["version"] for t in daemon.accepted])
            daemon.publish(2)
            await asyncio.wait_for(run, 30)
            snapshots.append([t["version"] for t in daemon.accepted])
        finally:
            worker.request_stop()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(run, 10)
            await server.close()
        return snapshots, worker.pacing

    return asyncio.run(main())


def test_paced_worker_generates_its_share_per_version_then_waits(hf_versions) -> None:
    # one batch = 2 prompts x 3 = 6 trajectories = the share per version; one version ahead
    snapshots, pacing = _run(hf_versions, pace_per_version=6, pace_ahead=1)
    assert snapshots[0] == [0] * 12          # v0's share and one ahead, then it waits
    assert snapshots[1] == [0] * 12 + [1] * 6  # v1 grants one more share, generated on v1
    assert snapshots[2] == [0] * 12 + [1] * 6 + [2] * 6
    assert pacing["generated"] == 24 and pacing["waits"] >= 2


def test_paced_worker_without_ahead_waits_after_each_share(hf_versions) -> None:
    snapshots, _ = _run(hf_versions, pace_per_version=12, pace_ahead=0)
    # a share of 12 is two batches per version; nothing runs ahead of the version seen, and
    # max_batches (4) ends the run on v1's share
    assert snapshots[0] == [0] * 12
    assert snapshots[2] == [0] * 12 + [1] * 12
