"""The chain store of one node: verified manifests and the blocks they reference.

`root/manifests/<artifact>.json` holds each manifest exactly as signed; `root/blocks/` is the
content-addressed block store. A manifest enters only after validation, signature check and a
parent check against what the store already holds, so a forged or wrong-parent manifest never
changes stored state.

Threads: a daemon reads the store on its event loop while worker threads (asyncio.to_thread) add
manifests and run retention. The manifest map is copy-on-write: writers, serialised by a lock,
build a new dict and swap it in; readers take the current one and iterate it without a lock, so
a reader never sees a dict change size under it (a region once crashed in `head()` that way).

Processes: a trainer's chain directory is written by its publisher and pruned by its daemon
(issue 20). Besides the thread lock, the directory has a file lock (chain.lease.ChainLock),
taken by every retention pass (which skips its turn, ChainBusy, rather than wait long for it),
by a publisher's commit and by the taking of a lease; a publisher holds a write lease
(`writing`) while it writes a version, and retention spares its blocks, the blocks of every
manifest file on disk (including ones this process has not loaded), and, while a lease is
held here, `add` stores only a manifest whose blocks are all present.
"""

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from chain.atomic import write_atomic
from chain.blocks import BlockStore, check_id
from chain.errors import BadBlock, BadManifest, OtherRun, Replay, WrongParent
from chain.lease import (
    DEFAULT_TTL_S,
    RETENTION_WAIT_S,
    SLACK_S,
    Lease,
    LeaseInfo,
    LostBlocks,
    chain_lock,
    sweep,
)
from chain.manifest import MAX_MANIFEST_BYTES, Manifest, artifact_name, parse_artifact
from chain.planner import plan
from chain.policy import Decision, Retention

log = logging.getLogger("deltaswarm.store")


class ChainStore:
    def __init__(self, root: Path, public_key: Ed25519PublicKey | None = None) -> None:
        self.root = Path(root)
        self.public_key = public_key
        self.manifest_dir = self.root / "manifests"
        self.manifest_dir.mkdir(parents=True, exist_ok=True)
        self._write = threading.RLock()
        self.dir_lock = chain_lock(self.root)
        """Across processes: retention passes, leases being taken, a publisher's commit."""
        self.blocks = BlockStore(self.root / "blocks", self.dir_lock)
        self._cache: Mapping[str, Manifest] = {}
        """Never changed in place: writers swap in a new dict (see the module docstring)."""
        self._holding: list[Lease] = []
        self.writing_seen: list[LeaseInfo] = []
        """The live write leases the last retention pass honoured (status)."""
        self.spared_blocks = 0
        """Unreferenced blocks the last retention pass kept for them."""
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
        """Store a manifest; while this store holds a write lease (a publisher committing the
        version it wrote), only if every block it names is present, checked under the lock
        retention takes, so a version missing blocks is never signed into the chain."""
        if not self._holding:
            return self._add_built(m)
        with self._write, self.dir_lock:
            missing = self.missing_blocks(m)
            if missing:
                lost = any(lease.lost for lease in self._holding)
                raise LostBlocks(
                    f"{m.artifact}: {len(missing)} of its {len(m.blocks)} blocks vanished from "
                    f"{self.blocks.root} while it was being written (e.g. {missing[0]}; "
                    + ("its write lease lapsed: this publisher was stopped longer than its "
                       "ttl" if lost else "deleted by something that ignores write leases")
                    + f"). Nothing was signed; the head is still v{self.head()}: publish this "
                    "version again")
            return self._add_built(m)

    def _add_built(self, m: Manifest) -> Manifest:
        """Store a manifest built in this process: refused as a received one would be (too
        large, not signed by the pinned key, in conflict with the chain), but not dumped and
        parsed back to check it (at 50,000 tensors that cost a tenth of a publish)."""
        raw = m.to_bytes()
        if len(raw) > MAX_MANIFEST_BYTES:
            raise BadManifest(f"{m.artifact}: manifest of {len(raw)} bytes exceeds "
                              f"{MAX_MANIFEST_BYTES}; peers would refuse it")
        if self.public_key is not None:
            m.check_signature(self.public_key)
        with self._write:
            self.check(m)
            if m.artifact not in self._cache:
                write_atomic(self.manifest_dir / f"{m.artifact}.json", raw)
                self._cache = {**self._cache, m.artifact: m}
        return m

    def writing(self, version: int, ttl_s: float = DEFAULT_TTL_S) -> Lease:
        """The write lease for `version`, to hold (`with`) from before its first block is
        written until its manifests are added: retention spares what it writes meanwhile."""
        return Lease(self.root, version, self.dir_lock, ttl_s, self._holding)

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
        for it; and under the directory's lock (ChainBusy if a publisher holds it too long)."""
        with self._write, self.dir_lock.within(RETENTION_WAIT_S, "retention"):
            self._forget_vanished()
            decision = decide(self._cache)
            return decision, self.apply_decision(decision, protect)

    def _forget_vanished(self) -> None:
        """Forget manifests whose file another process (the daemon's retention) removed, so a
        decision is made on what the directory holds."""
        cache = self._cache
        gone = [a for a in cache if not (self.manifest_dir / f"{a}.json").is_file()]
        if gone:
            self._cache = {a: m for a, m in cache.items() if a not in gone}

    def _blocks_on_disk_only(self) -> set[str]:
        """Blocks named by manifest files this process has not loaded (a publisher's newest,
        before its daemon is told): never deleted here, whether verified yet or not."""
        out: set[str] = set()
        cache = self._cache
        for path in self.manifest_dir.glob("v*.json"):
            if path.name.removesuffix(".json") in cache:
                continue
            try:  # only the block ids: a full parse of a large manifest costs seconds
                blocks = json.loads(path.read_bytes())["blocks"]
                out |= {check_id(b["id"]) for b in blocks}
            except (ValueError, KeyError, TypeError, OSError, BadBlock):
                continue
        return out

    def apply_decision(self, decision: Decision, protect: Iterable[str] = frozenset()
                       ) -> list[str]:
        """Keep what `decision` keeps (and `protect`); prefer `retain`, which decides on the
        same manifests it applies to."""
        keep = set(decision.keep) | set(protect)
        with self._write, self.dir_lock.within(RETENTION_WAIT_S, "retention"):
            cache = self._cache
            dropped = [a for a in cache if a not in keep]
            self._cache = {a: m for a, m in cache.items() if a in keep}
            for a in dropped:
                (self.manifest_dir / f"{a}.json").unlink(missing_ok=True)
            # Under the lock: a manifest added meanwhile must not lose the blocks it names,
            # nor a version being written (a write lease) those written so far.
            live = {bid for m in self._cache.values() for bid in m.blocks.ids()}
            live |= self._blocks_on_disk_only()
            now = time.time()
            writing = sweep(self.root, now)
            floor = min(w.started for w in writing) - SLACK_S if writing else None
            spared = 0
            for bid in self.blocks.ids() - live:
                if floor is not None and (self.blocks.mtime(bid) or 0.0) >= floor:
                    spared += 1
                    continue
                self.blocks.delete(bid)
            self.writing_seen, self.spared_blocks = writing, spared
            if spared:
                log.info("retention spared %d unreferenced blocks for versions being written "
                         "(%s)", spared, ", ".join(f"v{w.version} pid {w.pid}" for w in writing))
        return dropped
