"""Engine first: a verified version reaches the engines as one patch file; the disk follows.

When a delta's blocks have verified, the region decodes it once (chain/decode.py) against its
version on disk overlaid with the patches verified since, checks every tensor digest and the
state digest, and writes the changes as one patch file (chain/patchfile.py) that the local
engines apply to their live weights in place. The version directory on disk is brought forward
later, off the critical path: once `disk_batch_versions` patches wait, or no new version came
for `disk_idle_s`, one journaled pass (WeightsDir.apply_changes) takes the directory from its
version to the newest verified one, from the merged patches, so the disk is written about once
per batch rather than once per version. A kill -9 at any instant leaves the directory on disk
verified (or a journaled staging dir resumed or rebuilt): patches are not kept across a
restart; the region decodes the versions after its disk version again from the blocks it holds
(retention keeps them while the disk lags), and a restarted engine loads the verified disk
version, then follows the patches.

Per version the status shows the phases: verified (blocks held), decoded, patch written, each
engine's serving time, disk current (seconds after verified).
"""

import asyncio
import contextlib
import logging
import shutil
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from chain.decode import NotPatchable, decode_patch, merge
from chain.manifest import BlockEntry, Manifest
from chain.patchfile import Patch, write_patch
from chain.safetensors_io import TensorFiles
from chain.versiondir import read_info
from chain.weights import Current, Progress, WeightsDir

log = logging.getLogger("deltaswarm.engine_first")
GetBlock = Callable[[BlockEntry], bytes]


@dataclass
class Pending:
    manifest: Manifest
    patch: Patch
    path: Path


class EngineFirst:
    """The versions verified and patched but not yet on disk, and their disk catch-up."""

    ENGINES_FIRST_S = 5.0
    """How long a due disk pass waits, at most, for the engines that follow this region to
    serve the newest verified version: the pass reads and writes the whole model, and run
    alongside an engine's patch it slowed that version's serving by half (bench/engine.py, at
    1B). The wait starts when the pass falls due, not per version, so versions arriving faster
    than an engine follows them cannot hold the disk back for longer."""
    FOLLOWING_S = 120.0
    """An engine counts as following this region while it reported serving within this long
    (one that went away stops holding the disk back)."""

    def __init__(self, weights: WeightsDir, patch_dir: Path, get_block: GetBlock, *,
                 enabled: bool = True, batch: int = 4, idle_s: float = 1.0) -> None:
        self.weights = weights
        self.patch_dir = Path(patch_dir)
        self.get_block = get_block
        self.enabled, self.batch, self.idle_s = enabled, max(1, batch), idle_s
        self.engines: dict[str, float] = {}
        """Engine -> when (monotonic) it last said it serves a version of this region."""
        self.held_since: float | None = None
        """When the due disk pass began to wait for the engines (monotonic)."""
        self.pending: list[Pending] = []
        self.phases: OrderedDict[int, dict] = OrderedDict()
        self.lock = asyncio.Lock()
        self.wake = asyncio.Event()
        self.last_verified = 0.0
        self.catch_ups = 0
        self.last_error = ""
        # patches do not outlive the process: after a restart they are decoded again
        shutil.rmtree(self.patch_dir, ignore_errors=True)
        self.patch_dir.mkdir(parents=True, exist_ok=True)

    # --- what is verified ------------------------------------------------------------------
    def verified(self) -> Pending | None:
        return self.pending[-1] if self.pending else None

    def protected(self) -> set[str]:
        """Artifacts the disk still needs to reach the verified version (kept by retention)."""
        return {p.manifest.artifact for p in self.pending}

    def _phase(self, version: int) -> dict:
        ph = self.phases.get(version)
        if ph is None:
            ph = self.phases[version] = {"version": version, "verified_at": time.time(),
                                         "served": {}}
            while len(self.phases) > 50:
                self.phases.popitem(last=False)
        return ph

    def _since(self, version: int) -> float:
        return round(time.time() - self._phase(version)["verified_at"], 3)

    # --- decode ----------------------------------------------------------------------------
    async def decode(self, m: Manifest, progress: Progress | None = None) -> Pending | None:
        """Decode and verify delta `m` into a patch file; None if it is no patch over what
        this region holds (the caller catches up the disk and applies it there)."""
        if not self.enabled or m.kind != "delta":
            return None
        self._phase(m.version)  # its blocks are held and verified: the clock starts here
        async with self.lock:
            disk = self.weights.current()
            if disk is None:
                return None
            t0 = time.monotonic()
            try:
                patch = await asyncio.to_thread(self._decode, m, disk)
            except NotPatchable as e:
                log.info("v%d goes to disk first: %s", m.version, e)
                return None
            ph = self._phase(m.version)
            ph["decoded_s"] = round(time.monotonic() - t0, 3)
            path = self.patch_dir / f"v{m.version:08d}.patch"
            await asyncio.to_thread(write_patch, path, patch)
            ph.update(patch_written_s=self._since(m.version), changes=patch.elements,
                      patch_bytes=path.stat().st_size)
            p = Pending(m, patch, path)
            self.pending.append(p)
            self.last_verified = time.monotonic()
            self.wake.set()
            return p

    def _decode(self, m: Manifest, disk: Current) -> Patch:
        files = TensorFiles(disk.path)
        return decode_patch(m, files, disk.version, read_info(disk.path).tensors,
                            [p.patch for p in self.pending], self.get_block)

    def forget_pending(self) -> None:
        """Drop the patches decoded over the disk version (it is being set aside; with the
        lock held). Engines keep what they applied; the region follows from its rebuild."""
        for p in self.pending:
            p.path.unlink(missing_ok=True)
        self.pending.clear()
        self.held_since = None

    # --- engines ---------------------------------------------------------------------------
    def served(self, engine: str, version: int, how: str) -> None:
        ph = self._phase(version)
        ph["served"][engine] = {"s": self._since(version), "how": how, "at": time.time()}
        self.engines[engine] = time.monotonic()
        self.wake.set()  # a disk pass may have been waiting for this engine

    def _engines_behind(self) -> float | None:
        """Seconds left to wait for an engine that follows this region and has not yet
        served the newest verified version (at most ENGINES_FIRST_S from when the pass fell
        due); None when none is behind or the wait is over."""
        top = self.verified()
        now = time.monotonic()
        following = {e for e, at in self.engines.items() if now - at < self.FOLLOWING_S}
        ph = self.phases.get(top.patch.version) if top is not None else None
        if ph is None or following <= set(ph["served"]):
            return None
        if self.held_since is None:
            self.held_since = now
        left = self.ENGINES_FIRST_S - (now - self.held_since)
        return left if left > 0 else None

    def _batch_ready(self) -> bool:
        return bool(self.pending) and (
            len(self.pending) >= self.batch
            or time.monotonic() - self.last_verified >= self.idle_s)

    def serving_doc(self) -> dict | None:
        """What a polling engine needs to follow the verified version before the disk does."""
        top = self.verified()
        if top is None:
            return None
        return {"version": top.patch.version, "state_digest": top.patch.state_digest,
                "patches": [{"version": p.patch.version, "parent": p.patch.parent,
                             "path": str(p.path)} for p in self.pending]}

    # --- disk ------------------------------------------------------------------------------
    def due(self) -> bool:
        return self._batch_ready() and self._engines_behind() is None

    async def catch_up(self, progress: Progress | None = None) -> Current | None:
        """Bring the directory on disk to the newest verified version now (one pass)."""
        async with self.lock:
            if not self.pending:
                return None
            todo = list(self.pending)
            disk = self.weights.current()
            assert disk is not None
            changes = merge([p.patch for p in todo])
            t0 = time.monotonic()
            cur = await asyncio.to_thread(self.weights.apply_changes, todo[-1].manifest,
                                          disk.version, changes, self.get_block, progress)
            self.catch_ups += 1
            self.held_since = None
            del self.pending[: len(todo)]
            for p in todo:
                ph = self._phase(p.patch.version)
                ph["disk_current_s"] = self._since(p.patch.version)
                ph["disk_batch"] = len(todo)
                p.path.unlink(missing_ok=True)
            log.info("disk at v%d (%d versions in one pass, %.2fs)", cur.version, len(todo),
                     time.monotonic() - t0)
            return cur

    async def loop(self, progress: Progress, on_disk: Callable[[Current], Awaitable[None]]
                   ) -> None:
        """Catch the disk up whenever it is due; errors are kept and retried."""
        while True:
            self.wake.clear()
            if not self.due():
                wait = None  # nothing pending: a new version wakes the loop
                if self.pending and not self._batch_ready():
                    wait = self.idle_s - (time.monotonic() - self.last_verified)
                elif self.pending:
                    wait = self._engines_behind() or 0.05  # served() wakes it sooner
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), None if wait is None
                                           else max(0.05, wait))
                continue
            try:
                cur = await self.catch_up(progress)
            except Exception as e:
                if type(e).__name__ == "Abandoned":
                    return
                self.last_error = f"{type(e).__name__}: {e}"[:400]
                log.warning("disk catch-up failed: %s", self.last_error)
                await asyncio.sleep(1.0)
                continue
            if cur is not None:
                self.last_error = ""
                await on_disk(cur)

    def status(self) -> dict:
        return {"enabled": self.enabled, "pending": [p.patch.version for p in self.pending],
                "catch_ups": self.catch_ups, "last_error": self.last_error or None,
                "versions": list(self.phases.values())[-20:]}
