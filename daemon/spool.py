"""The trajectory spool: what rollout workers post is on disk (fsync'd) before it is acknowledged,
and leaves only when the upstream acknowledged it.

Layout: `seg-<n>.ndjson` segment files (appended, fsync'd per batch) and `acked.log` (ids the
upstream holds, fsync'd per reply). A trajectory is pending while its id is in a live segment and
not in the ack log; fully acknowledged segments are deleted, then the ack log is compacted
atomically. A torn last line (kill -9 mid-append) was never acknowledged, so it is dropped.
"""

import asyncio
import contextlib
import json
import logging
import os
import random
import re
import threading
import time
from collections import OrderedDict, deque
from pathlib import Path

import aiohttp

from chain.atomic import fsync_dir, write_atomic
from daemon.config import Trajectories

log = logging.getLogger("deltaswarm.spool")

MAX_LINE = 16 << 20
_ID = re.compile(r"^[A-Za-z0-9_\-]{1,128}$")
_SEG = re.compile(r"^seg-(\d{12})\.ndjson$")
_TYPES: dict[str, tuple[type, ...]] = {
    "group": (str,), "prompt": (str,), "completion": (str,), "prompt_ids": (list,),
    "completion_ids": (list,), "logprobs": (list,), "reward": (int, float), "region": (str,),
    "worker": (str,), "created": (int, float),
}


class BadTrajectory(ValueError):
    """A line of a trajectory batch is not a valid trajectory."""


class SpoolFull(Exception):
    """The spool is at its size limit; the sender should retry later."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"trajectory spool holds {size} bytes, the limit is {limit}; retry later")


def parse_batch(body: bytes, max_items: int = 100_000) -> list[tuple[str, bytes]]:
    """NDJSON → [(id, line)], validating each line; the whole batch is refused on any bad line."""
    out: list[tuple[str, bytes]] = []
    for n, raw in enumerate(body.split(b"\n"), 1):
        line = raw.strip()
        if not line:
            continue
        if len(out) >= max_items:
            raise BadTrajectory(f"more than {max_items} trajectories in one request; split it")
        if len(line) > MAX_LINE:
            raise BadTrajectory(f"line {n}: {len(line)} bytes exceeds {MAX_LINE}")
        try:
            doc = json.loads(line)
        except (ValueError, UnicodeDecodeError) as e:
            raise BadTrajectory(f"line {n}: not valid JSON ({e})") from None
        if not isinstance(doc, dict):
            raise BadTrajectory(f"line {n}: a trajectory must be a JSON object")
        tid, version = doc.get("id"), doc.get("version")
        if not isinstance(tid, str) or not _ID.match(tid):
            raise BadTrajectory(f"line {n}: field id must be 1-128 of [A-Za-z0-9_-], "
                                f"got {tid!r:.60}")
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise BadTrajectory(f"line {n}: field version must be an int >= 0, got {version!r:.40}")
        for key, types in _TYPES.items():
            v = doc.get(key)
            if v is not None and (not isinstance(v, types) or isinstance(v, bool)):
                raise BadTrajectory(f"line {n}: field {key} has type {type(v).__name__}")
        out.append((tid, line))
    return out


class Spool:
    def __init__(self, root: Path, max_bytes: int, segment_bytes: int = 4 << 20) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.pending: OrderedDict[str, bytes] = OrderedDict()
        self._seg_of: dict[str, int] = {}
        self._live: dict[int, set[str]] = {}
        self._acked_in_log = 0
        self._lock = threading.Lock()
        self.bytes = 0
        self._load()
        self._seg = max(self._live, default=0) + 1
        self._seg_size = 0
        self._ack_file = open(self.root / "acked.log", "ab")  # noqa: SIM115 (lives with spool)

    def _load(self) -> None:
        acked = set()
        ack_path = self.root / "acked.log"
        if ack_path.exists():
            acked = {line.decode("ascii", "replace").strip() for line in _whole_lines(ack_path)}
            self._acked_in_log = len(acked)
        for path in sorted(self.root.glob("seg-*.ndjson")):
            m = _SEG.match(path.name)
            if not m:
                continue
            seg = int(m.group(1))
            ids = set()
            for line in _whole_lines(path):
                try:
                    tid = json.loads(line)["id"]
                except (ValueError, KeyError, TypeError):
                    continue
                if tid in acked or tid in self.pending:
                    continue
                self.pending[tid] = line
                self._seg_of[tid] = seg
                self.bytes += len(line) + 1
                ids.add(tid)
            self._live[seg] = ids
        self._drop_empty_segments()

    def depth(self) -> int:
        return len(self.pending)

    def append(self, items: list[tuple[str, bytes]]) -> tuple[list[str], int]:
        """Durably add the new ones; returns (every id of the batch, number newly added).
        Raises SpoolFull (nothing written) when they would push the spool past max_bytes."""
        with self._lock:
            fresh: dict[str, bytes] = {}
            for tid, line in items:
                if tid not in self.pending and tid not in fresh:
                    fresh[tid] = line
            size = sum(len(line) + 1 for line in fresh.values())
            if size > self.max_bytes:
                raise BadTrajectory(
                    f"a batch of {size} bytes can never fit the {self.max_bytes}-byte spool "
                    "(trajectories.spool_max_bytes); send smaller batches"
                )
            if fresh and self.bytes + size > self.max_bytes:
                raise SpoolFull(self.bytes, self.max_bytes)
            if fresh:
                self._write(fresh)
            return [tid for tid, _ in items], len(fresh)

    def _write(self, fresh: dict[str, bytes]) -> None:
        if self._seg_size >= self.segment_bytes:
            self._seg += 1
            self._seg_size = 0
        path = self.root / f"seg-{self._seg:012d}.ndjson"
        new_file = not path.exists()
        data = b"".join(line + b"\n" for line in fresh.values())
        with open(path, "ab") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if new_file:
            fsync_dir(self.root)
        self._seg_size += len(data)
        live = self._live.setdefault(self._seg, set())
        for tid, line in fresh.items():
            self.pending[tid] = line
            self._seg_of[tid] = self._seg
            live.add(tid)
            self.bytes += len(line) + 1

    def take(self, max_items: int, max_bytes: int) -> list[tuple[str, bytes]]:
        """The oldest pending trajectories (they stay pending until acknowledged)."""
        with self._lock:
            out, size = [], 0
            for tid, line in self.pending.items():
                if out and (len(out) >= max_items or size + len(line) + 1 > max_bytes):
                    break
                out.append((tid, line))
                size += len(line) + 1
            return out

    def ack(self, ids: list[str]) -> int:
        """Record that the upstream holds these ids (fsync), then forget them."""
        with self._lock:
            ids = [tid for tid in dict.fromkeys(ids) if tid in self.pending]
            if not ids:
                return 0
            self._ack_file.write(b"".join(tid.encode() + b"\n" for tid in ids))
            self._ack_file.flush()
            os.fsync(self._ack_file.fileno())
            self._acked_in_log += len(ids)
            for tid in ids:
                line = self.pending.pop(tid)
                self.bytes -= len(line) + 1
                self._live[self._seg_of.pop(tid)].discard(tid)
            self._drop_empty_segments()
            return len(ids)

    def _drop_empty_segments(self) -> None:
        dropped = False
        for seg in [s for s, ids in self._live.items() if not ids]:
            if seg == getattr(self, "_seg", None) and self._seg_size < self.segment_bytes:
                continue
            (self.root / f"seg-{seg:012d}.ndjson").unlink(missing_ok=True)
            del self._live[seg]
            dropped = True
        if dropped and self._acked_in_log > 4 * len(self.pending) + 10_000:
            self._compact_acks()

    def _compact_acks(self) -> None:
        """Keep only ack entries for ids still sitting in live segment files."""
        ack_path = self.root / "acked.log"
        keep = []
        for seg in self._live:
            path = self.root / f"seg-{seg:012d}.ndjson"
            if path.exists():
                for line in _whole_lines(path):
                    try:
                        tid = json.loads(line)["id"]
                    except (ValueError, KeyError, TypeError):
                        continue
                    if tid not in self.pending:
                        keep.append(tid)
        if hasattr(self, "_ack_file"):
            self._ack_file.close()
        write_atomic(ack_path, b"".join(t.encode() + b"\n" for t in dict.fromkeys(keep)))
        self._acked_in_log = len(keep)
        self._ack_file = open(ack_path, "ab")  # noqa: SIM115

    def close(self) -> None:
        with self._lock:
            self._ack_file.close()


def _whole_lines(path: Path) -> list[bytes]:
    """Complete lines of a file; a torn last line (no newline) is cut off the file."""
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end != len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
            os.fsync(f.fileno())
    return [line for line in data[:end].split(b"\n") if line.strip()]


class Forwarder:
    """Posts pending trajectories upstream in batches; acknowledges only what the upstream says it
    holds; retries every failure with exponential backoff and jitter."""

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
            batch = self.spool.take(self.cfg.batch_size, self.cfg.batch_max_bytes)
            if not batch:
                self.wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), 5.0)
                continue
            n = 0
            try:
                held, retry_after = await self._post(batch)
                if held is not None:
                    sent = {tid for tid, _ in batch}
                    n = await asyncio.to_thread(self.spool.ack, [t for t in held if t in sent])
            except (aiohttp.ClientError, TimeoutError, ValueError, OSError) as e:
                # OSError: the ack log could not be written (disk full…); the batch stays
                # spooled and is resent later, which the upstream's dedupe makes harmless.
                held, retry_after = None, None
                self.last_error = f"{type(e).__name__}: {e}"[:300]
            if held is not None:
                self.forwarded += n
                self._acks.append((time.monotonic(), n))
                if n:
                    self.backoff_s, delay = 0.0, self.cfg.retry_initial_s
                    continue
                self.last_error = "upstream acknowledged none of the batch"
            self.errors += 1
            wait = retry_after if retry_after is not None else delay * random.uniform(0.5, 1.0)
            self.backoff_s = wait
            log.warning("forwarding %d trajectories to %s failed (%s); retrying in %.1fs",
                        len(batch), self.cfg.upstream, self.last_error, wait)
            await asyncio.sleep(wait)
            delay = min(delay * 2, self.cfg.retry_max_s)

    async def _post(self, batch: list[tuple[str, bytes]]) -> tuple[list[str] | None, float | None]:
        body = b"".join(line + b"\n" for _, line in batch)
        async with self.session.post(
            self.cfg.upstream, data=body, headers=self.headers,
            timeout=aiohttp.ClientTimeout(total=self.cfg.request_timeout_s),
        ) as r:
            text = await r.text()
            if r.status == 429:
                self.last_error = "upstream is full (429)"
                try:
                    return None, min(float(r.headers.get("Retry-After", "1")), self.cfg.retry_max_s)
                except ValueError:
                    return None, None
            if r.status != 200:
                raise ValueError(f"upstream answered HTTP {r.status}: {text[:200]}")
        reply = json.loads(text)
        held = reply.get("held") if isinstance(reply, dict) else None
        if not isinstance(held, list) or not all(isinstance(t, str) for t in held):
            raise ValueError("upstream reply has no list of held ids")
        return held, None

    def status(self) -> dict:
        return {"upstream": self.cfg.upstream, "depth": self.spool.depth(),
                "bytes": self.spool.bytes, "max_bytes": self.spool.max_bytes,
                "forwarded": self.forwarded, "forward_rate": round(self.rate(), 3),
                "errors": self.errors, "last_error": self.last_error,
                "backoff_s": round(self.backoff_s, 3)}
