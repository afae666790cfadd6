"""Retention in a publisher: one rule, here, for every process that writes versions into a
chain directory (Publisher, ShardedPublisher, `deltaswarm publish` and `watch`).

Issue 20, finding 2: the checkpoint publisher and the sharded one deleted by their own window
after each publish, dropping deltas the trainer daemon kept for a node that was behind
(status `kept_for`) while its index still listed them. The daemon is the one that sees the
live nodes, so its decision wins whenever it has made one:

- The daemon recorded a decision (`<chain>/retention.json`, written by its Keeper): if it was
  just told of this version it has applied its decision itself and nothing is deleted here;
  otherwise (down, slow, not linked) its recorded settings and live versions are applied, never
  the publisher's own window.
- No decision recorded and a daemon is linked: nothing is deleted (it decides on its first
  publish).
- No decision recorded, no daemon: the publisher's own `Retention` (a chain dir no daemon
  serves).

Every deletion goes through ChainStore.retain, which spares versions being written (write
leases, chain.lease).
"""

import logging

from chain.errors import ChainError
from chain.lease import ChainBusy
from chain.policy import Retention, recorded_decision
from chain.store import ChainStore

log = logging.getLogger("deltaswarm.retention")


def publisher_retain(store: ChainStore, own: Retention, *, daemon: bool,
                     notified: bool) -> list[str]:
    """Apply the rule above after a publish; returns the artifacts dropped. `daemon`: the
    publisher is linked to a daemon; `notified`: that daemon took this publish."""
    try:
        recorded = recorded_decision(store.root)
    except ChainError as e:
        log.warning("retention skipped: %s", e)
        return []
    if recorded is not None:
        if notified:
            return []
        retention, live = recorded
        try:
            dropped = store.gc(retention, live=live)
        except ChainBusy as e:
            log.warning("%s", e)
            return []
        if dropped:
            log.info("retention as the daemon last decided (live %s) dropped %s", live, dropped)
        return dropped
    if daemon:
        return []
    try:
        return store.gc(own)
    except ChainBusy as e:
        log.warning("%s", e)
        return []
