"""The artifact/seeding component: the libtorrent swarm, the torrent files and the swarm tree of
block links, behind one object that sync, publish, report and the routes share.

It owns the swarm's thread (libtorrent calls are short but blocking), turns swarm events into
counts (piece failures are counted once, by the swarm), records bad-data bans per (endpoint,
artifact) in the persisted ban list and hands them back to the swarm at start, writes
resume data while something downloads, reseeds what a restarted node holds, and forgets what
retention drops.
"""

import asyncio
import logging
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from chain.atomic import write_atomic
from chain.manifest import Manifest
from chain.store import ChainStore
from daemon.bittorrent import torrents
from daemon.bittorrent.bans import BanList, BanRecord
from daemon.bittorrent.swarm import Swarm, SwarmConfig, SwarmError, SwarmEvent

log = logging.getLogger("deltaswarm.artifacts")


class Artifacts:
    def __init__(self, torrents_dir: Path, swarm_dir: Path, resume_dir: Path,
                 piece_size: int, bans: BanList) -> None:
        self.torrents_dir = torrents_dir
        self.swarm_dir = swarm_dir
        self.resume_dir = resume_dir
        self.piece_size = piece_size
        self.swarm: Swarm | None = None
        self.exec = ThreadPoolExecutor(1, thread_name_prefix="swarm")
        self.bans = bans
        self.on_ban: Callable[[BanRecord], None] = lambda rec: None
        """Told of each new ban (the node complains to the peer, so it re-checks itself)."""
        self.on_bad_piece: Callable[[str], None] = lambda artifact: None
        """Told of a piece failing its hash check on an artifact (self-check of a seed)."""
        self._pruned_at = 0.0

    # --- lifecycle --------------------------------------------------------------------------
    def open(self, config: SwarmConfig) -> Swarm:
        self.swarm = Swarm(config)
        for artifact in self.bans.artifacts():
            self.swarm.set_bans(artifact, self.bans.endpoints(artifact))
        return self.swarm

    async def close(self) -> None:
        await self.save_resume()
        if self.swarm is not None:
            self.swarm.close()
        self.exec.shutdown(wait=True)

    def set_rate_limits(self, upload: int, download: int) -> None:
        if self.swarm is not None:
            self.swarm.set_rate_limits(upload, download)

    async def pump(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            assert self.swarm is not None
            events = await loop.run_in_executor(self.exec, self.swarm.pump, 0.5)
            for ev in events:
                self.handle(ev)
            if time.monotonic() - self._pruned_at > 5.0:
                self._pruned_at = time.monotonic()
                for artifact in self.bans.prune():
                    await loop.run_in_executor(self.exec, self.swarm.set_bans, artifact,
                                               self.bans.endpoints(artifact))

    def handle(self, ev: SwarmEvent) -> None:
        if ev.kind == "banned" and ev.peer and ev.artifact:
            rec = self.bans.add(ev.peer, ev.artifact, ev.detail)
            self.on_ban(rec)
        elif ev.kind == "hash_failed":
            log.warning("swarm %s on %s: %s", ev.kind, ev.artifact, ev.detail)
            if ev.artifact:
                self.on_bad_piece(ev.artifact)
        elif ev.kind == "error":
            log.warning("swarm %s on %s: %s", ev.kind, ev.artifact, ev.detail)

    async def save_resume(self) -> None:
        if self.swarm is None:
            return
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self.exec, self.swarm.save_resume_data, self.resume_dir,
                                       5.0)
        except SwarmError as e:
            log.warning("saving resume data: %s", e)

    async def resume_saver(self, downloading: Callable[[], bool]) -> None:
        """Save resume data every few seconds while something downloads (kill -9 safety)."""
        while True:
            await asyncio.sleep(2.0)
            if downloading():
                await self.save_resume()

    # --- torrents ---------------------------------------------------------------------------
    def torrent_path(self, artifact: str) -> Path:
        return self.torrents_dir / f"{artifact}.torrent"

    def held_torrent(self, m: Manifest) -> bytes | None:
        """The stored torrent of `m` if it matches what the manifest pins (a bad one is removed)."""
        path = self.torrent_path(m.artifact)
        if not path.is_file():
            return None
        raw = path.read_bytes()
        try:
            torrents.check_torrent_against(raw, _pins(m), m.artifact)
            return raw
        except torrents.BadTorrent:
            path.unlink(missing_ok=True)
            return None

    def keep_torrent(self, artifact: str, raw: bytes) -> None:
        write_atomic(self.torrent_path(artifact), raw)

    def check_torrent(self, m: Manifest, raw: bytes) -> None:
        """Raises torrents.BadTorrent unless `raw` is the torrent `m` pins."""
        torrents.check_torrent_against(raw, _pins(m), m.artifact)

    # --- seeding ----------------------------------------------------------------------------
    def seed(self, m: Manifest, store: ChainStore) -> None:
        """Serve an artifact whose blocks are all in the chain store; builds its torrent if none
        is held. Blocking (hashing): call from a thread."""
        assert self.swarm is not None
        if m.artifact in self.swarm.artifacts():
            return
        paths = [(b.id, store.blocks.path(b.id)) for b in m.blocks]
        torrents.link_blocks(m.artifact, paths, self.swarm_dir)
        raw = self.held_torrent(m)
        if raw is None:
            raw = torrents.make_torrent(
                m.artifact, [(b.id, store.blocks.path(b.id), b.root) for b in m.blocks],
                self.piece_size)
            self.check_torrent(m, raw)
            self.keep_torrent(m.artifact, raw)
        self.swarm.seed(m.artifact, raw, self.swarm_dir)

    def reseed(self, store: ChainStore) -> None:
        """A restarted node keeps serving what it fully holds (torrents it already has)."""
        for name in store.artifacts():
            m = store.manifest(name)
            if not self.torrent_path(name).is_file() or not store.has_blocks(m):
                continue
            try:
                self.seed(m, store)
            except (SwarmError, torrents.BadTorrent) as e:
                log.warning("not reseeding %s: %s", name, e)

    def forget(self, artifact: str) -> None:
        """Stop seeding an artifact dropped by retention and delete its swarm files."""
        if self.swarm is not None:
            self.swarm.remove(artifact)
            self.swarm.set_bans(artifact, ())
        self.bans.forget_artifact(artifact)
        shutil.rmtree(self.swarm_dir / artifact, ignore_errors=True)
        self.torrent_path(artifact).unlink(missing_ok=True)
        (self.resume_dir / f"{artifact}.resume").unlink(missing_ok=True)

    def seeding(self) -> list[str]:
        return self.swarm.artifacts() if self.swarm is not None else []

    def held(self) -> list[str]:
        """Artifacts this node holds in full and serves (what peers plan with)."""
        return self.swarm.complete() if self.swarm is not None else []

    def status(self) -> dict:
        if self.swarm is None:
            return {"torrents": {}, "uploaded": 0, "downloaded": 0, "banned": {}, "bans": 0,
                    "hash_failures": 0}
        return self.swarm.status()


def _pins(m: Manifest) -> list[torrents.Block]:
    return [(b.id, b.size, b.root) for b in m.blocks]
