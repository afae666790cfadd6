"""The trainer node's side of publishing: seed the versions the local publisher wrote.

The publisher (trainer/publisher.py) writes blocks and signed manifests into
`<state_dir>/chain`, then calls `POST /v1/publish {"version": N}`. Here the manifests of that
version are verified against the pinned key, their blocks checked present, the torrents built
and seeded, the head bumped (long-polls wake), and retention applied.
"""

import asyncio
import logging
from typing import TYPE_CHECKING

from chain.errors import BadManifest
from chain.manifest import Manifest, artifact_name
from chain.policy import Retention
from daemon import torrents
from daemon.swarm import SwarmError

if TYPE_CHECKING:
    from daemon.node import Node

log = logging.getLogger("deltaswarm.publish")


class PublishError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Seeder:
    def __init__(self, node: "Node") -> None:
        self.node = node
        self.lock = asyncio.Lock()
        self.published: list[dict] = []

    async def start(self) -> None:
        """Seed everything already in the chain (a restarted trainer daemon)."""
        for name in self.node.store.artifacts():
            m = self.node.store.manifest(name)
            if self.node.store.has_blocks(m):
                await asyncio.to_thread(self._seed, m)
            else:
                log.warning("%s: blocks missing from the chain dir, not seeding it", name)

    async def publish(self, version: int) -> dict:
        async with self.lock:
            store = self.node.store
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
                    await asyncio.to_thread(self._seed, m)
                except (SwarmError, torrents.BadTorrent) as e:
                    raise PublishError(409, f"{m.artifact} could not be seeded: {e}") from None
                seeded.append(m.artifact)
            self.published.append({"version": version, "artifacts": seeded})
            del self.published[:-50]
            await self.node.board.bump()
            dropped = await asyncio.to_thread(
                store.gc, Retention(versions=self.node.cfg.retention.versions))
            for a in dropped:
                self.node.forget_artifact(a)
            log.info("published v%d: seeding %s%s", version, seeded,
                     f", retention dropped {dropped}" if dropped else "")
            return {"version": version, "artifacts": seeded, "head": store.head(),
                    "dropped": dropped}

    def _seed(self, m: Manifest) -> None:
        node = self.node
        if m.artifact in node.swarm.artifacts():
            return
        paths = [(b.id, node.store.blocks.path(b.id)) for b in m.blocks]
        torrents.link_blocks(m.artifact, paths, node.paths.swarm)
        tpath = node.paths.torrents / f"{m.artifact}.torrent"
        expected = [(b.id, b.size, b.root) for b in m.blocks]
        raw = tpath.read_bytes() if tpath.is_file() else None
        if raw is not None:
            try:
                torrents.check_torrent_against(raw, expected, m.artifact)
            except torrents.BadTorrent:
                raw = None
        if raw is None:
            raw = torrents.make_torrent(m.artifact, paths, node.cfg.bittorrent.piece_size)
            torrents.check_torrent_against(raw, expected, m.artifact)
            node.write_file(tpath, raw)
        node.swarm.seed(m.artifact, raw, node.paths.swarm)


def current_of_head(node: "Node") -> dict | None:
    head = node.store.head()
    if head is None:
        return None
    m = node.store.get(head, "delta") or node.store.get(head, "snapshot")
    if m is None:
        return None
    return {"version": m.version, "state_digest": m.state_digest, "path": None}
