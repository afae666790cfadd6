"""The trajectory spool: what rollout workers post is on disk before it is acknowledged, and
leaves only when the upstream acknowledged it or refused it as invalid.

Storage is one SQLite database in WAL mode with `synchronous=FULL`: a batch is one transaction,
so a write that fails half-way (disk full, file-size limit, kill -9) leaves nothing of it behind,
and recovery at open is SQLite's own. `pending` holds what is owed upstream in arrival order;
`rejected` holds what the upstream refused as invalid (kept for an operator, never resent).
"""

import asyncio
import contextlib
import json
import logging
import random
import threading
import time
from collections import deque
from pathlib import Path

import aiohttp

from chain.sqlstore import StoreWriteError, connect, transaction
from chain.trajectory import MAX_ITEMS, BadTrajectory, parse_ndjson, retry_after_s
from daemon.config import Trajectories

log = logging.getLogger("deltaswarm.spool")

SCHEMA = """
CREATE TABLE IF NOT EXISTS pending (seq INTEGER PRIMARY KEY, id TEXT NOT NULL UNIQUE,
                                    line BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS rejected (seq INTEGER PRIMARY KEY, id TEXT NOT NULL,
                                     line BLOB NOT NULL, status INTEGER NOT NULL,
                                     reason TEXT NOT NULL, at REAL NOT NULL);
"""

__all__ = ["BadTrajectory", "Spool", "SpoolFull", "SpoolWriteError", "parse_batch"]


class SpoolFull(Exception):
    """The spool is at its size limit; the sender should retry later."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"trajectory spool holds {size} bytes, the limit is {limit}; retry later")


SpoolWriteError = StoreWriteError
"""The spool could not store a batch (disk full, I/O error); nothing of it was kept."""


def parse_batch(body: bytes, max_items: int = MAX_ITEMS, run: str | None = None
                ) -> list[tuple[str, bytes]]:
    """NDJSON → [(id, line)], each line a valid `chain.trajectory.Trajectory`; the whole batch is
    refused with BadTrajectory (naming line, trajectory index and field) on any bad line, or
    on one stamped with a run other than `run` (this daemon's chain's).
    CPU-bound: the HTTP handler runs it in a worker thread."""
    return parse_ndjson(body, max_items, run=run)


class Spool:
    """Durable, deduplicated FIFO of trajectory lines. Methods block on disk: call them from a
    worker thread; `depth()`, `bytes` and `rejected` are in-memory and safe on the event loop."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._db = connect(self.root / "spool.db", SCHEMA)
        self._sizes: dict[str, int] = {
            tid: n + 1 for tid, n in self._db.execute("SELECT id, length(line) FROM pending")}
        self.bytes = sum(self._sizes.values())
        self.rejected: int = self._db.execute("SELECT count(*) FROM rejected").fetchone()[0]
        """Trajectories the upstream refused as invalid, moved to the rejected store."""
        self._import_segments()

    def _import_segments(self) -> None:
        """Move what an older deltaswarm spooled in `seg-*.ndjson` + `acked.log` into the
        database (one transaction, then the files go); a torn last line was never acknowledged."""
        segs = sorted(self.root.glob("seg-*.ndjson"))
        if not segs:
            return
        ack_log = self.root / "acked.log"
        acked = set(ack_log.read_bytes().split()) if ack_log.exists() else set()
        items = []
        for path in segs:
            for line in path.read_bytes().split(b"\n"):
                with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
                    tid = json.loads(line)["id"]
                    if tid.encode() not in acked:
                        items.append((tid, line.strip()))
        fresh = {tid: line for tid, line in items if tid not in self._sizes}
        self._tx([("INSERT OR IGNORE INTO pending (id, line) VALUES (?, ?)",
                    list(fresh.items()))])
        for tid, line in fresh.items():
            self._sizes[tid] = len(line) + 1
        self.bytes = sum(self._sizes.values())
        for path in [*segs, ack_log]:
            path.unlink(missing_ok=True)

    def depth(self) -> int:
        return len(self._sizes)

    def append(self, items: list[tuple[str, bytes]]) -> tuple[list[str], int]:
        """Durably add the new ones; returns (every id of the batch, number newly added).
        Raises SpoolFull (nothing written) when they would push the spool past max_bytes,
        SpoolWriteError (nothing written) when the disk refuses."""
        with self._lock:
            fresh: dict[str, bytes] = {}
            for tid, line in items:
                if tid not in self._sizes and tid not in fresh:
                    fresh[tid] = line
            size = sum(len(line) + 1 for line in fresh.values())
            if size > self.max_bytes:
                raise BadTrajectory(
                    f"a batch of {size} bytes can never fit the {self.max_bytes}-byte spool "
                    "(trajectories.spool_max_bytes); send smaller batches")
            if fresh and self.bytes + size > self.max_bytes:
                raise SpoolFull(self.bytes, self.max_bytes)
            if fresh:
                self._tx([("INSERT INTO pending (id, line) VALUES (?, ?)", list(fresh.items()))])
                for tid, line in fresh.items():
                    self._sizes[tid] = len(line) + 1
                self.bytes += size
            return [tid for tid, _ in items], len(fresh)

    def take(self, max_items: int, max_bytes: int) -> list[tuple[str, bytes]]:
        """The oldest pending trajectories (they stay pending until acknowledged or rejected);
        at least one if any is pending."""
        with self._lock:
            out, size = [], 0
            for tid, line in self._db.execute(
                    "SELECT id, line FROM pending ORDER BY seq LIMIT ?", (max_items,)):
                if out and size + len(line) + 1 > max_bytes:
                    break
                out.append((tid, bytes(line)))
                size += len(line) + 1
            return out

    def ack(self, ids: list[str]) -> int:
        """The upstream holds these ids: forget them (durably). Returns how many were pending."""
        with self._lock:
            ids = [tid for tid in dict.fromkeys(ids) if tid in self._sizes]
            if ids:
                self._tx([("DELETE FROM pending WHERE id = ?", [(t,) for t in ids])])
                self._forget(ids)
            return len(ids)

    def reject(self, ids: list[str], status: int, reason: str) -> int:
        """The upstream refused these as invalid: move them to the rejected store in one
        transaction (never resent). Returns how many moved."""
        with self._lock:
            ids = [tid for tid in dict.fromkeys(ids) if tid in self._sizes]
            if ids:
                now, reason = time.time(), reason[:2000]
                self._tx([
                    ("INSERT INTO rejected (id, line, status, reason, at) SELECT id, line, ?, ?, ? "
                     "FROM pending WHERE id = ?", [(status, reason, now, t) for t in ids]),
                    ("DELETE FROM pending WHERE id = ?", [(t,) for t in ids])])
                self._forget(ids)
                self.rejected += len(ids)
            return len(ids)

    def rejected_items(self, limit: int = 100) -> list[dict]:
        """The most recent rejected trajectories, newest first: id, status, reason, at, line."""
        with self._lock:
            rows = self._db.execute("SELECT id, status, reason, at, line FROM rejected "
                                    "ORDER BY seq DESC LIMIT ?", (limit,)).fetchall()
        return [{"id": r[0], "status": r[1], "reason": r[2], "at": r[3], "line": bytes(r[4])}
                for r in rows]

    def _tx(self, statements: list[tuple[str, list]]) -> None:
        transaction(self._db, "trajectory spool", statements)

    def _forget(self, ids: list[str]) -> None:
        for tid in ids:
            self.bytes -= self._sizes.pop(tid)

    def close(self) -> None:
        with self._lock:
            self._db.close()


INVALID = frozenset({400, 413, 422})
"""Upstream statuses that refuse the data itself: resending the same bytes cannot succeed.
Other 4xx (401, 403, 404, ...) mean this forwarder is misconfigured (token, URL) and are retried,
so fixing the config (SIGHUP) resumes the stream instead of discarding it."""
REPLY_LIMIT = 1 << 20


class Retry(Exception):
    """Forwarding stopped on something a later resend may fix."""

    def __init__(self, reason: str, retry_after: str | None = None) -> None:
        super().__init__(reason)
        self.retry_after = retry_after


class Forwarder:
    """Posts pending trajectories upstream in batches; acknowledges only what the upstream says it
    holds; moves what it refuses as invalid to the rejected store (the stream moves on); retries
    everything else with exponential backoff and jitter, honouring a sane Retry-After."""

    def __init__(self, spool: Spool, cfg: Trajectories, token: str,
                 session: aiohttp.ClientSession, headers: dict[str, str]) -> None:
        self.spool = spool
        self.cfg = cfg
        self.session = session
        self.headers = {**headers, "Authorization": f"Bearer {cfg.upstream_token or token}",
                        "Content-Type": "application/x-ndjson"}
        self.wake = asyncio.Event()
        self.forwarded = 0
        self.errors = 0
        self.last_error = ""
        self.last_rejected = ""
        self.backoff_s = 0.0
        self._acks: deque[tuple[float, int]] = deque(maxlen=4096)

    def kick(self) -> None:
        self.wake.set()

    def rate(self, window: float = 30.0) -> float:
        now = time.monotonic()
        n = sum(c for t, c in self._acks if now - t <= window)
        return n / window

    async def run(self) -> None:
        if self.cfg.upstream is None:
            return
        delay = self.cfg.retry_initial_s
        while True:
            cfg = self.cfg
            batch = await asyncio.to_thread(self.spool.take, cfg.batch_size, cfg.batch_max_bytes)
            if not batch:
                self.wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), 5.0)
                continue
            retry_after = None
            try:
                await self._deliver(batch)
                self.backoff_s, delay = 0.0, cfg.retry_initial_s
                continue
            except Retry as e:
                self.last_error, retry_after = str(e), e.retry_after
            except (aiohttp.ClientError, TimeoutError, ValueError, OSError) as e:
                # OSError: the spool could not record the reply (disk full…); the batch stays
                # spooled and is resent later, which the upstream's dedupe makes harmless.
                self.last_error = f"{type(e).__name__}: {e}"[:300]
            self.errors += 1
            jittered = delay * random.uniform(0.5, 1.0)
            wait = jittered if retry_after is None else retry_after_s(
                retry_after, jittered, cfg.retry_initial_s, cfg.retry_max_s)
            self.backoff_s = wait
            log.warning("forwarding %d trajectories to %s failed (%s); retrying in %.1fs",
                        len(batch), cfg.upstream, self.last_error, wait)
            await asyncio.sleep(wait)
            delay = min(delay * 2, cfg.retry_max_s)

    async def _deliver(self, batch: list[tuple[str, bytes]]) -> None:
        """Send `batch`. When the upstream refuses a part as invalid, the trajectory its reply
        names (`"trajectory": index`, as this daemon and the ingest answer) moves to the rejected
        store and the rest is resent; a refusal naming none halves the part until each bad
        trajectory is alone. Raises Retry (after keeping whatever was acknowledged) on anything
        else."""
        parts = [batch]
        while parts:
            part = parts.pop()
            status, text, held, retry_after = await self._post(part)
            if status == 200:
                sent = {tid for tid, _ in part}
                n = await asyncio.to_thread(self.spool.ack, [t for t in held if t in sent])
                if not n:
                    raise Retry("upstream acknowledged none of the batch")
                self.forwarded += n
                self._acks.append((time.monotonic(), n))
            elif status in INVALID and (k := _named(text, len(part))) is not None:
                await self._reject(part[k][0], status, text)
                if len(part) > 1:
                    parts.append(part[:k] + part[k + 1:])
            elif status in INVALID and len(part) > 1:
                half = len(part) // 2
                parts += [part[half:], part[:half]]
            elif status in INVALID:
                await self._reject(part[0][0], status, text)
            elif status == 429:
                raise Retry("upstream is full (429)", retry_after)
            else:
                raise Retry(f"upstream answered HTTP {status}: {text[:200]}")

    async def _reject(self, tid: str, status: int, text: str) -> None:
        self.last_rejected = f"{tid}: HTTP {status}: {text[:300]}"
        await asyncio.to_thread(self.spool.reject, [tid], status, text)
        log.error("upstream refused trajectory %s as invalid (HTTP %d: %s); moved to the "
                  "rejected store, not resent", tid, status, text[:300])

    async def _post(self, part: list[tuple[str, bytes]]
                    ) -> tuple[int, str, list[str], str | None]:
        """One request: (status, reply text, held ids if 200, Retry-After header). Replies are
        read up to a bound, so an upstream cannot make this daemon buffer without limit."""
        body = b"".join(line + b"\n" for _, line in part)
        async with self.session.post(
            self.cfg.upstream, data=body, headers=self.headers,
            timeout=aiohttp.ClientTimeout(total=self.cfg.request_timeout_s),
        ) as r:
            if r.status != 200:
                text = (await r.content.read(4096)).decode("utf-8", "replace")
                return r.status, text, [], r.headers.get("Retry-After")
            raw = bytearray()
            async for chunk in r.content.iter_chunked(1 << 16):
                raw += chunk
                if len(raw) > REPLY_LIMIT + 64 * len(part):
                    raise ValueError("upstream reply is too large for a list of held ids")
        try:
            reply = json.loads(raw)
        except RecursionError:
            raise ValueError("upstream reply is nested too deeply") from None
        held = reply.get("held") if isinstance(reply, dict) else None
        if not isinstance(held, list) or not all(isinstance(t, str) for t in held):
            raise ValueError("upstream reply has no list of held ids")
        return 200, "", held, None

    def status(self) -> dict:
        return {"upstream": self.cfg.upstream, "depth": self.spool.depth(),
                "bytes": self.spool.bytes, "max_bytes": self.spool.max_bytes,
                "forwarded": self.forwarded, "forward_rate": round(self.rate(), 3),
                "rejected": self.spool.rejected, "last_rejected": self.last_rejected,
                "errors": self.errors, "last_error": self.last_error,
                "backoff_s": round(self.backoff_s, 3)}


def _named(text: str, n: int) -> int | None:
    """The index of the trajectory a 400 reply names (`{"trajectory": k}`), if it is one of n."""
    try:
        k = json.loads(text).get("trajectory")
    except (ValueError, AttributeError, RecursionError):
        return None
    return k if isinstance(k, int) and not isinstance(k, bool) and 0 <= k < n else None
