"""Reading trajectories back into a trainer you bring: the consumer side of `deltaswarm ingest`.

    from trainer.consume import Trajectories

    with Trajectories("/var/lib/deltaswarm/ingest") as trajs:    # ingest.yaml's store_dir
        while training:
            batch = trajs.next(64, timeout=60)   # oldest first; each a dict (chain.trajectory)
            ...train on batch, save your checkpoint...
            trajs.ack()                          # durably: these are trained

Guarantees: trajectories come out in arrival order, each id once (the ingest deduplicates).
`ack()` records, in the same SQLite database the ingest writes (WAL: the ingest process and
this reader work concurrently), that everything handed out so far is trained. After a restart
(of this process or of the ingest) `next` starts after the last ack: an acked trajectory is
never seen again, and one handed out but not acked (the crash came before your checkpoint) is
handed out again, so nothing is lost. For exactly-once training, ack right after your
checkpoint is durable, or store `acked` in your checkpoint and call `rewind_to(n)` at start.

One consumer per store (the cursor is a single count). The reference trainer (`deltaswarm
train`) consumes in-process through trainer.ingest.IngestStore instead; do not point both at
one store.
"""

import itertools
import json
import time
from pathlib import Path
from typing import Any

from chain.sqlstore import connect, transaction
from trainer.ingest import SCHEMA, IngestStoreError


class Trajectories:
    def __init__(self, store_dir: str | Path, poll_s: float = 0.2) -> None:
        self.path = Path(store_dir) / "ingest.db"
        if not self.path.exists():
            raise IngestStoreError(f"{self.path} does not exist: start `deltaswarm ingest` "
                                   "with this store_dir first (or check the path)")
        self._db = connect(self.path, SCHEMA)
        self.poll_s = poll_s
        row = self._db.execute("SELECT consumed FROM cursor").fetchone()
        self.acked = row[0] if row else 0
        """How many trajectories are acknowledged as trained (durably)."""
        self.handed = self.acked
        """How many have been handed out (acked or not)."""
        self._last_seq = self._seq_at(self.acked)

    def _seq_at(self, count: int) -> int:
        """The seq of the `count`-th stored trajectory (0 for none)."""
        if count == 0:
            return 0
        row = self._db.execute("SELECT seq FROM trajectories ORDER BY seq LIMIT 1 OFFSET ?",
                               (count - 1,)).fetchone()
        if row is None:
            raise IngestStoreError(f"{self.path}: {count} are acknowledged but fewer are held; "
                                   "restore the file or start a new run")
        return row[0]

    def next(self, n: int, timeout: float = 0.0, whole_groups: bool = False
             ) -> list[dict[str, Any]]:
        """Up to `n` trajectories after those already handed out, oldest first; waits up to
        `timeout` s for the first one (then returns what there is, possibly nothing). With
        `whole_groups`, a GRPO group cut by `n` is completed from what is held."""
        if n < 1:
            raise ValueError(f"n must be at least 1, got {n}")
        deadline = time.monotonic() + timeout
        while True:
            rows = self._db.execute(
                "SELECT seq, record FROM trajectories WHERE seq > ? ORDER BY seq LIMIT ?",
                (self._last_seq, n)).fetchall()
            if rows or time.monotonic() >= deadline:
                break
            time.sleep(min(self.poll_s, max(0.0, deadline - time.monotonic())))
        while whole_groups and rows:
            group = json.loads(rows[-1][1]).get("group")
            more = self._db.execute(
                "SELECT seq, record FROM trajectories WHERE seq > ? ORDER BY seq LIMIT 64",
                (rows[-1][0],)).fetchall()
            same = list(itertools.takewhile(
                lambda r, g=group: json.loads(r[1]).get("group") == g, more))
            rows += same
            if len(same) < len(more) or not more:
                break
        if rows:
            self._last_seq = rows[-1][0]
            self.handed += len(rows)
        return [json.loads(record) for _, record in rows]

    def ack(self) -> int:
        """Durably mark everything handed out so far as trained; returns the acked count."""
        if self.handed != self.acked:
            transaction(self._db, "trajectory consumer cursor",
                        [("INSERT OR REPLACE INTO cursor (one, consumed) VALUES (1, ?)",
                          [(self.handed,)])])
            self.acked = self.handed
        return self.acked

    def rewind_to(self, acked: int) -> None:
        """Make `acked` the acknowledged count (e.g. the one saved in the checkpoint you
        restored) and hand out from there on."""
        if not 0 <= acked <= self.held():
            raise ValueError(f"acked={acked} is outside 0..{self.held()} held")
        self._last_seq = self._seq_at(acked)
        self.handed = acked
        transaction(self._db, "trajectory consumer cursor",
                    [("INSERT OR REPLACE INTO cursor (one, consumed) VALUES (1, ?)", [(acked,)])])
        self.acked = acked

    def held(self) -> int:
        return self._db.execute("SELECT COUNT(*) FROM trajectories").fetchone()[0]

    def waiting(self) -> int:
        """Held and not handed out yet."""
        return self._db.execute("SELECT COUNT(*) FROM trajectories WHERE seq > ?",
                                (self._last_seq,)).fetchone()[0]

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> "Trajectories":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Trajectories"]
