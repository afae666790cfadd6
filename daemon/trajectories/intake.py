"""The trajectory intake the routes use: the spool, its forwarder and the route's counters.

Spool and Forwarder (daemon/trajectories/spool.py) are opened when the node starts; until then, and
on a
node without them, `ready` is False and the route answers 503.
"""

from daemon.trajectories.spool import Forwarder, Spool


class Intake:
    def __init__(self, retry_initial_s: float, retry_max_s: float) -> None:
        self.spool: Spool | None = None
        self.forwarder: Forwarder | None = None
        self.accepted = 0
        self.duplicates = 0
        self.refusals = 0
        self.reconfigure(retry_initial_s, retry_max_s)

    def reconfigure(self, retry_initial_s: float, retry_max_s: float) -> None:
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s

    @property
    def ready(self) -> bool:
        return self.spool is not None and self.forwarder is not None

    def retry_after_s(self) -> int:
        """What a full spool tells workers to wait (Retry-After), in whole seconds ≥ 1."""
        return max(1, int(min(self.retry_max_s, 5 * self.retry_initial_s) + 0.5))
