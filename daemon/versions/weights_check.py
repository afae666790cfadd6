"""Regions check their weights: re-hash every held version directory on a schedule.

An apply verifies each tensor from its old digest and the words the delta touched (chain/
weights.py), and a directory is brought forward in place from its own bytes, so a flipped bit
in an element no version changes is never read again: it would be served, and carried into
every later version written over that directory. Ranks-coded deltas noticed some of it (when
the damage moved an exponent), deltas with directly coded positions none. The start-up check
recomputes every digest; this pass does the same while the daemon runs, every
`self_check.interval_s` within `self_check.bytes_per_s`, beside the served-block self-check
(daemon/bittorrent/selfcheck.py).

The pass reads without stopping the writers, so what it finds is confirmed before anything is
done: the syncer re-hashes the damaged tensors again with every writer of the directory held
(`Syncer.set_aside_damaged`), and only then sets the directory aside as the start-up check does
(the current one quarantined and rebuilt from a snapshot, a spare one deleted). A directory an
apply renamed or rewrote meanwhile is simply checked again at the next pass.
"""

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable

from chain.errors import ChainError
from chain.weights import WeightsDir
from daemon.config import SelfCheckConfig

log = logging.getLogger("deltaswarm.weightscheck")
SetAside = Callable[[int, list[str] | None], Awaitable[str | None]]
"""(version, damaged tensors or None for the whole directory) -> what was done, or None when
the damage did not hold up."""


class Stopping(Exception):
    """The daemon is stopping: the pass ends where it is."""


class WeightsCheck:
    def __init__(self, weights: WeightsDir, cfg: SelfCheckConfig, set_aside: SetAside) -> None:
        self.weights = weights
        self.cfg = cfg
        self.set_aside = set_aside
        self._stopping = False
        self._stop = threading.Event()
        self.state = "idle"
        self.runs = 0
        self.last_run_at: float | None = None
        self.last_seconds: float | None = None
        self.bytes_checked = 0
        self.versions_checked = 0
        self.damaged_found = 0
        """Version directories found damaged and confirmed, since start."""
        self.found: deque[dict] = deque(maxlen=20)

    async def run(self) -> None:
        """A pass every `interval_s` (the start-up check already verified everything)."""
        while not self._stopping:
            await asyncio.sleep(self.cfg.interval_s)
            if self.cfg.weights and not self._stopping:
                await self.check()

    def stop(self) -> None:
        self._stopping = True
        self._stop.set()

    async def check(self) -> None:
        """One pass over every held version directory, newest first (the one engines read)."""
        self.state = "running"
        t0 = time.monotonic()
        try:
            for version in sorted(self.weights.versions(), reverse=True):
                if self._stopping:
                    return
                names: list[str] | None
                try:
                    bad = names = await asyncio.to_thread(self._scan, version)
                except Stopping:
                    return
                except (ChainError, OSError) as e:
                    if not self.weights.path(version).is_dir():
                        continue  # renamed by an apply meanwhile: checked at the next pass
                    bad, names = [f"({type(e).__name__}: {e})"[:300]], None  # unreadable
                self.versions_checked += 1
                if bad:
                    await self._confirm(version, bad, names)
            self.runs += 1
            self.last_run_at = time.time()
            self.last_seconds = round(time.monotonic() - t0, 3)
        finally:
            self.state = "idle"

    def _scan(self, version: int) -> list[str]:
        """Tensors of `version` whose bytes differ from its VERSION.json (thread; paced, and
        woken at once by `stop`)."""
        t0, done = time.monotonic(), 0

        def read(n: int) -> None:
            nonlocal done
            done += n
            self.bytes_checked += n
            if self._stop.wait(max(0.0, done / self.cfg.bytes_per_s - (time.monotonic() - t0))):
                raise Stopping

        return self.weights.damaged(version, read=read)

    async def _confirm(self, version: int, bad: list[str], names: list[str] | None) -> None:
        log.warning("weights check: v%d differs from its digests (%s); checking again with "
                    "the writers held", version, ", ".join(bad[:3]))
        what = await self.set_aside(version, names)
        if what is None:
            return
        self.damaged_found += 1
        self.found.append({"version": version, "tensors": bad[:10], "count": len(bad),
                           "at": round(time.time(), 3), "action": what})

    def status(self) -> dict:
        return {"enabled": self.cfg.weights, "state": self.state, "runs": self.runs,
                "last_run_at": self.last_run_at, "last_seconds": self.last_seconds,
                "bytes_checked": self.bytes_checked, "versions_checked": self.versions_checked,
                "damaged_found": self.damaged_found, "found": list(self.found),
                "bytes_per_s": self.cfg.bytes_per_s, "interval_s": self.cfg.interval_s}

