"""Publishing a trainer's HF checkpoint directories: how verl, slime, prime-rl or a Megatron
trainer that already writes `step_100/`, `step_200/`, ... feeds the swarm with no code change.

    pub = CheckpointPublisher(chain_dir, key_path, run, state_dir, daemon_url, token)
    pub.publish(inspect_checkpoint(Path("ckpts/step_100")), step=100)

Completeness: a trainer may write the index last (save_pretrained), a marker file, or neither,
so `inspect_checkpoint` trusts no single signal. A directory is complete when config.json
parses, every .safetensors file's header parses and its length is exactly what the header
says (a file still being appended is short), the files are exactly those the index names (or
one unsharded file), every indexed tensor is in the file the index says, the marker exists
when one is configured, and `settled` sees no file change size or mtime over a settle time
(a preallocated file being filled in place, a config being rewritten).

Memory: the new checkpoint and the parent are both read through memory maps (chain.sources
.FileSource) in the writer's bounded batches, never loaded whole. The parent is not kept in
RAM as the in-process Publisher does: it is a verified reconstruction of the chain head under
`state_dir/head` (chain.weights.WeightsDir, the code a region daemon runs), brought forward by
each published version (O(changes)), so it survives restarts and the trainer may delete old
checkpoints. Disk: two copies of the model there.

Restart: `state_dir/published.json` records each published directory (path, step, version)
and, while one is being published, that one as pending; a publish that reached the chain
before a crash is recognised by the chain head and recorded, never published twice. What the
trainer rewrites while it is being read is not signed (fingerprint checked before signing).
"""

import json
import logging
import re
import struct
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chain import keys
from chain.atomic import write_atomic
from chain.blocks import DEFAULT_BLOCK
from chain.errors import ChainError
from chain.follow import publisher_retain
from chain.manifest import Manifest
from chain.policy import Retention, SnapshotPolicy
from chain.safetensors_io import INDEX_NAME, read_header
from chain.sources import FileSource
from chain.store import ChainStore
from chain.weights import WeightsDir
from chain.writer import write_artifact

log = logging.getLogger("deltaswarm.checkpoints")

MAX_FILE = 64 * 1024 * 1024
"""Largest non-weight file carried with a version (config, tokenizer); bigger ones are refused."""
SKIP = re.compile(r"^(optimizer.*|scheduler.*|rng_state.*|trainer_state\.json|training_args\.bin"
                  r"|.*\.(pt|pth|bin|ckpt|distcp|safetensors|tmp|lock|part))$")
"""Training state a checkpoint directory holds beside the model; never sent to rollouts."""
SHARD_NAME = re.compile(r"-\d{5}-of-\d{5}\.safetensors$")


class Incomplete(ChainError):
    """The directory is not (yet) a whole checkpoint; the message says what is missing."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    weights: tuple[str, ...]
    """The .safetensors files, by name."""
    files: tuple[str, ...]
    """Config and tokenizer files carried with the version."""
    fingerprint: tuple[tuple[str, int, int], ...]
    """(name, size, mtime_ns) of every file: equal fingerprints mean nothing was rewritten."""


def _fingerprint(path: Path) -> tuple[tuple[str, int, int], ...]:
    out = []
    for p in sorted(path.iterdir()):
        if p.is_file():
            st = p.stat()
            out.append((p.name, st.st_size, st.st_mtime_ns))
    return tuple(out)


def _described_size(f: Path) -> int:
    """The length a safetensors file has once whole: 8 + header + the furthest data offset."""
    try:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > 100 * 1024 * 1024:
                raise ValueError(f"implausible header length {n}")
            doc = json.loads(fh.read(n))
        ends = [int(v["data_offsets"][1]) for k, v in doc.items() if k != "__metadata__"]
    except (OSError, ValueError, struct.error, KeyError, TypeError, IndexError) as e:
        raise Incomplete(f"{f}: header not readable yet ({e})") from None
    return 8 + n + max(ends, default=0)


def inspect_checkpoint(path: Path | str, marker: str | None = None) -> Checkpoint:
    """The checkpoint at `path` if it is whole now; `Incomplete` naming what is not."""
    path = Path(path)
    if not path.is_dir():
        raise Incomplete(f"{path} is not a directory")
    if marker is not None and not (path / marker).is_file():
        raise Incomplete(f"{path}: marker file {marker} not written yet")
    try:
        json.loads((path / "config.json").read_bytes())
    except (OSError, ValueError) as e:
        raise Incomplete(f"{path}: config.json missing or not complete JSON ({e})") from None
    weights = sorted(p.name for p in path.glob("*.safetensors") if p.is_file())
    if not weights:
        raise Incomplete(f"{path}: no .safetensors files yet")
    held: dict[str, set[str]] = {}
    for name in weights:
        f = path / name
        want, size = _described_size(f), f.stat().st_size
        if size != want:
            raise Incomplete(f"{f}: {size} bytes, its header describes {want}"
                             f"{' (still being written)' if size < want else ''}")
        try:
            held[name] = set(read_header(f)[1])
        except (ChainError, OSError) as e:
            raise Incomplete(f"{f}: not valid safetensors ({e})") from None
    index = path / INDEX_NAME
    if index.exists():
        try:
            weight_map = json.loads(index.read_bytes())["weight_map"]
            named = set(weight_map.values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise Incomplete(f"{index}: not a complete index ({e})") from None
        if named != set(weights):
            raise Incomplete(f"{path}: the index names {sorted(named)}, the directory holds "
                             f"{weights}")
        for tensor, fname in weight_map.items():
            if tensor not in held[fname]:
                raise Incomplete(f"{path}: index puts {tensor} in {fname}, which lacks it")
        if sum(len(v) for v in held.values()) != len(weight_map):
            raise Incomplete(f"{path}: the shards hold tensors the index does not list")
    elif len(weights) > 1 or SHARD_NAME.search(weights[0]):
        raise Incomplete(f"{path}: sharded weights {weights} but no {INDEX_NAME} yet (written "
                         "last by save_pretrained)")
    files = []
    for p in sorted(path.iterdir()):
        if (not p.is_file() or p.name.startswith(".") or p.name in (INDEX_NAME, marker)
                or SKIP.match(p.name) or p.stat().st_size == 0):
            continue
        if p.stat().st_size > MAX_FILE:
            raise ChainError(f"{p}: {p.stat().st_size} bytes is too large to carry with a "
                             f"version (limit {MAX_FILE}); move it out of the checkpoint")
        files.append(p.name)
    return Checkpoint(path, tuple(weights), tuple(files), _fingerprint(path))


def settled(path: Path | str, settle_s: float, marker: str | None = None) -> Checkpoint:
    """`inspect_checkpoint` twice, `settle_s` apart, with nothing changed in between."""
    first = inspect_checkpoint(path, marker)
    time.sleep(settle_s)
    second = inspect_checkpoint(path, marker)
    if second.fingerprint != first.fingerprint:
        raise Incomplete(f"{path}: files changed during the {settle_s:g} s settle time")
    return second


def _unchanged(ckpt: Checkpoint) -> None:
    """Refuse to sign what was read if the trainer rewrote the directory meanwhile (what was
    read may mix two saves); the next scan sees the new files."""
    if _fingerprint(ckpt.path) != ckpt.fingerprint:
        raise Incomplete(f"{ckpt.path} changed while it was being published; not signed")


@dataclass(frozen=True)
class PublishedCheckpoint:
    version: int
    path: Path
    step: int | None
    manifest: Manifest
    snapshot: bool
    notified: bool


class CheckpointPublisher:
    """Publishes checkpoint directories as consecutive versions of a chain (see module doc)."""

    def __init__(self, chain_dir: Path | str, key_path: Path | str, run: str,
                 state_dir: Path | str, daemon_url: str | None = None, token: str | None = None,
                 snapshots: SnapshotPolicy | None = None, retention: Retention | None = None,
                 block_size: int = DEFAULT_BLOCK) -> None:
        self.key = keys.load_private(Path(key_path))
        self.store = ChainStore(Path(chain_dir), self.key.public_key())
        if self.store.run() not in (None, run):
            raise ChainError(f"{chain_dir} holds run {self.store.run()!r}, not {run!r}")
        self.run = run
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.head_dir = WeightsDir(self.state_dir / "head")
        self.ledger_path = self.state_dir / "published.json"
        self.daemon_url = daemon_url.rstrip("/") if daemon_url else None
        self.token = token
        self.snapshots = snapshots or SnapshotPolicy()
        self.retention = retention or Retention()
        self.block_size = block_size
        self.ledger = self._load_ledger()

    # --- the ledger of published directories -------------------------------------------------
    def _load_ledger(self) -> dict[str, Any]:
        if not self.ledger_path.exists():
            return {"run": self.run, "published": [], "pending": None}
        try:
            doc = json.loads(self.ledger_path.read_text())
            doc["published"], doc.get("pending")
        except (ValueError, KeyError, TypeError) as e:
            raise ChainError(f"{self.ledger_path} is damaged ({e}); restore it, or rebuild it "
                             "by hand from `deltaswarm chain ls` of the chain dir") from None
        pending = doc.get("pending")
        if pending is not None:
            head = self.store.head()
            if head is not None and head >= pending["version"]:
                doc["published"].append(pending)  # reached the chain before the crash
                log.info("recorded %s as v%d (published before a restart)", pending["dir"],
                         pending["version"])
            doc["pending"] = None
            self._write_ledger(doc)
        return doc

    def _write_ledger(self, doc: dict[str, Any]) -> None:
        write_atomic(self.ledger_path, (json.dumps(doc, indent=1) + "\n").encode())

    def published(self) -> list[dict[str, Any]]:
        """Every directory published, in order: {dir, step, version}."""
        return list(self.ledger["published"])

    def last_step(self) -> int | None:
        steps = [p["step"] for p in self.ledger["published"] if p["step"] is not None]
        return max(steps, default=None)

    def was_published(self, path: Path | str) -> dict[str, Any] | None:
        key = str(Path(path).resolve())
        return next((p for p in self.ledger["published"] if p["dir"] == key), None)

    # --- publishing ------------------------------------------------------------------------
    def sync_head(self) -> int | None:
        """Bring the reconstruction under state_dir/head to the chain head (after a crash, or
        when another publisher extended the chain); returns the head version."""
        head = self.store.head()
        if head is None:
            return None
        cur = self.head_dir.current()
        if cur is None or cur.version != head:
            plan = self.store.plan(cur.version if cur else None, head)
            self.head_dir.apply(plan, lambda b: self.store.blocks.get(b.id, b.size))
        return head

    def publish(self, ckpt: Checkpoint, step: int | None = None) -> PublishedCheckpoint:
        """Publish `ckpt` (checked whole by inspect_checkpoint/settled) as head + 1."""
        if (done := self.was_published(ckpt.path)) is not None:
            raise ChainError(f"{ckpt.path} was already published as v{done['version']}")
        head = self.sync_head()
        version = 0 if head is None else head + 1
        entry = {"dir": str(ckpt.path.resolve()), "step": step, "version": version}
        self.ledger["pending"] = entry
        self._write_ledger(self.ledger)
        try:
            with self.store.writing(version):  # retention spares what _write writes
                delta, snapshot = self._write(ckpt, head, version)
        except BaseException:
            if self.store.head() == version:  # the delta is in the chain; its snapshot failed
                self.ledger["published"].append(entry)
            self.ledger["pending"] = None
            self._write_ledger(self.ledger)
            raise
        self.ledger["published"].append(entry)
        self.ledger["pending"] = None
        self._write_ledger(self.ledger)
        self.sync_head()
        notified = self._notify(version)
        publisher_retain(self.store, self.retention, daemon=self.daemon_url is not None,
                         notified=notified)
        log.info("published %s as v%d (%s)", ckpt.path, version,
                 "snapshot" if delta is None else "delta" + (" + snapshot" if snapshot else ""))
        return PublishedCheckpoint(version, ckpt.path, step, delta or snapshot,
                                   snapshot is not None, notified)

    def _write(self, ckpt: Checkpoint, head: int | None, version: int
               ) -> tuple[Manifest | None, Manifest | None]:
        """Encode, sign and add the delta (and snapshot when due) of `ckpt` as `version`."""
        files = {name: (ckpt.path / name).read_bytes() for name in ckpt.files}
        new = FileSource(ckpt.path)
        common = dict(run=self.run, version=version, new=new, files=files,
                      block_size=self.block_size)
        delta = snapshot = None
        parent: FileSource | None = None

        done: list[str] = []

        def release(name: str | None, _changes: object = None) -> None:
            """Called as each tensor is encoded, just before its record is written: drop the
            previous tensor's pages from this process (they stay in the page cache), so
            resident memory stays about one encoding batch, not the model."""
            for prev in done:
                new.files.release(prev)
                if parent is not None and prev in parent.files.slots:
                    parent.files.release(prev)
            done[:] = [name] if name is not None else []

        if head is not None:
            parent_m = self.store.get(head, "delta") or self.store.get(head, "snapshot")
            cur = self.head_dir.current()
            if cur is None or cur.state_digest != parent_m.state_digest:
                raise ChainError(f"{self.head_dir.root} does not hold v{head} as published; "
                                 "delete that directory (it is rebuilt from the chain)")
            parent = FileSource(cur.path)
            delta, _ = write_artifact(self.store.blocks, self.key, kind="delta", parent=parent,
                                      parent_manifest=parent_m, trust_parent=True,
                                      on_changes=release, **common)
            release(None)
            _unchanged(ckpt)
            self.store.add(delta)
        if head is None or self.snapshots.due(version, self.store.manifests()):
            snapshot, _ = write_artifact(self.store.blocks, self.key, kind="snapshot",
                                         same_tensors_as=delta, on_changes=release, **common)
            release(None)
            _unchanged(ckpt)
            self.store.add(snapshot)
        return delta, snapshot

    def _notify(self, version: int) -> bool:
        """Tell the local daemon to seed `version` (it also finds it in the chain dir when it
        starts, so a daemon that is down misses nothing)."""
        if self.daemon_url is None:
            return False
        req = urllib.request.Request(
            f"{self.daemon_url}/v1/publish", data=json.dumps({"version": version}).encode(),
            headers={"Content-Type": "application/json",
                     **({"Authorization": f"Bearer {self.token}"} if self.token else {})},
            method="POST")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError) as e:
            log.warning("daemon at %s did not take v%d (%s); it will seed it when it (re)starts",
                        self.daemon_url, version, e)
            return False
