"""The trainer node's side of publishing: seed the versions the local publisher wrote.

The publisher (trainer/publisher.py) writes blocks and signed manifests into
`<state_dir>/chain`, then calls `POST /v1/publish {"version": N}`. Here the manifests of that
version are verified against the pinned key, their blocks checked present, the torrents built
and seeded, the head bumped (long-polls wake), and retention applied: one decision
(daemon/versions/retain.py) that keeps what live regions behind still need and records its inputs
for
the publisher.

Versions written while the daemon was down or starting (the publisher's notify failed: the
daemon scans the chain dir before it listens) are picked up by `catch_up`: at start, once the
daemon listens, and on every publish, every manifest in the chain dir not seeded yet is verified
and seeded (issue 11 chaos finding: such a version was never seeded).
"""

import asyncio
import logging

from chain.errors import BadManifest
from chain.manifest import artifact_name, parse_artifact
from chain.store import ChainStore
from daemon.bittorrent import torrents
from daemon.bittorrent.artifacts import Artifacts
from daemon.bittorrent.swarm import SwarmError
from daemon.versions.longpoll import Board
from daemon.versions.retain import Keeper

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
        self.caught_up: list[str] = []
        """Artifacts `catch_up` found unseeded in the chain dir and seeded (status)."""
        self._warned: set[str] = set()

    async def start(self) -> None:
        """Seed everything already in the chain (a restarted trainer daemon)."""
        await self.catch_up()

    async def catch_up(self) -> list[str]:
        """Seed every artifact in the chain dir that is not seeded yet; see `_catch_up`."""
        async with self.lock:
            return await self._catch_up()

    async def _catch_up(self, skip: int | None = None) -> list[str]:
        """Each manifest file in the chain dir not seeded yet, oldest first: verified against
        the pinned key and the chain (add_manifest), its blocks checked present, seeded. One
        that cannot be is logged once and skipped (the publish asked for still succeeds);
        long-polls wake when the head moved. `skip`: the version a publish call seeds itself
        (its errors are that call's answer)."""
        head = self.store.head()
        seeding = set(self.artifacts.seeding())
        found = []
        for path in self.store.manifest_dir.glob("v*.json"):
            try:
                found.append((parse_artifact(path.name.removesuffix(".json")), path))
            except BadManifest:
                continue  # not a manifest (a temp file of an atomic write)
        seeded = []
        for (version, kind), path in sorted(found):
            name = artifact_name(version, kind)
            if name in seeding or version == skip:
                continue
            try:
                m = self.store.get(version, kind) or await asyncio.to_thread(
                    self.store.add_manifest, path.read_bytes())
                missing = self.store.missing_blocks(m)
                if missing:
                    raise PublishError(409, f"{len(missing)} blocks missing from "
                                       f"{self.store.blocks.root}, e.g. {missing[0]}")
                await asyncio.to_thread(self.artifacts.seed, m, self.store)
            except (OSError, BadManifest, PublishError, SwarmError, torrents.BadTorrent) as e:
                if name not in self._warned:
                    self._warned.add(name)
                    log.warning("%s in the chain dir is not seeded: %s", name, e)
                continue
            self._warned.discard(name)
            seeded.append(name)
        if seeded:
            self.caught_up = (self.caught_up + seeded)[-50:]
            log.info("seeding %s found in the chain dir", seeded)
            if self.store.head() != head:
                await self.board.bump()
        return seeded

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
            # First what the publisher wrote while this daemon could not be told (down, or
            # starting), so the chain is added oldest first.
            earlier = await self._catch_up(skip=version)
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
            log.info("published v%d: seeding %s%s%s", version, seeded,
                     f", and earlier {earlier}" if earlier else "",
                     f", retention dropped {dropped}" if dropped else "")
            return {"version": version, "artifacts": seeded, "head": store.head(),
                    "dropped": dropped, "caught_up": earlier}


def current_of_head(store: ChainStore) -> dict | None:
    """The trainer's "current": the newest version it seeds (it holds no weight directory)."""
    head = store.head()
    if head is None:
        return None
    m = store.get(head, "delta") or store.get(head, "snapshot")
    if m is None:
        return None
    return {"version": m.version, "state_digest": m.state_digest, "path": None}
