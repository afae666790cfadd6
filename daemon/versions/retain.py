"""A daemon's side of retention: one `chain.policy.Retention`, the versions live nodes hold, and
the last decision (shown in status as `retention`).

The trainer's daemon records each decision's inputs in its chain directory, so the publisher
writing there deletes the same things while the daemon is down; after a restart the recorded
live versions still count for `live_within_s`, until the nodes have polled again.

A retention pass, whoever triggers it (any `POST /v1/publish`), runs under the chain
directory's lock and spares versions a publisher is writing (its write lease, chain.lease):
status shows those leases as `writing` and the blocks kept for them as `spared_blocks`.
"""

import logging
import time
from collections.abc import Callable, Iterable

from chain.errors import ChainError
from chain.lease import ChainBusy
from chain.policy import Decision, Retention, record_decision, recorded_decision
from chain.store import ChainStore

log = logging.getLogger("deltaswarm.retention")
LiveVersions = Callable[[], list[int | None]]
"""Versions held by the nodes seen live (e.g. LiveNodes.versions, FleetBoard.live_versions)."""


class Keeper:
    def __init__(self, store: ChainStore, retention: Retention, live: LiveVersions,
                 live_within_s: float, record: bool) -> None:
        self.store = store
        self.retention = retention
        self.live = live
        self.live_within_s = live_within_s
        self.record = record
        self.started = time.monotonic()
        self.last: Decision | None = None
        self.dropped: list[str] = []
        self.at: float | None = None
        self.inherited: list[int | None] = []
        if record:
            try:
                got = recorded_decision(store.root)
            except ChainError as e:
                log.warning("ignoring the recorded retention decision: %s", e)
                got = None
            self.inherited = got[1] if got is not None else []

    def reconfigure(self, retention: Retention, live_within_s: float) -> None:
        self.retention, self.live_within_s = retention, live_within_s

    def versions(self, extra: Iterable[int | None] = ()) -> list[int | None]:
        live = [*self.live(), *extra]
        if time.monotonic() - self.started < self.live_within_s:
            live += self.inherited
        return live

    def run(self, protect: Iterable[str] = (), extra_live: Iterable[int | None] = ()
            ) -> list[str]:
        """Decide and drop (blocking: call from a thread); returns the dropped artifacts."""
        live = self.versions(extra_live)
        retention = self.retention
        try:
            decision, dropped = self.store.retain(lambda held: retention.decide(held, live),
                                                  protect)
        except ChainBusy as e:  # a publisher holds the chain lock: keep all, try next time
            log.warning("%s", e)
            return []
        if self.record:
            record_decision(self.store.root, self.retention, live)
        if decision.fell_back and (self.last is None or self.last.fell_back != decision.fell_back):
            log.warning("retention: nodes at %s fall back to a snapshot (behind_budget_bytes %d "
                        "would be exceeded)", list(decision.fell_back), decision.budget_bytes)
        self.last, self.at = decision, time.time()
        if dropped:
            self.dropped = dropped
        return dropped

    def status(self) -> dict:
        d = self.last or Decision(frozenset(), self.retention.behind_budget_bytes)
        return {"versions": self.retention.versions, **d.as_status(),
                "dropped": self.dropped[-50:], "at": self.at,
                "writing": [w.as_status() for w in self.store.writing_seen],
                "spared_blocks": self.store.spared_blocks}
