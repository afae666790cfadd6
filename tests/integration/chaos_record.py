"""What one chaos run (tests/integration/chaos_scenario.py) records: its parameters, the
`ChaosRun` result, the `Sampler` thread that polls every daemon's status while it runs, the
convergence bound worked out from the run's own figures, and the final collection (statuses,
weights recomputed from the files, bans ever shown, the corrupted block, log lines).
"""

import contextlib
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from chain.weights import WeightsDir
from tests.integration.chaos_faults import block_verifies, snapshots_downloaded
from tests.integration.harness import Cluster, Daemon

RETRY_S = 15.0
"""The sync loop's longest backoff after a failed step (daemon/versions/sync.py `Syncer.run`)."""
LOG_WORDS = ("plan v", "SyncError", "banned", "sync step failed", "retention dropped", "self",
             "replan", "given up", "gave up", "corrupt", "complain", "refused", "Error",
             "Traceback", "exited", "stopp")


@dataclass(frozen=True)
class Params:
    tensors: int = 7
    rows: int = 1024
    cols: int = 1024  # 7 x 1024 x 1024 bf16: 7.34M parameters, a 14.7 MB snapshot
    density: float = 0.009
    interval_s: float = 1.5
    final: int = 26
    snapshot_every: int = 6
    trainer_retention: int = 3
    block_size: int = 256 * 1024
    thin_rate: int = 1_500_000  # us2's download cap: the v0 snapshot takes ~10 s
    kill_window: tuple[float, float] = (0.2, 0.6)
    victim_down_s: float = 3.0
    trainer_kill_after: int = 10
    throttle_rate: int = 16_000  # the trainer's uplink while v`trainer_kill_after` leaves it
    late_from: int = 19
    self_check_interval_s: float = 3.0  # a pass over ~50 MB takes ~0.3 s; finds the flip long
    # before retention can drop the corrupted delta (which would leave nothing to repair)
    progress_timeout_s: float = 8.0
    unoffered_timeout_s: float = 5.0

    @property
    def trainer_restart_after(self) -> int:
        """The publish after which the trainer's daemon restarts: the first version at which
        a window of `trainer_retention` versions no longer holds the killed-on delta (the next
        snapshot is inside the window)."""
        k, s = self.trainer_kill_after, self.snapshot_every
        return (k // s + 1) * s + self.trainer_retention - 1


@dataclass
class ChaosRun:
    params: Params
    final: int = 0
    trainer_digest: str | None = None
    published_digest: str | None = None
    converge_s: float | None = None
    bound_s: float = 0.0
    bound_terms: dict[str, float] = field(default_factory=dict)
    regions: list[str] = field(default_factory=list)
    statuses: dict[str, dict] = field(default_factory=dict)
    weights: dict[str, str] = field(default_factory=dict)
    bans_seen: dict[str, list[dict]] = field(default_factory=dict)
    shunned: dict[str, dict[str, str]] = field(default_factory=dict)
    urls: dict[str, str] = field(default_factory=dict)
    guilty_host: str | None = None
    corrupted: dict | None = None
    block_ok_at_end: bool | None = None
    victim_kill: dict | None = None
    trainer_kill: dict = field(default_factory=dict)
    late: dict = field(default_factory=dict)
    restart_to_current_s: float | None = None
    knobs: dict[str, bool] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    log_lines: dict[str, list[str]] = field(default_factory=dict)


class Sampler(threading.Thread):
    """Polls every running daemon's status twice a second: bans ever shown (a ban that later
    expires still happened), apply and snapshot-fetch times, when each node first held each
    version."""

    def __init__(self) -> None:
        super().__init__(name="chaos-sampler", daemon=True)
        self.daemons: dict[str, Daemon] = {}
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.bans: dict[str, dict[str, dict]] = {}
        self.applied: dict[str, list[dict]] = {}
        self.snapshot_rate: dict[str, float] = {}
        self.first_at: dict[str, dict[int, float]] = {}
        self.shunned: dict[str, dict[str, str]] = {}

    def watch(self, d: Daemon) -> None:
        with self.lock:
            self.daemons[d.name] = d

    def run(self) -> None:
        while not self.done.wait(0.5):
            with self.lock:
                daemons = list(self.daemons.values())
            for d in daemons:
                if d.proc is None or d.proc.poll() is not None:
                    continue
                with contextlib.suppress(OSError, ValueError, KeyError):
                    self.take(d.name, d.get("/v1/status", timeout=3))

    def take(self, name: str, st: dict) -> None:
        now = time.monotonic()
        for b in st.get("bans", []):
            self.bans.setdefault(name, {})[json.dumps(
                {k: v for k, v in b.items() if k not in ("at", "since", "expires")},
                sort_keys=True)] = b
        for e in st.get("detail", {}).get("peer_book") or []:
            if e.get("banned_s", 0) > 0:
                self.shunned.setdefault(name, {})[e["url"]] = e.get("last_error") or ""
        if st.get("current_version") is not None:
            self.first_at.setdefault(name, {}).setdefault(st["current_version"], now)
        sync = st.get("detail", {}).get("sync") or {}
        if sync.get("applied"):
            self.applied[name] = sync["applied"]
        first = (sync.get("transfers") or {}).get("v00000000.snapshot") or {}
        if first.get("seconds") and first.get("total") and name not in self.snapshot_rate:
            self.snapshot_rate[name] = first["total"] / first["seconds"]

    def apply_seconds(self, kind: str, last: int) -> float:
        """The longest of each region's `last` applies of `kind` (steady state: a first apply
        that waited for the kernels to compile is not what a region pays at the end)."""
        return max([a.get("apply_seconds") or 0.0 for applied in self.applied.values()
                    for a in [x for x in applied if x["artifact"].endswith(kind)][-last:]],
                   default=0.0)


APPLY_CEILING_S = 12.0
"""Most time a region may spend applying a snapshot plus a snapshot interval of deltas, however
slowly this run measured them."""


def bound_terms(p: Params, s: Sampler, snapshot_bytes: int, knobs: dict[str, bool]
                 ) -> dict[str, float]:
    """What one region may need after the last publish, each from this run's own figures:
    a snapshot over the slowest link (us2's cap, or the slowest first-snapshot rate measured
    on the others), a snapshot apply plus a snapshot interval of delta applies (recent ones,
    measured), the sync deadlines set, one retry backoff, and two publish intervals."""
    rates = [p.thin_rate] + [r for n, r in s.snapshot_rate.items() if n != "us2"]
    # Measured terms are capped by fixed ceilings: a regression that slows transfers or applies
    # must fail the bound, not raise it. The link ceiling is twice the designed thin link's time;
    # the apply ceiling is ~20x what a quiet 2-core host measures (0.3 s snapshot, 0.05 s deltas).
    link_ceiling = 2 * snapshot_bytes / p.thin_rate
    measured_apply = s.apply_seconds(".snapshot", 1) + p.snapshot_every * s.apply_seconds(
        ".delta", p.snapshot_every)
    terms = {
        "2 publish intervals": 2 * p.interval_s,
        "a snapshot over the slowest link (measured, capped)":
            min(snapshot_bytes / min(rates), link_ceiling),
        f"apply a snapshot + {p.snapshot_every} deltas (recent, measured, capped)":
            min(measured_apply, APPLY_CEILING_S),
        "one sync retry backoff": RETRY_S,
    }
    if knobs.get("sync"):
        terms["progress + unoffered deadlines"] = p.progress_timeout_s + p.unoffered_timeout_s
    return {k: round(v, 2) for k, v in terms.items()}


def collect(c: Cluster, run: ChaosRun, sampler: Sampler) -> None:
    """Final statuses, weights recomputed from the files, bans ever seen, the corrupted block
    on disk, log lines about plans, bans and checks."""
    for name, d in c.daemons.items():
        if d.proc is not None and d.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                run.statuses[name] = d.status()
        elif d.proc is not None:
            run.errors.append(f"{name} is not running (exit {d.proc.returncode})")
        run.log_lines[name] = [line[-300:] for line in d.log(10**9).splitlines()
                               if any(w in line for w in LOG_WORDS)][-25:]
        if d.proc is not None and d.proc.poll() not in (None, 0):
            run.log_lines[name] += ["(exited; its log ends:)", *d.log(2500).splitlines()]
    run.trainer_digest = run.statuses.get("trainer", {}).get("state_digest")
    for name in run.regions:
        try:
            cur = WeightsDir(c.daemons[name].state_dir / "weights").verify()
            run.weights[name] = f"v{cur.version} {cur.state_digest}"
        except Exception as e:  # reported as the region's weights
            run.weights[name] = f"unverifiable: {type(e).__name__}: {e}"
    run.bans_seen = {n: list(b.values()) for n, b in sampler.bans.items()}
    run.shunned = sampler.shunned
    run.urls = {d.url: name for name, d in c.daemons.items()}
    for name, st in run.statuses.items():
        for b in st.get("bans", []):
            run.bans_seen.setdefault(name, [])
            if b not in run.bans_seen[name]:
                run.bans_seen[name].append(b)
    if run.corrupted:
        path = Path(run.corrupted["path"])
        run.block_ok_at_end = block_verifies(path, run.corrupted["block"]) \
            if path.exists() else None
    late = c.daemons.get("ap1")
    if late is not None:
        run.late["snapshots"] = snapshots_downloaded(late, run.statuses.get("ap1"))

