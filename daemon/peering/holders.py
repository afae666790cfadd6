"""Who holds what, for planning (issue 11): the artifacts each peer's index lists as held in full,
how long each of those listings counts (`unoffered_timeout_s`), and the artifacts this region gave
up on for a while (a download without progress, an artifact nobody lists or serves), so plans go
around them to a later snapshot plus deltas instead of waiting forever.
"""

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable

from daemon.config import SyncConfig

log = logging.getLogger("deltaswarm.sync")
INDEX_REFRESH_S = 2.0
"""A peer's index is re-read for planning at most this often, unless it now claims a newer head
than the one it listed."""


class Holders:
    def __init__(self, settings: SyncConfig) -> None:
        self.settings = settings
        self.listed: dict[str, tuple[float, int | None, frozenset[str]]] = {}
        """peer url → (monotonic time read, head it listed, artifacts it listed as held)."""
        self.given_up: dict[str, dict] = {}
        self._unoffered: dict[str, float] = {}
        self._no_torrent: dict[str, float] = {}

    def record(self, url: str, head: int | None, held: Iterable[str]) -> None:
        self.listed[url] = (time.monotonic(), head, frozenset(held))

    def extend(self, url: str, head: int, held: Iterable[str]) -> None:
        """Take a peer to hold `held` too, up to `head`, without reading its index (an
        inference: daemon/versions/sync.py says when it is made)."""
        _, _, before = self.listed.get(url, (0.0, None, frozenset()))
        self.listed[url] = (time.monotonic(), head, before | frozenset(held))

    def listed_head(self, url: str) -> int | None:
        """The head a peer's listing (read or extended) was last taken at."""
        got = self.listed.get(url)
        return None if got is None else got[1]

    def stale(self, url: str, claimed_head: int | None) -> bool:
        got = self.listed.get(url)
        return got is None or time.monotonic() - got[0] > INDEX_REFRESH_S or (
            claimed_head is not None and (got[1] is None or got[1] < claimed_head))

    def counts(self, usable: Callable[[str], bool], local: Iterable[str]) -> dict[str, int]:
        """Per artifact: the peers (`usable(url)`) whose index listed it as held within
        `unoffered_timeout_s`, plus one for a `local` copy; 0 for what was given up lately and
        is not held here, unless a peer that did not list it then lists it now (a restarted
        holder is back: the cheap path is worth trying again)."""
        counts: Counter[str] = Counter()
        by: dict[str, set[str]] = {}
        for url in self.fresh(usable):
            held = self.listed[url][2]
            counts.update(held)
            for name in held & self.given_up.keys():
                by.setdefault(name, set()).add(url)
        local = set(local)
        counts.update(local)
        now = time.monotonic()
        for name, g in list(self.given_up.items()):
            if g["until"] <= now or by.get(name, set()) - g["by"]:
                del self.given_up[name]
            elif name not in local:
                counts[name] = 0
        return dict(counts)

    def fresh(self, usable: Callable[[str], bool]) -> list[str]:
        """Peers whose listing counts: read within `unoffered_timeout_s`, and usable."""
        now = time.monotonic()
        return [url for url, (at, _, _) in self.listed.items()
                if now - at <= self.settings.unoffered_timeout_s and usable(url)]

    def holding(self, artifact: str, usable: Callable[[str], bool]) -> list[str]:
        """Peers (`usable(url)`) whose listing counts now and names `artifact` as held."""
        return [url for url in self.fresh(usable) if artifact in self.listed[url][2]]

    def give_up(self, artifact: str, reason: str) -> None:
        """Plan around `artifact` for a while; the peers listing it now are remembered, so only
        a holder that was not listing it then brings it back early."""
        hold = 2 * max(self.settings.progress_timeout_s, self.settings.unoffered_timeout_s)
        by = {url for url in self.fresh(lambda url: True) if artifact in self.listed[url][2]}
        self.given_up[artifact] = {"reason": reason, "at": round(time.time(), 3),
                                   "until": time.monotonic() + hold, "by": by}
        self._unoffered.pop(artifact, None)
        self._no_torrent.pop(artifact, None)
        log.warning("giving up on %s for %.1fs: %s; replanning around it", artifact, hold,
                    reason)

    def note_plan(self, names: list[str], counts: dict[str, int]) -> None:
        """Start or continue the clock of each planned artifact no peer lists; give it up once
        that lasted `unoffered_timeout_s`."""
        now = time.monotonic()
        for a in names:
            if counts.get(a, 0) > 0 or a in self.given_up:
                self._unoffered.pop(a, None)
                continue
            since = self._unoffered.setdefault(a, now)
            if now - since >= self.settings.unoffered_timeout_s:
                self.give_up(a, f"no peer has listed it as held for {now - since:.0f}s")

    def torrent_missing(self, artifact: str) -> None:
        since = self._no_torrent.setdefault(artifact, time.monotonic())
        waited = time.monotonic() - since
        if waited >= self.settings.unoffered_timeout_s:
            self.give_up(artifact, f"no peer served its torrent for {waited:.0f}s")

    def torrent_found(self, artifact: str) -> None:
        self._no_torrent.pop(artifact, None)

    def forget(self, artifact: str) -> None:
        for d in (self.given_up, self._unoffered, self._no_torrent):
            d.pop(artifact, None)

    def status(self) -> dict:
        now = time.monotonic()
        return {a: {"reason": g["reason"], "at": g["at"]}
                for a, g in self.given_up.items() if g["until"] > now}
