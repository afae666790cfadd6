"""The trainer node's side of publishing: seed the versions the local publisher wrote.

The publisher (trainer/publisher.py) writes blocks and signed manifests into
`<state_dir>/chain`, then calls `POST /v1/publish {"version": N}`. Here the manifests of that
version are verified against the pinned key, their blocks checked present, the torrents built
and seeded, the head bumped (long-polls wake), and retention applied: one decision
(daemon/retain.py) that keeps what live regions behind still need and records its inputs for
the publisher.
"""

import asyncio
import logging

from chain.errors import BadManifest
from chain.manifest import artifact_name
from chain.store import ChainStore
from daemon import torrents
from daemon.artifacts import Artifacts
from daemon.board import Board
from daemon.retain import Keeper
from daemon.swarm import SwarmError

log = logging.getLogger("deltaswarm.publish")


class PublishError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Seeder:
    """Receives the chain store, the artifact component, the board and the retention keeper."""

    def __init__(self, store: ChainStore, artifacts: Artifacts, board: Board,
                 keeper: Keeper) -> None:
        self.store = store
        self.artifacts = artifacts
        self.board = board
        self.keeper = keeper
        self.lock = asyncio.Lock()
        self.published: list[dict] = []

    async def start(self) -> None:
        """Seed everything already in the chain (a restarted trainer daemon)."""
        for name in self.store.artifacts():
            m = self.store.manifest(name)
            if self.store.has_blocks(m):
                await asyncio.to_thread(self.artifacts.seed, m, self.store)
            else:
                log.warning("%s: blocks missing from the chain dir, not seeding it", name)

    async def publish(self, version: int) -> dict:
        async with self.lock:
            store = self.store
            head = store.head()
            found = []
            for kind in ("snapshot", "delta"):
                path = store.manifest_dir / f"{artifact_name(version, kind)}.json"
                if path.is_file():
                    found.append(path)
            if not found:
                raise PublishError(404, f"no manifest for v{version} under {store.manifest_dir}; "
                                   "the publisher must write it before calling /v1/publish")
            if head is not None and version < head and store.get(version, "delta") is None \
                    and store.get(version, "snapshot") is None:
                raise PublishError(409, f"v{version} is older than the head v{head}")
            seeded = []
            for path in found:
                try:
                    m = store.add_manifest(path.read_bytes())
                except BadManifest as e:
                    raise PublishError(409, f"{path.name} refused: {e}") from None
                missing = store.missing_blocks(m)
                if missing:
                    raise PublishError(409, f"{m.artifact}: {len(missing)} blocks missing from "
                                       f"{store.blocks.root}, e.g. {missing[0]}")
                try:
                    await asyncio.to_thread(self.artifacts.seed, m, store)
                except (SwarmError, torrents.BadTorrent) as e:
                    raise PublishError(409, f"{m.artifact} could not be seeded: {e}") from None
                seeded.append(m.artifact)
            self.published.append({"version": version, "artifacts": seeded})
            del self.published[:-50]
            await self.board.bump()
            dropped = await asyncio.to_thread(self.keeper.run)
            for a in dropped:
                self.artifacts.forget(a)
            log.info("published v%d: seeding %s%s", version, seeded,
                     f", retention dropped {dropped}" if dropped else "")
            return {"version": version, "artifacts": seeded, "head": store.head(),
                    "dropped": dropped}


def current_of_head(store: ChainStore) -> dict | None:
    """The trainer's "current": the newest version it seeds (it holds no weight directory)."""
    head = store.head()
    if head is None:
        return None
    m = store.get(head, "delta") or store.get(head, "snapshot")
    if m is None:
        return None
    return {"version": m.version, "state_digest": m.state_digest, "path": None}
