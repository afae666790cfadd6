"""Trajectory ingest on the trainer node: `POST /v1/ingest` (NDJSON) stores each new trajectory
durably before acknowledging it, deduplicated by id, and the training loop consumes them in
arrival order with `IngestStore.take`. Run alone (your own trainer reads the store with
trainer.consume.Trajectories): `deltaswarm ingest --config FILE` (trainer/ingest_service.py).

Storage: one SQLite database (chain.sqlstore: WAL, one transaction per request) holding every
trajectory in arrival order and the consumption cursor (how many of them training has
consumed). A failed or torn write leaves nothing of its request behind, so after a restart each
held id is there once and the store always opens; not-yet-trained trajectories survive.
"""

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from pathlib import Path
from typing import Any

from aiohttp import web

from chain.auth import bearer_matches
from chain.sqlstore import StoreWriteError, connect, transaction
from chain.trajectory import BadTrajectory, parse_ndjson

log = logging.getLogger("deltaswarm.ingest")
MAX_BODY = 64 * 1024 * 1024
SCHEMA = """
CREATE TABLE IF NOT EXISTS trajectories (seq INTEGER PRIMARY KEY, id TEXT NOT NULL UNIQUE,
                                         record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS cursor (one INTEGER PRIMARY KEY CHECK (one = 1),
                                   consumed INTEGER NOT NULL);
"""

__all__ = ["BadIngest", "IngestStore", "IngestStoreError", "make_ingest_app",
           "parse_ndjson_records"]

BadIngest = BadTrajectory


class IngestStoreError(RuntimeError):
    """The store on disk contradicts itself; the message names the file and what to do."""


def parse_ndjson_records(body: bytes, run: str | None = None) -> list[tuple[str, str]]:
    """Validate every line (chain.trajectory) → [(id, canonical JSON)]; raise BadIngest naming
    the first bad line, trajectory and field. CPU-bound: the handler runs it in a worker thread."""
    out = [(tid, line.decode()) for tid, line in parse_ndjson(body, canonical=True, run=run)]
    if not out:
        raise BadIngest("empty body: send one JSON trajectory per line")
    return out


class IngestStore:
    """Durable, deduplicated FIFO of trajectories. Use from one event loop (disk work runs in
    worker threads, serialised by an asyncio lock)."""

    def __init__(self, root: str | Path, keep_pending: bool = True) -> None:
        """`keep_pending=False`: a store that only receives (`deltaswarm ingest`), read by
        another process (trainer.consume.Trajectories): no backlog is kept in memory and
        `take` is not used."""
        self.root = Path(root)
        self.keep_pending = keep_pending
        self.root.mkdir(parents=True, exist_ok=True)
        self.path = self.root / "ingest.db"
        self._db = connect(self.path, SCHEMA)
        row = self._db.execute("SELECT consumed FROM cursor").fetchone()
        self.committed = row[0] if row else self._import_segments()
        self.taken = self.committed
        self.ids: set[str] = {tid for (tid,) in self._db.execute("SELECT id FROM trajectories")}
        self.total = len(self.ids)
        if self.committed > self.total:
            raise IngestStoreError(f"{self.path}: cursor says {self.committed} consumed but only "
                                   f"{self.total} are held; restore the file or start a new run")
        # Unconsumed trajectories as JSON text, decoded only when taken: a backlog of dicts is
        # millions of objects for the garbage collector to walk while holding the GIL.
        self.pending: deque[str] = deque(
            record for (record,) in self._db.execute(
                "SELECT record FROM trajectories ORDER BY seq LIMIT -1 OFFSET ?",
                (self.committed,))) if keep_pending else deque()
        self._lock = asyncio.Lock()
        self._arrived = asyncio.Event()

    def _import_segments(self) -> int:
        """An older deltaswarm kept `segments/*.jsonl` + `cursor.json`: move them into the
        database once, in arrival order, each id once (a torn or unreadable line, left by a
        failed append, is skipped and logged). Returns the consumed count."""
        files = sorted((self.root / "segments").glob("*.jsonl"))
        cursor = self.root / "cursor.json"
        try:
            old_consumed = int(json.loads(cursor.read_text())["consumed"]) if cursor.exists() else 0
        except (ValueError, KeyError, TypeError) as e:
            raise IngestStoreError(f"{cursor} is damaged ({e}); restore it, or delete it to "
                                   "retrain on everything held") from e
        rows, seen, consumed, skipped = [], set(), 0, 0
        for n, line in enumerate(x for p in files for x in p.read_bytes().splitlines()):
            try:
                record = json.loads(line)
                tid = record["id"]
            except (ValueError, KeyError, TypeError):
                skipped += 1
                continue
            if tid not in seen:
                seen.add(tid)
                rows.append((tid, json.dumps(record, separators=(",", ":"))))
                consumed += n < old_consumed
        if skipped:
            log.warning("%s: skipped %d unreadable lines of the old segment files", self.root,
                        skipped)
        transaction(self._db, "trajectory ingest", [
            ("INSERT INTO trajectories (id, record) VALUES (?, ?)", rows),
            ("INSERT INTO cursor (one, consumed) VALUES (1, ?)", [(consumed,)])])
        for path in [*files, cursor]:
            path.unlink(missing_ok=True)
        return consumed

    async def append(self, items: list[tuple[str, str]]) -> list[str]:
        """Store the (id, JSON record) pairs not already held; return every id of the request
        (each once). Raises StoreWriteError (nothing stored) when the disk refuses."""
        async with self._lock:
            new: dict[str, str] = {}
            for tid, record in items:
                if tid not in self.ids and tid not in new:
                    new[tid] = record
            if new:
                await asyncio.to_thread(
                    transaction, self._db, "trajectory ingest",
                    [("INSERT INTO trajectories (id, record) VALUES (?, ?)", list(new.items()))])
                self.ids.update(new)
                if self.keep_pending:
                    self.pending.extend(new.values())
                self.total += len(new)
                self._arrived.set()
            return list(dict.fromkeys(tid for tid, _ in items))

    async def take(self, n: int, timeout: float, commit: bool = True, min_n: int = 1,
                   whole_groups: bool = True) -> list[dict[str, Any]]:
        """Up to `n` unconsumed trajectories in arrival order, waiting up to `timeout` s until
        at least `min_n` are pending (then returning what there is). With `whole_groups`, a
        group cut by `n` is completed from the backlog, so GRPO sees whole groups. With
        commit=False they stay unconsumed on disk until `commit()`: a crash before the
        caller's step hands them out again after restart."""
        deadline = time.monotonic() + timeout
        while len(self.pending) < min_n:
            self._arrived.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), left)
        out = [json.loads(self.pending.popleft()) for _ in range(min(n, len(self.pending)))]
        while whole_groups and out and self.pending and (
                json.loads(self.pending[0])["group"] == out[-1]["group"]):
            out.append(json.loads(self.pending.popleft()))
        self.taken += len(out)
        if commit:
            await self.commit()
        return out

    async def commit(self) -> None:
        """Durably mark everything taken so far as consumed."""
        async with self._lock:
            if self.taken != self.committed:
                await asyncio.to_thread(self._write_cursor, self.taken)
                self.committed = self.taken

    def _write_cursor(self, consumed: int) -> None:
        transaction(self._db, "trajectory ingest cursor",
                    [("INSERT OR REPLACE INTO cursor (one, consumed) VALUES (1, ?)",
                      [(consumed,)])])

    def stats(self) -> dict[str, int]:
        if not self.keep_pending:  # the consumer is another process: its cursor is on disk
            row = self._db.execute("SELECT consumed FROM cursor").fetchone()
            consumed = row[0] if row else 0
            return {"held": len(self.ids), "pending": len(self.ids) - consumed,
                    "consumed": consumed, "taken": consumed}
        return {"held": len(self.ids), "pending": len(self.pending),
                "consumed": self.committed, "taken": self.taken}

    def held_ids(self) -> list[str]:
        """Every stored id in arrival order, one per stored row (for checks and tools)."""
        return [tid for (tid,) in self._db.execute("SELECT id FROM trajectories ORDER BY seq")]

    def close(self) -> None:
        self._db.close()


STORE_KEY = web.AppKey("ingest_store", IngestStore)


def make_ingest_app(store: IngestStore, token: str, max_body: int = MAX_BODY,
                    run: str | None = None) -> web.Application:
    """The ingest endpoints; every /v1 route needs `Authorization: Bearer <token>`."""
    if not token:
        raise ValueError("ingest needs a non-empty bearer token")

    @web.middleware
    async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path.startswith("/v1/") and not bearer_matches(
                request.headers.get("Authorization"), token):
            return web.json_response({"error": "missing or wrong bearer token"}, status=401)
        return await handler(request)

    async def ingest(request: web.Request) -> web.Response:
        body = await request.read()
        try:
            # Validating up to `max_body` bytes of JSON is CPU work: keep it off the event loop.
            records = await asyncio.to_thread(parse_ndjson_records, body, run)
        except BadIngest as e:
            return web.json_response(e.reply(), status=400)
        try:
            held = await request.app[STORE_KEY].append(records)
        except StoreWriteError as e:
            return web.json_response({"error": str(e)}, status=503, headers={"Retry-After": "1"})
        return web.json_response({"held": held})

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(request.app[STORE_KEY].stats())

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application(middlewares=[auth], client_max_size=max_body)
    app[STORE_KEY] = store
    app.router.add_post("/v1/ingest", ingest)
    app.router.add_get("/v1/ingest/stats", stats)
    app.router.add_get("/healthz", healthz)
    return app
