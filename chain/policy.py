"""When to write a snapshot, and which artifacts retention keeps.

Snapshots bound a late joiner's download: one is written every `every` versions, or sooner when
the deltas since the last snapshot already weigh more than a snapshot does.

Retention keeps a window of recent versions plus the snapshot a late joiner starts from, and,
within a byte budget, the older deltas that live nodes which are behind still need to reach the
head cheaply (deltas from their own version instead of a snapshot). A node past the budget falls
back to a snapshot by design; the decision says which. One decision serves every process that
deletes from a chain directory (the trainer's daemon and its publisher, regions), so none
deletes what another would keep.
"""

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from chain.atomic import write_atomic
from chain.errors import ChainError
from chain.manifest import Manifest, artifact_name
from chain.planner import path_bytes, paths

DECISION_FILE = "retention.json"
"""Where a daemon records its retention settings and the live versions it saw, in its chain
directory, so a publisher writing into the same directory decides the same way."""


@dataclass(frozen=True, kw_only=True)
class SnapshotPolicy:
    every: int = 20
    """Write a snapshot at least every this many versions."""
    max_delta_ratio: float = 1.0
    """...or when the deltas since the last snapshot exceed this fraction of a snapshot."""

    def due(self, version: int, manifests: dict[str, Manifest]) -> bool:
        snaps = [m for m in manifests.values() if m.kind == "snapshot" and m.version <= version]
        if not snaps:
            return True
        last = max(snaps, key=lambda m: m.version)
        if version - last.version >= self.every:
            return True
        since = sum(m.payload_bytes for m in manifests.values()
                    if m.kind == "delta" and last.version < m.version <= version)
        return since > self.max_delta_ratio * last.payload_bytes


@dataclass(frozen=True)
class Decision:
    """What retention keeps, and for whom."""

    keep: frozenset[str]
    budget_bytes: int
    used_bytes: int = 0
    """Bytes kept beyond the window for nodes that are behind."""
    live: tuple[int | None, ...] = ()
    kept_for: tuple[int, ...] = ()
    """Versions of live nodes for which older deltas are kept (they reach the head by deltas)."""
    fell_back: tuple[int, ...] = ()
    """Versions of live nodes whose deltas did not fit the budget: they take a snapshot."""
    extra: frozenset[str] = field(default_factory=frozenset)

    def as_status(self) -> dict:
        return {"budget_bytes": self.budget_bytes, "used_bytes": self.used_bytes,
                "live": list(self.live), "kept_for": list(self.kept_for),
                "fell_back": list(self.fell_back), "kept_extra": sorted(self.extra)}


@dataclass(frozen=True, kw_only=True)
class Retention:
    versions: int = 8
    """Keep deltas of the last this many versions (plus what bootstrapping them needs)."""
    behind_budget_bytes: int = 1 << 30
    """Most bytes kept beyond that window for live nodes that are behind; 0 keeps none."""

    def keep(self, manifests: Mapping[str, Manifest],
             live: Iterable[int | None] = ()) -> set[str]:
        return set(self.decide(manifests, live).keep)

    def window(self, manifests: Mapping[str, Manifest]) -> set[str]:
        """The recent window, and the newest snapshot at or below its start together with every
        delta after that snapshot, so a late joiner can still reach the head."""
        if not manifests:
            return set()
        head = max(m.version for m in manifests.values())
        floor = max(0, head - self.versions + 1)
        snaps = [m.version for m in manifests.values()
                 if m.kind == "snapshot" and m.version <= floor]
        base = max(snaps) if snaps else min(m.version for m in manifests.values())
        return {name for name, m in manifests.items()
                if (m.version > base if m.kind == "delta" else m.version >= base)}

    def decide(self, manifests: Mapping[str, Manifest],
               live: Iterable[int | None] = ()) -> Decision:
        """The window, plus, nearest version first, the deltas a live node at version h needs
        (h+1..head) when that path is cheaper than the cheapest snapshot path left and its
        extra bytes still fit `behind_budget_bytes`; a node that does not fit falls back."""
        live = tuple(live)
        keep = self.window(manifests)
        if not manifests:
            return Decision(frozenset(), self.behind_budget_bytes, live=live)
        head = max(m.version for m in manifests.values())
        kept = {n: manifests[n] for n in keep}
        cheapest_snapshot = min((path_bytes(p) for p in paths(kept, None, head)), default=None)
        extra: set[str] = set()
        used = 0
        kept_for: list[int] = []
        fell_back: list[int] = []
        for h in sorted({v for v in live if v is not None and v < head}, reverse=True):
            need = [artifact_name(v, "delta") for v in range(h + 1, head + 1)]
            if any(n not in manifests for n in need):
                continue  # no delta path from h exists any more: nothing to save
            add = [n for n in need if n not in keep and n not in extra]
            if not add:
                continue  # the window already serves it
            if cheapest_snapshot is not None and \
                    sum(manifests[n].payload_bytes for n in need) >= cheapest_snapshot:
                continue  # a snapshot is the cheap path for it anyway
            cost = sum(manifests[n].payload_bytes for n in add)
            if used + cost > self.behind_budget_bytes:
                fell_back.append(h)
                continue
            extra.update(add)
            used += cost
            kept_for.append(h)
        return Decision(frozenset(keep | extra), self.behind_budget_bytes, used, live,
                        tuple(kept_for), tuple(fell_back), frozenset(extra))


def record_decision(chain_dir: Path, retention: Retention, live: Iterable[int | None],
                    now: float | None = None) -> None:
    """Write the settings and the live versions a daemon decided with, for its publisher."""
    doc = {"versions": retention.versions, "behind_budget_bytes": retention.behind_budget_bytes,
           "live": list(live), "time": time.time() if now is None else now}
    write_atomic(Path(chain_dir) / DECISION_FILE, json.dumps(doc).encode())


def recorded_decision(chain_dir: Path) -> tuple[Retention, list[int | None]] | None:
    """The daemon's recorded settings and live versions; None if it recorded none yet."""
    path = Path(chain_dir) / DECISION_FILE
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_bytes())
        live = [v if v is None else int(v) for v in doc["live"]]
        return Retention(versions=int(doc["versions"]),
                         behind_budget_bytes=int(doc["behind_budget_bytes"])), live
    except (ValueError, KeyError, TypeError) as e:
        raise ChainError(f"{path}: not a retention record ({e!r}); delete it and the daemon "
                         "writes a new one on its next publish") from None
