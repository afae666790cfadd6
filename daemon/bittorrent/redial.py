"""When a download has no connection at all, dial its peers again soon, not in a minute.

A download dials the peers it is given the moment it starts. A peer a moment behind on the same
version has not added the torrent yet and refuses the handshake; libtorrent then dials it again
only after `min_reconnect_time` (60 s) times its fail count. With peer books far smaller than
the fleet a member knows a few peers of its region, and when all of them were a moment behind,
the version took 60 s instead of 3 (32 daemons in regions of 8, books of 4: 3 of 8 versions,
docs/SCALE.md 7.5). Lowering `min_reconnect_time` for the whole session fixed that but redialled
every peer that lacked a torrent, seeding torrents included, for good (a review measured the
session's cap of 30 dials a second against three idle peers; a closed handshake is no failure,
so `max_failcount` never ends it). So only a download left with no connection is re-added
(Swarm.refresh: same data, clean peer list, dialled at once), after 1 s alone, then 2, 4, ... up
to 30 s while it stays alone. A connect still in flight counts as a connection
(`Progress.connections`; libtorrent's `num_peers` leaves it out): a re-add would close it, and
across a slow or lossy link (a lost SYN is resent after 1 s) a connect outlasts the first wait.
"""

from dataclasses import dataclass

FIRST_S = 1.0
MAX_S = 30.0


@dataclass
class Redial:
    """Tells a download's loop when to re-add it: after `wait` seconds with no connection."""

    wait: float = FIRST_S
    alone_since: float | None = None

    def due(self, connections: int, now: float, checking: bool = False) -> bool:
        """Whether the download (`connections` now, connects in flight included) should be
        re-added now. One `checking` its files (a resumed download) has no connection by
        design, and re-adding it would start the check over: it counts as connected."""
        if connections or checking:
            self.alone_since, self.wait = None, FIRST_S
            return False
        if self.alone_since is None:
            self.alone_since = now
            return False
        if now - self.alone_since < self.wait:
            return False
        self.alone_since, self.wait = now, min(2 * self.wait, MAX_S)
        return True
