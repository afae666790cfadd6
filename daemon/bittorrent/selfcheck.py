"""Seeders check themselves: re-verify the blocks this node serves, and refetch a corrupt one.

A block is named by the xxh3-128 of its bytes and pinned by the signed manifest, so each served
file (`swarm/<artifact>/ab/<id>`, a hard link of the chain store's block) is read back and
hashed: once at start, every `interval_s` (a clock that requests never move), and at once for an
artifact when a piece of ours fails libtorrent's check while seeding or a peer complains that we
sent it bad data. Reads stay within `bytes_per_s`, so a pass never starves serving or applying.
A corrupt block stops being served at once (the torrent is removed), its file and store copy are
deleted, and the artifact is fetched again from the swarm; libtorrent rechecks what is on disk
and downloads only the pieces that are missing, and the refetched blocks enter the store only
after their id verifies.
"""

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from chain.digest import block_id
from chain.errors import BadBlock
from chain.manifest import Manifest
from chain.store import ChainStore
from daemon.bittorrent import torrents
from daemon.bittorrent.artifacts import Artifacts
from daemon.bittorrent.swarm import SwarmError
from daemon.config import SelfCheckConfig

log = logging.getLogger("deltaswarm.selfcheck")
Endpoint = tuple[str, int]
REQUEST_GAP_S = 10.0
"""A triggered check of one artifact runs at most this often (a complaining liar costs reads,
bounded by this and the budget)."""


class SelfCheck:
    def __init__(self, store: ChainStore, artifacts: Artifacts, cfg: SelfCheckConfig,
                 peers: Callable[[], list[Endpoint]],
                 busy: Callable[[str], bool] = lambda artifact: False) -> None:
        self.store = store
        self.artifacts = artifacts
        self.cfg = cfg
        self.peers = peers
        self.busy = busy
        """True for an artifact sync is fetching (not ours to check yet)."""
        self.wake = asyncio.Event()
        self._wanted: dict[str, str] = {}
        self._asked_at: dict[str, float] = {}
        self._stopping = False
        self.next_pass_at = 0.0
        """Monotonic time of the next scheduled pass (set when `run` starts)."""
        self.state = "idle"
        self.runs = 0
        self.last_run_at: float | None = None
        self.last_seconds: float | None = None
        self.last_trigger: str | None = None
        self.bytes_checked = 0
        self.blocks_checked = 0
        self.corrupt_found = 0
        self.repaired = 0
        self.corrupt: deque[dict] = deque(maxlen=20)

    # --- triggers ---------------------------------------------------------------------------
    def request(self, artifact: str, trigger: str) -> bool:
        """Check one served artifact soon; False if not served here or asked too recently."""
        if not self._served(artifact):
            return False
        now = time.monotonic()
        if now - self._asked_at.get(artifact, -REQUEST_GAP_S) < REQUEST_GAP_S:
            return False
        self._asked_at[artifact] = now
        self._wanted[artifact] = trigger
        self.wake.set()
        log.info("self-check of %s requested (%s)", artifact, trigger)
        return True

    def _served(self, artifact: str) -> bool:
        swarm = self.artifacts.swarm
        return (swarm is not None and artifact in swarm.artifacts()
                and swarm.is_complete(artifact) and not self.busy(artifact))

    # --- the loop ---------------------------------------------------------------------------
    async def run(self) -> None:
        """The start pass, then a scheduled pass every `interval_s` on a clock of its own:
        requested checks run in between and never move it (issue 20, finding 6: a complaint
        more often than `interval_s` used to restart the wait, so the full pass never ran)."""
        if self.cfg.on_start:
            await self.check(None, "start")
        self.next_pass_at = time.monotonic() + self.cfg.interval_s
        while not self._stopping:
            self.wake.clear()
            left = self.next_pass_at - time.monotonic()
            if left > 0 and not self._wanted:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), left)
            wanted, self._wanted = self._wanted, {}
            for artifact, trigger in sorted(wanted.items()):
                await self.check([artifact], trigger)
            if time.monotonic() >= self.next_pass_at and not self._stopping:
                await self.check(None, "schedule")
                self.next_pass_at = time.monotonic() + self.cfg.interval_s

    def stop(self) -> None:
        self._stopping = True

    async def check(self, only: list[str] | None, trigger: str) -> None:
        """One pass over the served artifacts (or `only` these); repairs what it finds."""
        self.state, self.last_trigger = "running", trigger
        t0 = time.monotonic()
        try:
            names = only if only is not None else sorted(self.store.artifacts())
            for name in names:
                if self._stopping:
                    return
                if not self._served(name):
                    continue
                try:
                    m = self.store.manifest(name)
                except Exception:
                    continue
                bad = await asyncio.to_thread(self._scan, m)
                if bad:
                    await self.repair(m, bad)
            self.runs += 1
            self.last_run_at = time.time()
            self.last_seconds = round(time.monotonic() - t0, 3)
        finally:
            self.state = "idle"

    def _scan(self, m: Manifest) -> list[str]:
        """Ids of the served blocks of `m` whose bytes no longer match (thread; paced)."""
        save = self.artifacts.swarm_dir
        bad, t0, read = [], time.monotonic(), 0
        for b in m.blocks:
            if self._stopping:
                break
            path = torrents.block_path(save, m.artifact, b.id)
            try:
                data = path.read_bytes()
            except OSError:
                data = b""
            read += len(data)
            self.bytes_checked += len(data)
            self.blocks_checked += 1
            if len(data) != b.size or block_id(data) != b.id:
                bad.append(b.id)
            time.sleep(max(0.0, read / self.cfg.bytes_per_s - (time.monotonic() - t0)))
        return bad

    # --- repair -----------------------------------------------------------------------------
    async def repair(self, m: Manifest, bad: list[str]) -> None:
        """Stop serving `m`, drop the corrupt blocks, fetch them again from the swarm."""
        now = time.time()
        self.corrupt_found += len(bad)
        found = [{"artifact": m.artifact, "block": b, "at": round(now, 3), "repaired": False}
                 for b in bad]
        self.corrupt.extend(found)
        log.error("self-check: %d corrupt block(s) of %s on disk (%s); no longer serving it, "
                  "refetching from the swarm", len(bad), m.artifact, ", ".join(bad[:3]))
        swarm = self.artifacts.swarm
        assert swarm is not None
        tb = await asyncio.to_thread(self.artifacts.held_torrent, m)
        await asyncio.to_thread(swarm.remove, m.artifact)
        save = self.artifacts.swarm_dir
        for bid in bad:
            torrents.block_path(save, m.artifact, bid).unlink(missing_ok=True)
            self.store.blocks.delete(bid)
        if tb is None:
            log.error("self-check: no torrent held for %s; it will not be served again", m.artifact)
            return
        try:
            await self._refetch(m, tb, save)
        except (SwarmError, BadBlock) as e:
            log.error("self-check: refetching %s failed: %s", m.artifact, e)
            return
        for f in found:
            f["repaired"] = True
        self.repaired += len(bad)
        log.info("self-check: %s repaired (%d block(s) refetched and verified)", m.artifact,
                 len(bad))

    async def _refetch(self, m: Manifest, tb: bytes, save: Path) -> None:
        swarm = self.artifacts.swarm
        assert swarm is not None
        await asyncio.to_thread(swarm.download, m.artifact, tb, save, self.peers())
        last_dial = time.monotonic()
        while not self._stopping:
            if swarm.progress(m.artifact).finished:  # SwarmError if retention dropped it
                break
            if time.monotonic() - last_dial > 5.0:
                swarm.add_peers(m.artifact, self.peers())
                last_dial = time.monotonic()
            await asyncio.sleep(0.2)
        else:
            return
        for b in m.blocks:
            if not self.store.blocks.has(b.id):
                await asyncio.to_thread(self.store.blocks.adopt, b.id,
                                        torrents.block_path(save, m.artifact, b.id), b.size)

    def status(self) -> dict:
        return {"state": self.state, "runs": self.runs, "last_run_at": self.last_run_at,
                "last_seconds": self.last_seconds, "last_trigger": self.last_trigger,
                "bytes_checked": self.bytes_checked, "blocks_checked": self.blocks_checked,
                "corrupt_found": self.corrupt_found, "repaired": self.repaired,
                "corrupt": list(self.corrupt), "bytes_per_s": self.cfg.bytes_per_s,
                "interval_s": self.cfg.interval_s}
