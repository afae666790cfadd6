"""SQLite, the way both trajectory stores (the daemon's spool, the trainer's ingest) use it: WAL
mode with `synchronous=FULL`, one transaction per batch. A write that fails half-way (disk full,
file-size limit, kill -9) leaves nothing of the batch behind, and a torn tail is recovered by
SQLite at open, so neither store needs its own append log, torn-line repair or compaction.
"""

import contextlib
import sqlite3
from pathlib import Path


class StoreWriteError(OSError):
    """A store could not write a batch (disk full, I/O error); nothing of it was kept."""


def connect(path: Path, schema: str) -> sqlite3.Connection:
    """Open (creating) a WAL database with explicit transactions. Usable from worker threads:
    callers serialise access with their own lock."""
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.executescript(schema)
    return db


def transaction(db: sqlite3.Connection, what: str, statements: list[tuple[str, list]]) -> None:
    """Run `executemany` statements as one durable transaction. On any failure roll back (SQLite
    asks for an explicit ROLLBACK after SQLITE_FULL or an I/O error) and raise StoreWriteError."""
    try:
        db.execute("BEGIN IMMEDIATE")
        for sql, rows in statements:
            db.executemany(sql, rows)
        db.execute("COMMIT")
    except sqlite3.Error as e:
        if db.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
        raise StoreWriteError(f"{what} cannot write ({e}); nothing of this batch was stored, "
                              "retry later") from e
