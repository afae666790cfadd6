"""Bans for bad data: one record per (peer BitTorrent endpoint, artifact), with a reason and an
expiry, kept in `<state_dir>/bans.json` (written atomically) so a restart does not forgive.

A record is made only when libtorrent names the peer that sent bytes failing the v2 hash check
(daemon/bittorrent/swarm.py says when it can); a hash failure alone never bans anyone. The swarm
enforces a
record on that artifact's torrent only, so the same peer keeps trading every other artifact, and
so does any other daemon behind the same address.
"""

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from chain.atomic import write_atomic

log = logging.getLogger("deltaswarm.bans")
MAX_BANS = 10_000
"""Most records kept; past it the ones closest to expiry go first (a flood cannot fill the disk)."""


@dataclass(frozen=True)
class BanRecord:
    endpoint: str
    """`ip:port` (`[v6]:port`) as libtorrent saw the peer."""
    artifact: str
    reason: str
    since: float
    """Unix time the ban was made."""
    expires: float
    """Unix time it ends."""

    @property
    def key(self) -> tuple[str, str]:
        return self.endpoint, self.artifact

    @property
    def ip(self) -> str:
        return self.endpoint.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.endpoint.rpartition(":")[2])


class BanList:
    """The node's bad-data bans. Not thread-safe: the artifact component calls it from the loop."""

    def __init__(self, path: Path, expiry_s: float) -> None:
        self.path = Path(path)
        self.expiry_s = expiry_s
        self.issued = 0
        """Bans made since start (a counter for metrics)."""
        self._bans: dict[tuple[str, str], BanRecord] = {}
        self._load()

    def _load(self) -> None:
        if not self.path.is_file():
            return
        try:
            rows = json.loads(self.path.read_bytes())
            recs = [BanRecord(str(r["endpoint"]), str(r["artifact"]), str(r["reason"]),
                              float(r["since"]), float(r["expires"])) for r in rows]
        except (ValueError, TypeError, KeyError) as e:
            # Our own file, written atomically: damage means the disk. Losing bans only
            # forgives peers early, so start empty and say so rather than refuse to start.
            log.warning("%s is unreadable (%s); starting with no bans", self.path, e)
            return
        now = time.time()
        self._bans = {r.key: r for r in recs if r.expires > now}

    def _save(self) -> None:
        rows = [asdict(r) for r in sorted(self._bans.values(), key=lambda r: r.key)]
        write_atomic(self.path, json.dumps(rows, indent=0).encode())

    def add(self, endpoint: str, artifact: str, reason: str,
            now: float | None = None) -> BanRecord:
        """Ban `endpoint` on `artifact` for `expiry_s` from now (a repeat extends it)."""
        now = time.time() if now is None else now
        rec = BanRecord(endpoint, artifact, reason[:300], now, now + self.expiry_s)
        old = self._bans.get(rec.key)
        if old is not None:
            rec = BanRecord(endpoint, artifact, rec.reason, old.since, rec.expires)
        self._bans[rec.key] = rec
        if len(self._bans) > MAX_BANS:
            for r in sorted(self._bans.values(), key=lambda r: r.expires)[:len(self._bans)
                                                                          - MAX_BANS]:
                del self._bans[r.key]
        self.issued += 1
        self._save()
        log.warning("banned %s on %s until %s: %s", endpoint, artifact,
                    time.strftime("%H:%M:%S", time.localtime(rec.expires)), rec.reason)
        return rec

    def prune(self, now: float | None = None) -> set[str]:
        """Drop expired bans; returns the artifacts whose ban set changed."""
        now = time.time() if now is None else now
        gone = [r for r in self._bans.values() if r.expires <= now]
        for r in gone:
            del self._bans[r.key]
            log.info("ban of %s on %s expired", r.endpoint, r.artifact)
        if gone:
            self._save()
        return {r.artifact for r in gone}

    def forget_artifact(self, artifact: str) -> None:
        """Retention dropped the artifact: its bans mean nothing any more."""
        if any(a == artifact for _, a in self._bans):
            self._bans = {k: r for k, r in self._bans.items() if r.artifact != artifact}
            self._save()

    def endpoints(self, artifact: str, now: float | None = None) -> set[tuple[str, int]]:
        now = time.time() if now is None else now
        return {(r.ip, r.port) for r in self._bans.values()
                if r.artifact == artifact and r.expires > now}

    def active(self, now: float | None = None) -> list[BanRecord]:
        now = time.time() if now is None else now
        return sorted((r for r in self._bans.values() if r.expires > now),
                      key=lambda r: (r.since, r.key))

    def artifacts(self) -> set[str]:
        return {r.artifact for r in self._bans.values()}
