"""Fault tooling for the chaos scenario (tests/integration/chaos_scenario.py): flipping bytes in
a block a node seeds, killing a region -9 in the middle of a download (and restarting it), and
reading what the daemons report (bans, snapshots a node downloaded) in the old and new status
shapes, so the same scenario runs against today's daemon and the one with issue 11's fixes.

Every helper acts on real files and real processes (tests/integration/harness.py); nothing here
is a mock.
"""

import re
import threading
import time
from pathlib import Path
from typing import Any

from chain.digest import block_id
from chain.manifest import Manifest
from daemon.config import Config
from tests.integration.harness import Daemon

SNAPSHOT_LOG = re.compile(r"downloading (v\d{8}\.snapshot)")


# --- config the daemon may or may not know yet ---------------------------------------------------
def config_knows(*path: str) -> bool:
    """True when the daemon's config model has the (nested) field `path`, e.g. ("sync",) or
    ("retention", "behind_budget_bytes"): issue 11's new knobs are set only where they exist,
    so the scenario also runs (and shows the findings) on the daemon without them."""
    model: Any = Config
    for name in path:
        fields = getattr(model, "model_fields", None)
        if not fields or name not in fields:
            return False
        model = fields[name].annotation
    return True


def within_field(value: float, *path: str) -> float:
    """`value` moved inside the bounds (ge/gt/le/lt) the config declares for the field at `path`,
    so a test-sized interval never trips validation whatever bound the owner chose."""
    model: Any = Config
    info = None
    for name in path:
        info = model.model_fields[name]
        model = info.annotation
    for m in getattr(info, "metadata", []):
        for attr, fix in (("ge", max), ("gt", lambda v, b: max(v, b * 1.01 + 1e-3)),
                          ("le", min), ("lt", lambda v, b: min(v, b * 0.99))):
            bound = getattr(m, attr, None)
            if bound is not None:
                value = fix(value, bound)
    return value


# --- corrupting what a seeder serves -------------------------------------------------------------
def manifest_of(d: Daemon, artifact: str) -> Manifest:
    return Manifest.parse((d.state_dir / "chain" / "manifests" / f"{artifact}.json").read_bytes(),
                          None)


def served_block(d: Daemon, artifact: str) -> tuple[str, Path]:
    """(block id, path) of the first block of `artifact` in `d`'s swarm tree: the file its
    libtorrent session reads when a peer asks for those pieces (a hard link of the chain
    store's block, so both see a change)."""
    m = manifest_of(d, artifact)
    b = max(m.blocks, key=lambda b: b.size)
    path = d.state_dir / "swarm" / artifact / b.id[:2] / b.id
    if not path.is_file():
        raise FileNotFoundError(f"{d.name} does not seed {artifact}: no {path}")
    return b.id, path


def flip_bytes(path: Path, count: int = 16, every: int = 16 * 1024) -> list[int]:
    """Invert `count` bytes in the middle of every `every`-byte chunk of `path` (16 KiB: each
    request a peer makes of it), in place: same inode, so every hard link and the page cache
    libtorrent reads from see it. Returns the offsets."""
    size = path.stat().st_size
    offsets = [min(size - count, start + every // 2) for start in range(0, size, every)]
    with open(path, "r+b") as f:
        for offset in offsets:
            f.seek(offset)
            data = f.read(count)
            f.seek(offset)
            f.write(bytes(b ^ 0xFF for b in data))
    return offsets


def block_verifies(path: Path, bid: str) -> bool:
    return path.is_file() and block_id(path.read_bytes()) == bid


# --- killing a region in the middle of a download -------------------------------------------------
class KillMidDownload(threading.Thread):
    """Watches `victim`'s status; once the first artifact it fetches whose name ends with
    `suffix` is between `lo` and `hi` of its bytes, kills the process -9, waits `down_s`, and
    starts it again (same config and state dir).

    Any snapshot, not v0's by name: a region that hears of the run only after the next
    snapshot is out starts from that one (CI once saw us2 do so under load, and the kill never
    came); what the premise needs is a kill in the middle of a snapshot download."""

    def __init__(self, victim: Daemon, suffix: str, lo: float, hi: float, down_s: float,
                 timeout: float = 90.0) -> None:
        super().__init__(name=f"kill-{victim.name}", daemon=True)
        self.victim, self.suffix = victim, suffix
        self.lo, self.hi, self.down_s, self.timeout = lo, hi, down_s, timeout
        self.stop_event = threading.Event()
        self.killed: dict | None = None
        self.restarted_at: float | None = None
        self.error: str | None = None

    def run(self) -> None:
        try:
            self._run()
        except Exception as e:  # reported by the scenario, never lost in a thread
            self.error = f"{type(e).__name__}: {e}"

    def _run(self) -> None:
        deadline = time.monotonic() + self.timeout
        seen: dict[str, float] = {}  # each matching artifact's latest fraction, for the error
        while not self.stop_event.is_set() and time.monotonic() < deadline:
            try:
                st = self.victim.status()
            except (OSError, ValueError):
                st = {}
            for t in st.get("versions", []):
                if not (t["artifact"].endswith(self.suffix) and t["total_bytes"]):
                    continue
                seen[t["artifact"]] = t["done_bytes"] / t["total_bytes"]
                if self.lo * t["total_bytes"] < t["done_bytes"] < self.hi * t["total_bytes"]:
                    self._kill_and_restart(t)
                    return
            time.sleep(0.1)
        why = "the run ended" if self.stop_event.is_set() else f"{self.timeout:.0f}s passed"
        saw = ", ".join(f"{a} at {f:.0%}" for a, f in seen.items()) or "none"
        self.error = f"{self.victim.name} never held {self.lo:.0%}-{self.hi:.0%} of a " \
                     f"{self.suffix} before {why} (last seen: {saw})"

    def _kill_and_restart(self, t: dict) -> None:
        self.victim.kill9()
        self.killed = {"artifact": t["artifact"], "done_bytes": t["done_bytes"],
                       "total_bytes": t["total_bytes"], "at": time.monotonic()}
        if self.stop_event.wait(self.down_s):
            return
        self.victim.start()
        self.restarted_at = time.monotonic()
        self.victim.wait_ready(120)


# --- reading status in both shapes ---------------------------------------------------------------
def ban_key(ban: dict) -> tuple[str, str | None]:
    """(banned host, artifact or None) of one status ban: issue 11's shape has `endpoint`
    (host:port) and `artifact`; the old one `peer` (an IP, for every torrent)."""
    target = ban.get("endpoint") or ban.get("peer") or "?"
    host = target.rsplit(":", 1)[0] if target.count(":") == 1 else target
    return host.strip("[]"), ban.get("artifact")


def snapshots_downloaded(d: Daemon, status: dict | None) -> list[str]:
    """Distinct snapshots `d` started downloading (its log, whole since the first start) or
    applied (its status)."""
    names = set(SNAPSHOT_LOG.findall(d.log_path.read_text(errors="replace")))
    applied = ((status or {}).get("detail", {}).get("sync", {}) or {}).get("applied", [])
    names |= {a["artifact"] for a in applied if a["artifact"].endswith(".snapshot")}
    return sorted(names)
