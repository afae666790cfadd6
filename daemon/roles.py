"""Trainer and region behaviour, chosen once at start (`node.build_role`), not by `if role ==`.

A role says what "current" means, what runs in the background, what publish does and what it
adds to status. The trainer seeds what its local publisher wrote; a region follows the swarm.
"""

import asyncio
import contextlib
from collections.abc import Callable, Coroutine

from chain import refusals
from chain.store import ChainStore
from chain.weights import WeightsDir
from daemon.bittorrent.artifacts import Artifacts
from daemon.config import Config
from daemon.peering.asking import HeadWatcher
from daemon.tasks import stop as stop_task
from daemon.versions.publish import PublishError, Seeder, current_of_head
from daemon.versions.sync import Syncer
from daemon.versions.weights_check import WeightsCheck

Spawn = Callable[[Coroutine, str], asyncio.Task]


class TrainerRole:
    name = "trainer"
    syncer: Syncer | None = None

    def __init__(self, seeder: Seeder, store: ChainStore) -> None:
        self.seeder = seeder
        self.store = store

    def current(self) -> dict | None:
        return current_of_head(self.store)

    async def start(self, spawn: Spawn) -> None:
        await self.seeder.start()

    async def serving(self) -> None:
        """Once the HTTP API listens: seed what the publisher wrote while it could not notify
        (between the scan at start and now)."""
        await self.seeder.catch_up()

    async def stop(self, timeout: float) -> None:
        return None

    async def publish(self, version: int) -> dict:
        return await self.seeder.publish(version)

    def downloading(self) -> bool:
        return False

    def reconfigure(self, cfg: Config) -> None:
        self.seeder.keeper.reconfigure(cfg.retention.policy(), cfg.retention.live_within_s)

    def detail(self) -> dict:
        return {"published": self.seeder.published[-10:],
                "caught_up": self.seeder.caught_up[-10:]}

    def checkpoints(self) -> dict:
        """Checkpoints `deltaswarm publish`/`watch` refused, and why (chain/refusals.py)."""
        return {"refused": refusals.read(self.store.root)}

    def sections(self) -> dict:
        return {"retention": self.seeder.keeper.status(), "checkpoints": self.checkpoints()}

    def weights_check(self) -> dict | None:
        return None  # a trainer serves blocks, not weights (SelfCheck covers those)


class RegionRole:
    name = "region"
    seeder: Seeder | None = None

    def __init__(self, syncer: Syncer, watcher: HeadWatcher, weights: WeightsDir,
                 store: ChainStore, artifacts: Artifacts, node: str, check: WeightsCheck
                 ) -> None:
        self.syncer = syncer
        self.check = check
        self.watcher = watcher
        self.weights = weights
        self.store = store
        self.artifacts = artifacts
        self.node = node
        self._tasks: list[asyncio.Task] = []
        self._loop: asyncio.Task | None = None

    def current(self) -> dict | None:
        cur = self.weights.current()
        if cur is None:
            return None
        return {"version": cur.version, "state_digest": cur.state_digest, "path": str(cur.path)}

    async def start(self, spawn: Spawn) -> None:
        await asyncio.to_thread(self.artifacts.reseed, self.store)
        self._tasks = [spawn(self.watcher.run(), "heads"),
                       spawn(self.syncer.notify_loop(), "notify"),
                       spawn(self.syncer.disk_loop(), "disk"),
                       spawn(self.check.run(), "weights-check")]
        self._loop = spawn(self.syncer.run(), "sync")

    async def serving(self) -> None:
        return None

    async def stop(self, timeout: float) -> None:
        self.syncer.stopping = True
        self.syncer.wake.set()
        self.check.stop()
        for task in self._tasks:
            task.cancel()
        if self._loop is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):  # timeout or a crash
                await asyncio.wait_for(asyncio.shield(self._loop), timeout)
        loop = [self._loop] if self._loop is not None else []
        for task in [*self._tasks, *loop, *self.syncer.downloads.values()]:
            await stop_task(task)

    async def publish(self, version: int) -> dict:
        raise PublishError(409, f"{self.node} is a region daemon; only role: trainer accepts "
                                "publish")

    def downloading(self) -> bool:
        return bool(self.syncer.downloads)

    def reconfigure(self, cfg: Config) -> None:
        self.syncer.reconfigure(cfg.sync)
        self.syncer.keeper.reconfigure(cfg.retention.policy(), cfg.retention.live_within_s)
        self.watcher.reconfigure(cfg.max_peers, cfg.long_poll_timeout_s)

    def detail(self) -> dict:
        return {"sync": self.syncer.status()}

    def sections(self) -> dict:
        return {"sync": self.syncer.sync_status(), "retention": self.syncer.keeper.status()}

    def weights_check(self) -> dict | None:
        return self.check.status()
