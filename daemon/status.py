"""What a node reports about itself: the `NodeStatus` model served as `GET /v1/status` JSON (and
turned into Prometheus metrics by `daemon.metrics`), plus `StatusBoard`, the mutable, lock-guarded
place where the daemon's parts record progress and counters; `snapshot()` copies it out.
Every field has a default so a node can fill the model in as it learns things.
"""

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field

TransferState = Literal["fetching", "applying", "current", "seeding", "failed"]
TRANSFER_STATES: tuple[TransferState, ...] = (
    "fetching", "applying", "current", "seeding", "failed",
)


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", validate_assignment=True)


class Transfer(_Model):
    """One artifact (`v00000005.delta`) this node fetches, applies or seeds."""

    artifact: str
    version: int | None = None
    state: TransferState = "fetching"
    done_bytes: int = Field(0, ge=0, description="bytes of the artifact held and verified")
    total_bytes: int = Field(0, ge=0, description="size of the artifact (all its blocks)")
    download_rate: float = Field(0.0, ge=0, description="bytes/s, now")
    upload_rate: float = Field(0.0, ge=0, description="bytes/s, now")
    bytes_up: int = Field(0, ge=0, description="bytes of this artifact uploaded to peers")
    peers: int = Field(0, ge=0, description="peers connected on this artifact's torrent")
    error: str | None = Field(None, description="why it failed, when state == 'failed'")

    @computed_field
    @property
    def progress(self) -> float:
        return self.done_bytes / self.total_bytes if self.total_bytes else 0.0


class Peer(_Model):
    """A node this one knows: by its control-plane URL, its BitTorrent endpoint, or both."""

    node: str | None = None
    http_url: str | None = None
    bt_endpoint: str | None = Field(None, description="host:port")
    bytes_up: int = Field(0, ge=0, description="bytes this node sent to the peer")
    bytes_down: int = Field(0, ge=0, description="bytes this node received from the peer")
    download_rate: float = Field(0.0, ge=0)
    upload_rate: float = Field(0.0, ge=0)
    last_seen: float | None = Field(None, description="unix time of the last contact")

    @property
    def key(self) -> str:
        return self.bt_endpoint or self.http_url or self.node or "?"


class Totals(_Model):
    """Bytes moved since start, and what shipping full checkpoints would have cost instead."""

    bytes_up: int = Field(0, ge=0)
    bytes_down: int = Field(0, ge=0)
    payload_bytes: int = Field(0, ge=0, description="artifact bytes behind the applied versions")
    full_bytes: int = Field(0, ge=0, description="full-checkpoint bytes of the same versions")
    versions_applied: int = Field(0, ge=0)

    @computed_field
    @property
    def bytes_saved(self) -> int:
        return max(0, self.full_bytes - self.payload_bytes)


class Rates(_Model):
    download: float = Field(0.0, ge=0, description="bytes/s over all torrents")
    upload: float = Field(0.0, ge=0, description="bytes/s over all torrents")


class Verification(_Model):
    """Data that failed a check: `piece` (v2 hash), `block` (xxh3 id), `tensor`, `state`."""

    failures_by_kind: dict[str, int] = Field(default_factory=dict)
    last_error: str | None = None
    last_at: float | None = None

    @computed_field
    @property
    def failures(self) -> int:
        return sum(self.failures_by_kind.values())


class Ban(_Model):
    peer: str = Field(description="address (or host:port) that is banned")
    node: str | None = None
    reason: str
    at: float


class RefusedManifest(_Model):
    artifact: str | None = None
    source: str | None = Field(None, description="the URL it came from")
    kind: str = Field(
        "invalid",
        description="unsigned | bad_signature | replay | wrong_parent | invalid | ...",
    )
    reason: str
    at: float


class EngineStatus(_Model):
    type: str | None = Field(None, description="the engine hook's type from the config")
    notifications: int = Field(0, ge=0, description="successful notifications")
    failures: int = Field(0, ge=0)
    last_version: int | None = Field(None, description="last version the engine took")
    last_ok_at: float | None = None
    last_error: str | None = None
    last_error_at: float | None = None


class SpoolStatus(_Model):
    upstream: str | None = None
    depth: int = Field(0, ge=0, description="trajectories held, not yet acknowledged")
    bytes: int = Field(0, ge=0)
    received: int = Field(0, ge=0, description="trajectories accepted from workers")
    forwarded: int = Field(0, ge=0, description="trajectories acknowledged upstream")
    forward_rate: float = Field(0.0, ge=0, description="trajectories/s acknowledged, recent")
    rejected_full: int = Field(0, ge=0, description="posts answered 429 (spool full)")
    errors: int = Field(0, ge=0, description="failed forwarding attempts")
    last_error: str | None = None
    last_error_at: float | None = None


class NodeStatus(_Model):
    """The whole report. `lag` is None while the node holds no version yet."""

    node: str = ""
    region: str = ""
    role: str = Field("region", description="trainer | region")
    http_url: str | None = None
    bt_endpoint: str | None = None
    time: float = Field(0.0, description="unix time this snapshot was taken")
    uptime_s: float = Field(0.0, ge=0)
    current_version: int | None = None
    head_version: int | None = None
    state_digest: str | None = None
    versions: list[Transfer] = Field(default_factory=list)
    peers: list[Peer] = Field(default_factory=list)
    totals: Totals = Field(default_factory=Totals)
    rates: Rates = Field(default_factory=Rates)
    verification: Verification = Field(default_factory=Verification)
    bans: list[Ban] = Field(default_factory=list)
    refused_manifests: list[RefusedManifest] = Field(
        default_factory=list, description="the most recent refusals, oldest first"
    )
    refused_by_kind: dict[str, int] = Field(default_factory=dict)
    engine: EngineStatus = Field(default_factory=EngineStatus)
    spool: SpoolStatus = Field(default_factory=SpoolStatus)

    @computed_field
    @property
    def lag(self) -> int | None:
        if self.head_version is None:
            return 0
        if self.current_version is None:
            return None
        return max(0, self.head_version - self.current_version)

    @computed_field
    @property
    def refused_total(self) -> int:
        return sum(self.refused_by_kind.values())


class RateMeter:
    """Events (or bytes) per second: an exponential average with time constant `tau` seconds,
    bias-corrected so a steady rate reads right from the first events, not after `tau`."""

    def __init__(self, tau: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.tau, self.clock = tau, clock
        self.rate = 0.0
        self.norm = 0.0
        self.last = clock()

    def _decay(self, dt: float) -> tuple[float, float]:
        w = math.exp(-dt / self.tau)
        return w * self.rate, w * self.norm + (1 - w)

    def add(self, amount: float) -> None:
        now = self.clock()
        dt = max(now - self.last, 1e-3)
        rate, self.norm = self._decay(dt)
        self.rate = rate + (1 - math.exp(-dt / self.tau)) * amount / dt
        self.last = now

    def value(self) -> float:
        """The rate up to now (falls towards 0 during silence)."""
        rate, norm = self._decay(max(self.clock() - self.last, 0.0))
        return rate / norm if norm > 0 else 0.0


class StatusBoard:
    """The node's live status. Parts of the daemon call the methods below (thread-safe); fields
    without a method (identity, rates, totals.bytes_up/down) are set with `update(...)` or under
    `with board.lock:` on `board.status`. `snapshot()` returns an independent `NodeStatus`."""

    def __init__(
        self,
        node: str,
        region: str,
        role: str = "region",
        *,
        keep: int = 50,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ):
        self.lock = threading.RLock()
        self.status = NodeStatus(node=node, region=region, role=role)
        self.clock, self.monotonic = clock, monotonic
        self.started = monotonic()
        self._refused: deque[RefusedManifest] = deque(maxlen=keep)
        self._forward = RateMeter(clock=monotonic)

    def update(self, **fields) -> None:
        """Set top-level fields, e.g. `update(head_version=7, http_url=...)` (validated)."""
        with self.lock:
            for name, value in fields.items():
                setattr(self.status, name, value)

    def set_current(self, version: int, state_digest: str) -> None:
        with self.lock:
            self.status.current_version = version
            self.status.state_digest = state_digest
            if self.status.head_version is None or self.status.head_version < version:
                self.status.head_version = version

    def set_head(self, version: int) -> None:
        with self.lock:
            if self.status.head_version is None or version > self.status.head_version:
                self.status.head_version = version

    def transfer(self, artifact: str, **fields) -> Transfer:
        """Create or update the entry for `artifact`; returns it (a live object: use the lock)."""
        with self.lock:
            for t in self.status.versions:
                if t.artifact == artifact:
                    for name, value in fields.items():
                        setattr(t, name, value)
                    return t
            t = Transfer(artifact=artifact, **fields)
            self.status.versions.append(t)
            self.status.versions.sort(key=lambda x: x.artifact)
            return t

    def drop_transfer(self, artifact: str) -> None:
        with self.lock:
            self.status.versions = [t for t in self.status.versions if t.artifact != artifact]

    def peer(self, key: str, **fields) -> Peer:
        """Create or update the peer whose bt_endpoint, http_url or node equals `key`. A new peer
        gets `key` as its bt_endpoint unless `key` looks like a URL. Stamps `last_seen`."""
        with self.lock:
            for p in self.status.peers:
                if key in (p.bt_endpoint, p.http_url, p.node):
                    break
            else:
                p = Peer(http_url=key) if "://" in key else Peer(bt_endpoint=key)
                self.status.peers.append(p)
            for name, value in fields.items():
                setattr(p, name, value)
            if "last_seen" not in fields:
                p.last_seen = self.clock()
            return p

    def drop_peer(self, key: str) -> None:
        with self.lock:
            self.status.peers = [
                p for p in self.status.peers if key not in (p.bt_endpoint, p.http_url, p.node)
            ]

    def applied(self, version: int, payload_bytes: int, full_bytes: int) -> None:
        """A version became current by applying `payload_bytes` of artifacts; shipping the full
        checkpoint would have cost `full_bytes`."""
        with self.lock:
            t = self.status.totals
            t.payload_bytes += payload_bytes
            t.full_bytes += full_bytes
            t.versions_applied += 1

    def add_bytes(self, up: int = 0, down: int = 0) -> None:
        with self.lock:
            self.status.totals.bytes_up += up
            self.status.totals.bytes_down += down

    def verification_failed(self, kind: str, detail: str) -> None:
        with self.lock:
            v = self.status.verification
            v.failures_by_kind = {**v.failures_by_kind, kind: v.failures_by_kind.get(kind, 0) + 1}
            v.last_error, v.last_at = f"{kind}: {detail}", self.clock()

    def ban(self, peer: str, reason: str, node: str | None = None) -> None:
        """Record a ban (once per peer; a repeat updates the reason)."""
        with self.lock:
            for b in self.status.bans:
                if b.peer == peer:
                    b.reason, b.at = reason, self.clock()
                    return
            self.status.bans.append(Ban(peer=peer, node=node, reason=reason, at=self.clock()))

    def unban(self, peer: str) -> None:
        with self.lock:
            self.status.bans = [b for b in self.status.bans if b.peer != peer]

    def refuse_manifest(
        self, reason: str, *, kind: str = "invalid", artifact: str | None = None,
        source: str | None = None,
    ) -> None:
        with self.lock:
            self._refused.append(RefusedManifest(
                artifact=artifact, source=source, kind=kind, reason=reason, at=self.clock(),
            ))
            self.status.refused_manifests = list(self._refused)
            counts = self.status.refused_by_kind
            self.status.refused_by_kind = {**counts, kind: counts.get(kind, 0) + 1}

    def engine_notified(self, version: int) -> None:
        with self.lock:
            e = self.status.engine
            e.notifications += 1
            e.last_version, e.last_ok_at = version, self.clock()

    def engine_failed(self, version: int, error: str) -> None:
        with self.lock:
            e = self.status.engine
            e.failures += 1
            e.last_error, e.last_error_at = f"v{version}: {error}", self.clock()

    def spool_state(self, depth: int, nbytes: int) -> None:
        with self.lock:
            self.status.spool.depth, self.status.spool.bytes = depth, nbytes

    def spool_received(self, n: int) -> None:
        with self.lock:
            self.status.spool.received += n

    def spool_forwarded(self, n: int) -> None:
        with self.lock:
            self.status.spool.forwarded += n
            self._forward.add(n)

    def spool_rejected(self) -> None:
        with self.lock:
            self.status.spool.rejected_full += 1

    def spool_error(self, error: str) -> None:
        with self.lock:
            s = self.status.spool
            s.errors += 1
            s.last_error, s.last_error_at = error, self.clock()

    def snapshot(self) -> NodeStatus:
        with self.lock:
            out = self.status.model_copy(deep=True)
            out.time = self.clock()
            out.uptime_s = max(0.0, self.monotonic() - self.started)
            out.spool.forward_rate = self._forward.value()
        return out
