"""The chain store of one node: verified manifests and the blocks they reference.

`root/manifests/<artifact>.json` holds each manifest exactly as signed; `root/blocks/` is the
content-addressed block store. A manifest enters only after validation, signature check and a
parent check against what the store already holds, so a forged or wrong-parent manifest never
changes stored state.

Threads: a daemon reads the store on its event loop while worker threads (asyncio.to_thread) add
manifests and run retention. The manifest map is copy-on-write: writers, serialised by a lock,
build a new dict and swap it in; readers take the current one and iterate it without a lock, so
a reader never sees a dict change size under it (a region once crashed in `head()` that way).
"""

import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from chain.atomic import write_atomic
from chain.blocks import BlockStore
from chain.errors import BadManifest, OtherRun, Replay, WrongParent
from chain.manifest import Manifest, artifact_name, parse_artifact
from chain.planner import plan
from chain.policy import Decision, Retention


class ChainStore:
    def __init__(self, root: Path, public_key: Ed25519PublicKey | None = None) -> None:
        self.root = Path(root)
        self.public_key = public_key
        self.blocks = BlockStore(self.root / "blocks")
        self.manifest_dir = self.root / "manifests"
        self.manifest_dir.mkdir(parents=True, exist_ok=True)
        self._cache: Mapping[str, Manifest] = {}
        """Never changed in place: writers swap in a new dict (see the module docstring)."""
        self._write = threading.RLock()
        cache: dict[str, Manifest] = {}
        for path in sorted(self.manifest_dir.glob("v*.json")):
            try:
                m = Manifest.parse(path.read_bytes(), None)
            except BadManifest as e:
                raise BadManifest(f"{path}: {e}; delete the file to refetch it from peers"
                                  ) from None
            cache[m.artifact] = m
        self._cache = cache

    # reading
    def artifacts(self) -> list[str]:
        return sorted(self._cache)

    def manifests(self) -> dict[str, Manifest]:
        return dict(self._cache)

    def manifest(self, artifact: str) -> Manifest:
        try:
            return self._cache[artifact]
        except KeyError:
            raise BadManifest(f"artifact {artifact} is not in the chain at {self.root}") from None

    def get(self, version: int, kind: str) -> Manifest | None:
        return self._cache.get(artifact_name(version, kind))

    def manifest_bytes(self, artifact: str) -> bytes:
        parse_artifact(artifact)
        path = self.manifest_dir / f"{artifact}.json"
        if not path.is_file():
            raise BadManifest(f"artifact {artifact} is not in the chain at {self.root}")
        return path.read_bytes()

    def head(self) -> int | None:
        return max((m.version for m in self._cache.values()), default=None)

    def run(self) -> str | None:
        cache = self._cache
        return next(iter(cache.values())).run if cache else None

    def has_blocks(self, m: Manifest) -> bool:
        return all(self.blocks.has(b.id) for b in m.blocks)

    def missing_blocks(self, m: Manifest) -> list[str]:
        return [b.id for b in m.blocks if not self.blocks.has(b.id)]

    def plan(self, have: int | None, target: int,
             holders: Mapping[str, int] | None = None) -> list[Manifest]:
        return plan(self._cache, have, target, holders)

    # writing
    def check(self, m: Manifest) -> None:
        """Refuse a manifest that conflicts with the chain already held (replay, fork, other
        run, wrong parent)."""
        run = self.run()
        if run is not None and m.run != run:
            raise OtherRun(f"{m.artifact} belongs to run {m.run!r}, this chain is {run!r}")
        held = self._cache.get(m.artifact)
        if held is not None and held.canonical() != m.canonical():
            raise Replay(f"{m.artifact} conflicts with the one already held (fork/replay)")
        if m.kind == "delta":
            prev = self.get(m.version - 1, "delta") or self.get(m.version - 1, "snapshot")
            if prev is not None and prev.state_digest != m.parent.state_digest:
                raise WrongParent(
                    f"{m.artifact} names parent digest {m.parent.state_digest[:12]}… but v"
                    f"{m.version - 1} here has {prev.state_digest[:12]}… (wrong parent)"
                )
        other = self.get(m.version, "snapshot" if m.kind == "delta" else "delta")
        if other is not None and other.state_digest != m.state_digest:
            raise BadManifest(f"{m.artifact} disagrees with v{m.version}'s other artifact")

    def add_manifest(self, raw: bytes, public_key: Ed25519PublicKey | None = None) -> Manifest:
        m = Manifest.parse(raw, public_key or self.public_key)
        with self._write:
            self.check(m)
            if m.artifact not in self._cache:
                write_atomic(self.manifest_dir / f"{m.artifact}.json", m.to_bytes())
                self._cache = {**self._cache, m.artifact: m}
        return m

    def add(self, m: Manifest) -> Manifest:
        return self.add_manifest(m.to_bytes())

    def gc(self, retention: Retention, protect: Iterable[str] = frozenset(),
           live: Iterable[int | None] = ()) -> list[str]:
        """Drop artifacts outside retention (except `protect`) and unreferenced blocks; `live`
        are the versions live nodes hold (see Retention.decide)."""
        live = tuple(live)
        return self.retain(lambda held: retention.decide(held, live), protect)[1]

    def retain(self, decide: Callable[[Mapping[str, Manifest]], Decision],
               protect: Iterable[str] = frozenset()) -> tuple[Decision, list[str]]:
        """`decide` on the manifests held and apply it, both under the write lock, so a
        manifest another thread adds meanwhile is neither unseen by the decision nor dropped
        for it."""
        with self._write:
            decision = decide(self._cache)
            return decision, self.apply_decision(decision, protect)

    def apply_decision(self, decision: Decision, protect: Iterable[str] = frozenset()
                       ) -> list[str]:
        """Keep what `decision` keeps (and `protect`); prefer `retain`, which decides on the
        same manifests it applies to."""
        keep = set(decision.keep) | set(protect)
        with self._write:
            cache = self._cache
            dropped = [a for a in cache if a not in keep]
            self._cache = {a: m for a, m in cache.items() if a in keep}
            for a in dropped:
                (self.manifest_dir / f"{a}.json").unlink(missing_ok=True)
            # Under the lock: a manifest added meanwhile must not lose the blocks it names.
            live = {b.id for m in self._cache.values() for b in m.blocks}
            for bid in self.blocks.ids() - live:
                self.blocks.delete(bid)
        return dropped
