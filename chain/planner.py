"""Choosing the cheapest way (in bytes) from what a node holds to a target version.

A node at version h can apply the deltas h+1..target, or start from any snapshot s and apply
s+1..target; a late joiner (h = None) must start from a snapshot. Only artifacts whose manifests
are known count, so a delta dropped by retention simply makes that path impossible.

A manifest says an artifact existed, not that anyone still serves it. Given `holders` (how many
live peers, this node included, hold each artifact in full), a path whose every artifact has a
holder beats any cheaper path that waits on an artifact nobody offers: a trainer that dropped a
delta, or died holding its only copy, must not leave a region waiting for it forever.
"""

from collections.abc import Mapping
from typing import Protocol

from chain.errors import NoPath
from chain.manifest import artifact_name


class Artifact(Protocol):
    """What the planner reads of a manifest (chain.manifest.Manifest has these)."""

    @property
    def version(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def payload_bytes(self) -> int: ...


def paths(manifests: Mapping[str, Artifact], have: int | None, target: int) -> list[list]:
    """Every way to reach `target`: the deltas from `have`, and each snapshot s (newer than
    `have`, at most `target`) followed by the deltas after it; each in apply order."""

    def deltas(start: int) -> list | None:
        chain = []
        for v in range(start + 1, target + 1):
            m = manifests.get(artifact_name(v, "delta"))
            if m is None:
                return None
            chain.append(m)
        return chain

    options: list[list] = []
    if have is not None and have < target:
        d = deltas(have)
        if d is not None:
            options.append(d)
    for m in manifests.values():
        if m.kind == "snapshot" and m.version <= target and (have is None or m.version > have):
            d = deltas(m.version)
            if d is not None:
                options.append([m, *d])
    return options


def plan(manifests: Mapping[str, Artifact], have: int | None, target: int,
         holders: Mapping[str, int] | None = None) -> list:
    """The list of artifacts to apply in order; [] if already at target. Without `holders`:
    the fewest bytes. With it: the fewest artifacts that no holder lists, then the fewest
    bytes (an artifact missing from `holders` has none)."""
    if have == target:
        return []
    options = paths(manifests, have, target)
    if not options:
        raise NoPath(
            f"no path from {'nothing' if have is None else f'v{have}'} to v{target}: need a "
            "snapshot at or before the target and every delta after it; ask a peer that keeps "
            "older versions, or raise retention on the trainer"
        )

    def unheld(path: list) -> int:
        if holders is None:
            return 0
        return sum(1 for m in path if holders.get(artifact_name(m.version, m.kind), 0) <= 0)

    return min(options, key=lambda p: (unheld(p), path_bytes(p), len(p)))


def path_bytes(path: list) -> int:
    return sum(m.payload_bytes for m in path)
