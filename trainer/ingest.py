"""Trajectory ingest on the trainer node: `POST /v1/ingest` (NDJSON) stores each new trajectory
durably before acknowledging it, deduplicated by id, and the training loop consumes them in
arrival order with `IngestStore.take`.

Storage: append-only JSONL segments (fsynced per request) plus a consumption cursor (written
atomically). Held ids and the unconsumed backlog are rebuilt from the segments on start, so
dedupe and not-yet-trained trajectories survive a trainer restart.
"""

import asyncio
import contextlib
import json
import math
import os
import time
from collections import deque
from pathlib import Path
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from chain.atomic import fsync_dir, write_atomic
from chain.auth import bearer_matches

SEGMENT_BYTES = 64 * 1024 * 1024
MAX_BODY = 64 * 1024 * 1024


class IngestStoreError(RuntimeError):
    """The store on disk is damaged beyond a torn last line; the message names the file."""


class Trajectory(BaseModel):
    """One trajectory as in docs/CONTRACTS.md; unknown fields are ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")

    id: str = Field(pattern=r"^[0-9a-f]{32}$")
    version: int = Field(ge=0)
    group: str = Field(min_length=1, max_length=256)
    prompt: str
    completion: str
    prompt_ids: list[int] = Field(min_length=1)
    completion_ids: list[int]
    logprobs: list[float]
    reward: float
    region: str = Field(max_length=256)
    worker: str = Field(max_length=256)
    created: float

    @field_validator("prompt_ids", "completion_ids")
    @classmethod
    def _token_ids(cls, ids: list[int]) -> list[int]:
        if any(i < 0 for i in ids):
            raise ValueError("token ids must be >= 0")
        return ids

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, lps: list[float]) -> list[float]:
        if any(not math.isfinite(x) or x > 1e-3 for x in lps):
            raise ValueError("log-probabilities must be finite and <= 0")
        return lps

    @field_validator("reward", "created")
    @classmethod
    def _finite(cls, x: float) -> float:
        if not math.isfinite(x):
            raise ValueError("must be a finite number")
        return x

    @model_validator(mode="after")
    def _aligned(self) -> "Trajectory":
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError(f"logprobs has {len(self.logprobs)} entries, completion_ids "
                             f"{len(self.completion_ids)}: need one log-prob per completion token")
        return self


class BadIngest(ValueError):
    """A request body that is not valid NDJSON trajectories; names the line and field."""


def parse_ndjson(body: bytes) -> list[dict[str, Any]]:
    """Validate every line; raise BadIngest naming the first bad line (1-based) and field."""
    out = []
    for lineno, raw in enumerate(body.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadIngest(f"line {lineno}: not JSON ({e})") from e
        try:
            out.append(Trajectory.model_validate(obj).model_dump())
        except ValidationError as e:
            err = e.errors()[0]
            field = ".".join(str(p) for p in err["loc"]) or "(object)"
            raise BadIngest(f"line {lineno}: field {field}: {err['msg']}") from e
    if not out:
        raise BadIngest("empty body: send one JSON trajectory per line")
    return out


class IngestStore:
    """Durable, deduplicated FIFO of trajectories. Use from one event loop."""

    def __init__(self, root: str | Path, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.root = Path(root)
        self.segments = self.root / "segments"
        self.segments.mkdir(parents=True, exist_ok=True)
        self.segment_bytes = segment_bytes
        self.ids: set[str] = set()
        self.pending: deque[dict[str, Any]] = deque()
        self.committed = self._read_cursor()
        self.taken = self.committed
        self.total = 0
        self._lock = asyncio.Lock()
        self._arrived = asyncio.Event()
        self._load()

    def _read_cursor(self) -> int:
        path = self.root / "cursor.json"
        if not path.exists():
            return 0
        try:
            return int(json.loads(path.read_text())["consumed"])
        except (ValueError, KeyError, TypeError) as e:
            raise IngestStoreError(f"{path} is damaged ({e}); restore it or delete it to "
                                   "retrain on everything held") from e

    def _segment_files(self) -> list[Path]:
        return sorted(self.segments.glob("*.jsonl"))

    def _load(self) -> None:
        files = self._segment_files()
        for n, path in enumerate(files):
            data = path.read_bytes()
            end = data.rfind(b"\n") + 1
            if end < len(data):
                if n != len(files) - 1:
                    raise IngestStoreError(f"{path} ends mid-record but is not the last segment")
                with path.open("r+b") as f:
                    f.truncate(end)
                    os.fsync(f.fileno())
            for line in data[:end].splitlines():
                try:
                    record = json.loads(line)
                    tid = record["id"]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise IngestStoreError(f"{path}: unreadable record ({e})") from e
                self.ids.add(tid)
                if self.total >= self.committed:
                    self.pending.append(record)
                self.total += 1
        if self.committed > self.total:
            raise IngestStoreError(f"cursor says {self.committed} consumed but only "
                                   f"{self.total} are held in {self.segments}")

    def _current_segment(self) -> Path:
        files = self._segment_files()
        if files and files[-1].stat().st_size < self.segment_bytes:
            return files[-1]
        index = int(files[-1].stem) + 1 if files else 1
        return self.segments / f"{index:08d}.jsonl"

    def _write(self, lines: bytes) -> None:
        path = self._current_segment()
        fresh = not path.exists()
        with path.open("ab") as f:
            f.write(lines)
            f.flush()
            os.fsync(f.fileno())
        if fresh:
            fsync_dir(self.segments)

    async def append(self, records: list[dict[str, Any]]) -> list[str]:
        """Store the records not already held; return every id of the request (each once)."""
        async with self._lock:
            new, seen = [], set()
            for r in records:
                if r["id"] not in self.ids and r["id"] not in seen:
                    new.append(r)
                seen.add(r["id"])
            if new:
                lines = b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n"
                                 for r in new)
                await asyncio.to_thread(self._write, lines)
                for r in new:
                    self.ids.add(r["id"])
                    self.pending.append(r)
                self.total += len(new)
                self._arrived.set()
            return list(dict.fromkeys(r["id"] for r in records))

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
        out = [self.pending.popleft() for _ in range(min(n, len(self.pending)))]
        while whole_groups and out and self.pending and (
                self.pending[0].get("group") == out[-1].get("group")):
            out.append(self.pending.popleft())
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
        write_atomic(self.root / "cursor.json", json.dumps({"consumed": consumed}).encode())

    def stats(self) -> dict[str, int]:
        return {"held": len(self.ids), "pending": len(self.pending),
                "consumed": self.committed, "taken": self.taken,
                "segments": len(self._segment_files())}


STORE_KEY = web.AppKey("ingest_store", IngestStore)


def make_ingest_app(store: IngestStore, token: str, max_body: int = MAX_BODY) -> web.Application:
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
            records = parse_ndjson(body)
        except BadIngest as e:
            return web.json_response({"error": str(e)}, status=400)
        held = await request.app[STORE_KEY].append(records)
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


def main(argv: list[str] | None = None) -> int:
    """Run the ingest endpoint alone (no trainer): `python -m trainer.ingest --dir D --host H
    --port P --token T`. SIGTERM/SIGINT stop it after in-flight requests."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m trainer.ingest", description=main.__doc__)
    p.add_argument("--dir", required=True, type=Path, help="store directory (segments, cursor)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8800)
    p.add_argument("--token", required=True, help="bearer token the senders present")
    a = p.parse_args(argv)
    web.run_app(make_ingest_app(IngestStore(a.dir), a.token), host=a.host, port=a.port,
                print=lambda msg: print(msg, flush=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
