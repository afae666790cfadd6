"""When to write a snapshot, and which artifacts retention keeps.

Snapshots bound a late joiner's download: one is written every `every` versions, or sooner when
the deltas since the last snapshot already weigh more than a snapshot does.
"""

from dataclasses import dataclass

from chain.manifest import Manifest


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


@dataclass(frozen=True, kw_only=True)
class Retention:
    versions: int = 8
    """Keep deltas of the last this many versions (plus what bootstrapping them needs)."""

    def keep(self, manifests: dict[str, Manifest]) -> set[str]:
        """Artifact names to keep: the recent window, and the newest snapshot at or below its
        start together with every delta after that snapshot, so a late joiner can still reach
        the head."""
        if not manifests:
            return set()
        head = max(m.version for m in manifests.values())
        floor = max(0, head - self.versions + 1)
        snaps = [m.version for m in manifests.values()
                 if m.kind == "snapshot" and m.version <= floor]
        base = max(snaps) if snaps else min(m.version for m in manifests.values())
        keep = set()
        for name, m in manifests.items():
            floor_ok = m.version > base if m.kind == "delta" else m.version >= base
            if floor_ok:
                keep.add(name)
        return keep
