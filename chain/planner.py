"""Choosing the cheapest way (in bytes) from what a node holds to a target version.

A node at version h can apply the deltas h+1..target, or start from any snapshot s and apply
s+1..target; a late joiner (h = None) must start from a snapshot. Only artifacts whose manifests
are known count, so a delta dropped by retention simply makes that path impossible.
"""

from chain.errors import NoPath
from chain.manifest import Manifest, artifact_name


def plan(manifests: dict[str, Manifest], have: int | None, target: int) -> list[Manifest]:
    """The cheapest list of artifacts to apply in order; [] if already at target."""
    if have == target:
        return []

    def deltas(start: int) -> list[Manifest] | None:
        chain = []
        for v in range(start + 1, target + 1):
            m = manifests.get(artifact_name(v, "delta"))
            if m is None:
                return None
            chain.append(m)
        return chain

    options: list[list[Manifest]] = []
    if have is not None and have < target:
        d = deltas(have)
        if d is not None:
            options.append(d)
    for m in manifests.values():
        if m.kind == "snapshot" and m.version <= target and (have is None or m.version > have):
            d = deltas(m.version)
            if d is not None:
                options.append([m, *d])
    if not options:
        raise NoPath(
            f"no path from {'nothing' if have is None else f'v{have}'} to v{target}: need a "
            "snapshot at or before the target and every delta after it; ask a peer that keeps "
            "older versions, or raise retention on the trainer"
        )
    return min(options, key=lambda p: (sum(m.payload_bytes for m in p), len(p)))
