"""The region's sync loop: newer head → manifests → plan → torrents → swarm download → adopt
blocks → journaled apply → mark current → notify the engine → keep seeding → retention.

Manifests enter only through `ChainStore.add_manifest` (signature, run and parent checks);
refusals are counted with their reason. The plan's artifacts download concurrently and apply in
order in a worker thread; a stop request abandons an apply between tensors (the journal makes
that safe) and downloads keep their resume data.
"""

import asyncio
import contextlib
import logging
import shutil
import time
from collections import Counter, deque
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp

from chain.errors import BadBlock, BadManifest, ChainError, NoPath
from chain.manifest import BlockEntry, Manifest, parse_artifact
from chain.policy import Retention
from daemon import torrents
from daemon.peers import BadPeer, Peer, parse_endpoint
from daemon.report import refusal_kind
from daemon.swarm import SwarmError

if TYPE_CHECKING:
    from daemon.node import Node

log = logging.getLogger("deltaswarm.sync")


class SyncError(RuntimeError):
    """A sync step could not complete (no peer served what was needed); it is retried."""


class Abandoned(Exception):
    """The daemon is stopping; the apply stops between tensors (the journal resumes it)."""


class Syncer:
    def __init__(self, node: "Node") -> None:
        self.node = node
        self.wake = asyncio.Event()
        self.downloads: dict[str, asyncio.Task] = {}
        self.transfers: dict[str, dict] = {}
        self.refused: deque[dict] = deque(maxlen=50)
        self.refused_counts: Counter[str] = Counter()
        self._refused_at: dict[tuple[str, str], float] = {}
        self.failures: Counter[str] = Counter()
        self.applied: deque[dict] = deque(maxlen=50)
        self.bytes_saved = 0
        self.applying: dict | None = None
        self.last_error = ""
        self._notify_pending: tuple[int, Path, str] | None = None
        self._notify_wake = asyncio.Event()

    # --- the loop -------------------------------------------------------------------------
    async def run(self) -> None:
        delay = 1.0
        while not self.node.stopping:
            try:
                progressed = await self.step()
                self.last_error = "" if progressed is not None else self.last_error
                delay = 1.0
            except (ChainError, SyncError, SwarmError, OSError, aiohttp.ClientError,
                    TimeoutError) as e:
                self.last_error = f"{type(e).__name__}: {e}"[:500]
                log.warning("sync step failed: %s", self.last_error)
                delay = min(delay * 2, 15.0)
            except Abandoned:
                return
            self.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), delay)

    async def on_head(self, peer: Peer, reply: dict) -> None:
        self.wake.set()

    def current_version(self) -> int | None:
        cur = self.node.weights.current()
        return None if cur is None else cur.version

    async def step(self) -> int | None:
        node = self.node
        target = max((h for h in (node.book.best_head(), node.store.head()) if h is not None),
                     default=None)
        cur = self.current_version()
        if target is None or (cur is not None and cur >= target):
            return None
        if node.store.head() is None or node.store.head() < target:
            await self.fetch_manifests(target, cur)
        head = node.store.head()
        if head is None or (cur is not None and head <= cur):
            raise SyncError(f"peers report v{target} but no valid manifest past "
                            f"v{cur if cur is not None else 'nothing'} could be fetched")
        try:
            plan = node.store.plan(cur, head)
        except NoPath as e:
            raise SyncError(str(e)) from None
        log.info("plan v%s → v%d: %s", cur, head, [m.artifact for m in plan])
        for m in plan:
            if m.artifact not in self.downloads or self.downloads[m.artifact].cancelled():
                self.downloads[m.artifact] = asyncio.create_task(self.download(m),
                                                                 name=f"dl:{m.artifact}")
        for m in plan:
            task = self.downloads[m.artifact]
            try:
                await asyncio.shield(task)
            finally:
                if task.done():
                    self.downloads.pop(m.artifact, None)
            await self.apply(m)
        await self.gc()
        return head

    # --- manifests ------------------------------------------------------------------------
    async def fetch_manifests(self, target: int, cur: int | None) -> None:
        node = self.node
        for peer in node.book.by_head(target):
            try:
                index = await node.get_json(f"{peer.url}/v1/chain/index")
                self._learn_from_index(peer, index)
                names = index.get("artifacts")
                if not isinstance(names, list):
                    raise BadPeer("index has no artifact list")
                want = []
                for name in names:
                    try:
                        version, kind = parse_artifact(name)
                    except (BadManifest, TypeError):
                        continue
                    if (version > (cur if cur is not None else -1) and version <= target
                            and node.store.get(version, kind) is None
                            and not self._recently_refused(peer.url, name)):
                        want.append((version, kind, name))
                for _, _, name in sorted(want):
                    raw = await node.get_bytes(f"{peer.url}/v1/chain/manifests/{name}")
                    self._add_manifest(peer.url, name, raw)
                peer.failures = 0
            except (aiohttp.ClientError, TimeoutError, BadPeer, ValueError) as e:
                peer.failures += 1
                peer.last_error = f"{type(e).__name__}: {e}"[:300]
                continue
            if (node.store.head() or -1) >= target:
                return

    def _learn_from_index(self, peer: Peer, index: dict) -> None:
        if not isinstance(index, dict):
            raise BadPeer("index reply is not a JSON object")
        if index.get("bt"):
            self.node.book.learn(peer.url, parse_endpoint(index["bt"]))
        for p in index.get("peers") or []:
            if isinstance(p, dict) and isinstance(p.get("url"), str):
                with contextlib.suppress(BadPeer):
                    bt = parse_endpoint(p["bt"]) if p.get("bt") else None
                    node = p.get("node") if isinstance(p.get("node"), str) else None
                    self.node.book.learn(p["url"], bt, node)

    def _add_manifest(self, source: str, name: str, raw: bytes) -> Manifest | None:
        try:
            m = self.node.store.add_manifest(raw)
            if m.artifact != name:
                raise BadManifest(f"asked for {name}, the peer served {m.artifact}")
        except BadManifest as e:
            self.refuse(source, name, e)
            return None
        log.info("accepted manifest %s from %s", name, source)
        return m

    def refuse(self, source: str, name: str, err: BadManifest) -> None:
        error = type(err).__name__
        self.refused_counts[refusal_kind(error, str(err))] += 1
        self._refused_at[(source, name)] = time.monotonic()
        self.refused.append({"artifact": name, "source": source, "error": error,
                             "reason": str(err)[:400], "time": round(time.time(), 3)})
        log.warning("refused manifest %s from %s: %s", name, source, err)

    def _recently_refused(self, source: str, name: str) -> bool:
        at = self._refused_at.get((source, name))
        return at is not None and time.monotonic() - at < 60.0

    # --- transfer -------------------------------------------------------------------------
    async def torrent_bytes(self, m: Manifest) -> bytes:
        node = self.node
        path = node.paths.torrents / f"{m.artifact}.torrent"
        expected = [(b.id, b.size, b.root) for b in m.blocks]
        if path.is_file():
            raw = path.read_bytes()
            try:
                torrents.check_torrent_against(raw, expected, m.artifact)
                return raw
            except torrents.BadTorrent:
                path.unlink()
        for peer in node.book.by_head(m.version):
            try:
                raw = await node.get_bytes(f"{peer.url}/v1/chain/torrents/{m.artifact}")
                torrents.check_torrent_against(raw, expected, m.artifact)
            except torrents.BadTorrent as e:
                self.failures["torrent"] += 1
                log.warning("torrent of %s from %s refused: %s", m.artifact, peer.url, e)
                continue
            except (aiohttp.ClientError, TimeoutError, ValueError):
                continue
            await asyncio.to_thread(node.write_file, path, raw)
            return raw
        raise SyncError(f"no peer served a valid torrent for {m.artifact}")

    async def download(self, m: Manifest) -> None:
        node, swarm = self.node, self.node.swarm
        save = node.paths.swarm
        tb = await self.torrent_bytes(m)
        held = [(b.id, node.store.blocks.path(b.id)) for b in m.blocks
                if node.store.blocks.has(b.id)]
        if held:
            await asyncio.to_thread(torrents.link_blocks, m.artifact, held, save)
        info = self.transfers.setdefault(m.artifact, {"artifact": m.artifact, "total": 0,
                                                      "resumed_bytes": None, "started": time.time(),
                                                      "seconds": None, "downloaded": 0})
        if m.artifact not in swarm.artifacts():
            resume = swarm.load_resume_data(node.paths.resume, m.artifact)
            swarm.download(m.artifact, tb, save, peers=node.book.bt_endpoints(),
                           resume_data=resume)
            log.info("downloading %s (%d bytes, resume data: %s)", m.artifact, m.payload_bytes,
                     resume is not None)
        known: set = set()
        t0 = time.monotonic()
        while True:
            p = swarm.progress(m.artifact)
            info.update(total=p.total, done=p.done, downloaded=p.downloaded, state=p.state)
            if info["resumed_bytes"] is None and "checking" not in p.state:
                info["resumed_bytes"] = p.done
            if p.finished:
                break
            endpoints = set(node.book.bt_endpoints())
            if endpoints - known:
                swarm.add_peers(m.artifact, endpoints - known)
                known = endpoints
            elif time.monotonic() - t0 > 10:
                swarm.add_peers(m.artifact, endpoints)
                t0 = time.monotonic()
            await asyncio.sleep(0.2)
        info["seconds"] = round(time.time() - info["started"], 3)
        try:
            await asyncio.to_thread(self._adopt, m)
        except BadBlock as e:
            self.failures["block"] += 1
            swarm.remove(m.artifact)
            shutil.rmtree(save / m.artifact, ignore_errors=True)
            raise SyncError(f"{m.artifact}: downloaded data failed the block check ({e}); "
                            "refetching") from None
        log.info("downloaded %s in %.2fs (%d payload bytes this run)", m.artifact,
                 info["seconds"], info["downloaded"])

    def _adopt(self, m: Manifest) -> None:
        save = self.node.paths.swarm
        for b in m.blocks:
            self.node.store.blocks.adopt(b.id, torrents.block_path(save, m.artifact, b.id), b.size)

    # --- apply ----------------------------------------------------------------------------
    async def apply(self, m: Manifest) -> None:
        node = self.node
        cur = self.current_version()
        if cur is not None and cur >= m.version:
            return
        self.applying = {"artifact": m.artifact, "done": 0, "total": len(m.tensors)}

        def progress(artifact: str, done: int, total: int) -> None:
            self.applying = {"artifact": artifact, "done": done, "total": total}
            if node.stopping:
                raise Abandoned(f"stopping during {artifact} at tensor {done}/{total}")

        def get_block(b: BlockEntry) -> bytes:
            return node.store.blocks.get(b.id, b.size)

        t0 = time.monotonic()
        try:
            current = await asyncio.to_thread(node.weights.apply, [m], get_block, progress)
        except Abandoned:
            log.info("apply of %s abandoned for shutdown; the journal resumes it", m.artifact)
            raise
        except ChainError as e:
            self.failures["tensor"] += 1
            raise SyncError(f"applying {m.artifact} failed verification: {e}") from None
        finally:
            self.applying = None
        seconds = time.monotonic() - t0
        full = sum(t.nbytes for t in m.tensors) + sum(f.size for f in m.files)
        if m.kind == "delta":
            self.bytes_saved += max(0, full - m.payload_bytes)
        self.applied.append({"artifact": m.artifact, "version": m.version,
                             "bytes": m.payload_bytes, "full_bytes": full,
                             "apply_seconds": round(seconds, 3), "time": round(time.time(), 3)})
        log.info("v%d current (%s, digest %s…, %.2fs)", current.version, m.artifact,
                 current.state_digest[:12], seconds)
        await node.board.bump()
        self._notify_pending = (current.version, current.path, current.state_digest)
        self._notify_wake.set()

    async def notify_loop(self) -> None:
        """Tell the engine about the newest current version (latest wins, in order)."""
        while True:
            await self._notify_wake.wait()
            self._notify_wake.clear()
            pending, self._notify_pending = self._notify_pending, None
            if pending is not None:
                await self.node.notifier.notify(*pending)

    # --- retention ------------------------------------------------------------------------
    async def gc(self) -> None:
        node = self.node
        cur = self.current_version()
        protect = set(self.downloads)
        if cur is not None:
            protect |= {a for a in node.store.artifacts() if parse_artifact(a)[0] == cur}
        dropped = await asyncio.to_thread(
            node.store.gc, Retention(versions=node.cfg.retention.versions), protect)
        for a in dropped:
            node.forget_artifact(a)
            self.transfers.pop(a, None)
        if dropped:
            log.info("retention dropped %s", dropped)

    def status(self) -> dict:
        return {"refused": list(self.refused), "refused_counts": dict(self.refused_counts),
                "failures": dict(self.failures),
                "applied": list(self.applied), "bytes_saved": self.bytes_saved,
                "applying": self.applying, "transfers": dict(self.transfers),
                "last_error": self.last_error}
