"""Which versions the nodes polling this daemon hold: each region's head long-poll carries
`node`, `region` and `have` (its current version), so any daemon, the trainer's above all, knows
who is behind without another round trip. Retention keeps what those live nodes still need
(chain.policy.Retention.decide); a node that stops polling ages out after `within_s`.
Only polls signed by the named node's own key are recorded here (daemon/app.py
`record_poller`, daemon/peering/identity.py): another token holder cannot speak for a node.
"""

import time
from collections import OrderedDict
from dataclasses import dataclass

MAX_NODES = 10_000
"""Most nodes remembered (oldest forgotten first): a flood of names cannot grow memory."""


@dataclass
class Seen:
    node: str
    region: str | None
    have: int | None
    at: float
    """Unix time of the last poll."""


class LiveNodes:
    def __init__(self, within_s: float = 120.0) -> None:
        self.within_s = within_s
        self._seen: OrderedDict[str, Seen] = OrderedDict()
        self.unsigned = 0
        """Polls naming a node but not signed by its pinned key (not recorded: daemon/app.py)."""

    def seen(self, node: str, region: str | None, have: int | None,
             now: float | None = None) -> None:
        self._seen.pop(node, None)
        self._seen[node] = Seen(node, region, have, time.time() if now is None else now)
        while len(self._seen) > MAX_NODES:
            self._seen.popitem(last=False)

    def versions(self, now: float | None = None) -> list[int | None]:
        """Versions held by nodes seen within `within_s` (None: a node holding nothing yet)."""
        now = time.time() if now is None else now
        return [s.have for s in self._seen.values() if now - s.at <= self.within_s]

    def held(self, now: float | None = None) -> dict[str, int | None]:
        """Node name -> version held, for the nodes seen within `within_s`."""
        now = time.time() if now is None else now
        return {s.node: s.have for s in self._seen.values() if now - s.at <= self.within_s}

    def snapshot(self, now: float | None = None) -> list[dict]:
        now = time.time() if now is None else now
        return [{"node": s.node, "region": s.region, "have": s.have,
                 "seen_s_ago": round(now - s.at, 1)}
                for s in self._seen.values() if now - s.at <= self.within_s]
