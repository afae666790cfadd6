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

Memory: the new checkpoint is read with pread (chain.sources.FileSource `only`: a memory map of
a file the trainer may truncate would die of SIGBUS) and the parent through memory maps, in the
writer's bounded batches (plus one copy of the largest tensor), never loaded whole. The parent
is not kept in RAM as the in-process Publisher does: it is a verified reconstruction of the
chain head under `state_dir/head` (chain.weights.WeightsDir, the code a region daemon runs),
brought forward by each published version (O(changes)), so it survives restarts and the
trainer may delete old checkpoints. Disk: two copies of the model there.

Restart: `state_dir/published.json` records each published directory (path, step, version)
and, while one is being published, that one as pending; a publish that reached the chain
before a crash is recognised by the chain head and recorded, never published twice. What the
trainer rewrites while it is being read is not signed (fingerprint checked before signing).

Intake: only regular files inside the directory are read (no symbolic link, even one pointing
inside; no named pipe or device), opened with O_NOFOLLOW | O_NONBLOCK and checked with fstat,
sizes bounded. Besides the weights, only `CARRIED` files (config, tokenizer, generation config,
chat template) and those matching the config's `watch.extra_files` patterns travel. Every
tensor name, dtype and shape and every carried file's name is checked by the manifest's own
rules (chain.manifest.tensor_problem, file_problem) before anything is encoded: a directory
that can never be published raises `Refused` naming the file and field, recorded in
published.json's `refused` list.
"""

import json
import logging
import os
import re
import stat
import struct
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from chain import codec, keys, refusals
from chain.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, BadAdapter, check_config
from chain.atomic import write_atomic
from chain.blocks import DEFAULT_BLOCK, MAX_BLOCK
from chain.errors import ChainError
from chain.follow import publisher_retain
from chain.manifest import BasePin, Manifest, file_problem, tensor_problem
from chain.policy import Retention, SnapshotPolicy
from chain.safetensors_io import (
    INDEX_NAME,
    FileChanged,
    NotRegular,
    kind_of,
    open_regular,
    read_header,
)
from chain.sources import FileSource
from chain.store import ChainStore
from chain.weights import WeightsDir
from chain.writer import GROUP_BELOW, write_artifact

log = logging.getLogger("deltaswarm.checkpoints")

MAX_FILE = MAX_BLOCK  # a carried file travels as one block
"""Largest non-weight file carried with a version (config, tokenizer); bigger ones are refused."""
MAX_REFUSED = 100
"""Refused directories published.json remembers (the newest)."""
MAX_JSON = MAX_BLOCK
"""Largest config.json or weight index read."""
CARRIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
           "tokenizer.model", "special_tokens_map.json", "added_tokens.json", "vocab.json",
           "vocab.txt", "merges.txt", "spiece.model", "chat_template.jinja",
           "chat_template.json")
"""Files carried with every version when present: the model config, the tokenizer's files, the
generation config and the chat template. More travel only by `watch.extra_files` patterns."""
SKIP = re.compile(r"^(optimizer.*|scheduler.*|rng_state.*|trainer_state\.json|training_args\.bin"
                  r"|.*\.(pt|pth|bin|ckpt|distcp|safetensors|tmp|lock|part))$")
"""Training state a checkpoint directory holds beside the model: never carried, whatever
pattern matches it."""
SHARD_NAME = re.compile(r"-\d{5}-of-\d{5}\.safetensors$")


class Incomplete(ChainError):
    """The directory is not (yet) a whole checkpoint; the message says what is missing."""


class Changed(Incomplete):
    """The directory changed while it was being published: nothing of it was signed; the next
    attempt reads it again."""


class Refused(ChainError):
    """The directory can never be published as it stands (a symbolic link or named pipe among
    its files, a name or header field no manifest can carry, a file too large); the message
    names the file and the field. `watch` records it and goes on with later steps."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    weights: tuple[str, ...]
    """The .safetensors files, by name."""
    files: tuple[str, ...]
    """Config and tokenizer files carried with the version."""
    fingerprint: tuple[tuple[str, int, int, int, int, int], ...]
    """(name, mode, size, mtime_ns, ctime_ns, inode) of every entry, links not followed: equal
    fingerprints mean nothing was rewritten, replaced or swapped."""
    adapter: bool = False
    """A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors): only the
    adapter and its config travel, pinned to the publisher's base (chain/adapters.py)."""


def _fingerprint(path: Path) -> tuple[tuple[str, int, int, int, int, int], ...]:
    out = []
    with os.scandir(path) as it:
        for e in it:
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            out.append((e.name, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                        st.st_ino))
    return tuple(sorted(out))


def _regular(f: Path, limit: int | None = None) -> int:
    """Size of `f`, a regular file in its directory (a symbolic link, even to a file inside,
    and a named pipe or device are refused without opening them); `limit` bounds the size."""
    try:
        st = f.lstat()
    except FileNotFoundError:
        raise Incomplete(f"{f} is gone (deleted while the checkpoint was read)") from None
    if not stat.S_ISREG(st.st_mode):
        to = f" to {os.readlink(f)}" if stat.S_ISLNK(st.st_mode) else ""
        raise Refused(f"{f} is {kind_of(st.st_mode)}{to}; only regular files inside the "
                      "checkpoint directory are read: copy the file in")
    if limit is not None and st.st_size > limit:
        raise Refused(f"{f}: {st.st_size} bytes is too large to carry with a version (limit "
                      f"{limit}); move it out of the checkpoint")
    return st.st_size


def _read(f: Path, limit: int) -> bytes:
    """All of `f` (at most `limit` bytes), opened only if regular and never through a link."""
    _regular(f, limit)
    try:
        with open_regular(f, follow=False) as fh:
            data = fh.read(limit + 1)
    except NotRegular as e:  # swapped after the check
        raise Refused(str(e)) from None
    except OSError as e:  # unreadable (permissions) or gone: may pass, else it is abandoned
        raise Incomplete(f"{f} cannot be read ({e})") from None
    if len(data) > limit:
        raise Refused(f"{f} grew past {limit} bytes while it was read")
    return data


def _described_size(f: Path) -> int:
    """The length a safetensors file has once whole: 8 + header + the furthest data offset."""
    try:
        with open_regular(f, follow=False) as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > 100 * 1024 * 1024:
                raise ValueError(f"implausible header length {n}")
            doc = json.loads(fh.read(n))
        ends = [int(v["data_offsets"][1]) for k, v in doc.items() if k != "__metadata__"]
    except NotRegular as e:
        raise Refused(str(e)) from None
    except (OSError, ValueError, RecursionError, struct.error, KeyError, TypeError,
            IndexError, AttributeError) as e:
        raise Incomplete(f"{f}: header not readable yet ({e})") from None
    return 8 + n + max(ends, default=0)


def carried(names: list[str], extra: tuple[str, ...] = (), marker: str | None = None
            ) -> list[str]:
    """Which of a checkpoint directory's file names travel with its version: `CARRIED`, and
    those matching an `extra` glob pattern; never hidden files, training state (`SKIP`), the
    weights, their index or the marker."""
    out = []
    for name in sorted(names):
        if (name.startswith(".") or name in (INDEX_NAME, marker) or SKIP.match(name)
                or (name not in CARRIED and not any(fnmatchcase(name, p) for p in extra))):
            continue
        out.append(name)
    return out


def inspect_checkpoint(path: Path | str, marker: str | None = None,
                       extra_files: tuple[str, ...] = ()) -> Checkpoint:
    """The checkpoint at `path` if it is whole now; `Incomplete` naming what is not yet, or
    `Refused` naming the file and field that can never be published. Only regular files
    inside `path` are read; every tensor name, dtype and shape and every carried file's name
    and size passes the manifest's own checks here, before anything is encoded."""
    path = Path(path)
    if not path.is_dir():
        raise Incomplete(f"{path} is not a directory")
    if marker is not None and not (path / marker).is_file():
        raise Incomplete(f"{path}: marker file {marker} not written yet")
    names = [e.name for e in os.scandir(path)]
    adapter = ADAPTER_CONFIG in names
    config = ADAPTER_CONFIG if adapter else "config.json"
    try:
        if config not in names:
            raise ValueError("not written yet")
        raw = _read(path / config, MAX_JSON)
        json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise Incomplete(f"{path}: {config} missing or not complete JSON ({e})") from None
    if adapter:
        try:
            check_config(raw)
        except BadAdapter as e:
            raise Refused(f"{path}: {e}") from None
    weights = sorted(n for n in names if n.endswith(".safetensors") and not n.startswith(".")
                     and (not adapter or n == ADAPTER_WEIGHTS))
    if not weights:
        raise Incomplete(f"{path}: no .safetensors files yet")
    held: dict[str, set[str]] = {}
    for name in weights:
        f = path / name
        size = _regular(f)
        want = _described_size(f)
        if size != want:
            raise Incomplete(f"{f}: {size} bytes, its header describes {want}"
                             f"{' (still being written)' if size < want else ''}")
        try:
            slots = read_header(f, follow=False)[1]
        except OSError as e:
            raise Incomplete(f"{f} cannot be read ({e})") from None
        except ChainError as e:
            raise Refused(f"{f}: not valid safetensors ({e})") from None
        for tensor, slot in slots.items():
            if (problem := tensor_problem(tensor, slot.dtype, slot.shape)) is not None:
                raise Refused(f"{f}: tensor {tensor!r:.80} cannot be published: {problem}")
        held[name] = set(slots)
    if INDEX_NAME in names:
        index = path / INDEX_NAME
        try:
            weight_map = json.loads(_read(index, MAX_JSON))["weight_map"]
            named = set(weight_map.values())
        except (ValueError, RecursionError, KeyError, TypeError, AttributeError) as e:
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
    for name in [ADAPTER_CONFIG] if adapter else carried(names, extra_files, marker):
        size = _regular(path / name, MAX_FILE)
        if size == 0:
            continue
        if (problem := file_problem(name, size)) is not None:
            raise Refused(f"{path / name!s:.300} cannot travel with a version: {problem}; "
                          "rename it, or narrow watch.extra_files so it does not match")
        files.append(name)
    return Checkpoint(path, tuple(weights), tuple(files), _fingerprint(path), adapter)


def settled(path: Path | str, settle_s: float, marker: str | None = None,
            extra_files: tuple[str, ...] = ()) -> Checkpoint:
    """`inspect_checkpoint` twice, `settle_s` apart, with nothing changed in between."""
    first = inspect_checkpoint(path, marker, extra_files)
    time.sleep(settle_s)
    second = inspect_checkpoint(path, marker, extra_files)
    if second.fingerprint != first.fingerprint:
        raise Incomplete(f"{path}: files changed during the {settle_s:g} s settle time")
    return second


def _unchanged(ckpt: Checkpoint) -> None:
    """Refuse to sign what was read if the trainer rewrote the directory meanwhile (what was
    read may mix two saves); the next scan sees the new files."""
    if _fingerprint(ckpt.path) != ckpt.fingerprint:
        raise Changed(f"{ckpt.path} changed while it was being published; not signed")


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
                 block_size: int = DEFAULT_BLOCK, base: BasePin | None = None,
                 direct_positions: int = codec.DIRECT, group_below: int = GROUP_BELOW) -> None:
        """`base`: this run's checkpoints are PEFT adapter directories over that base version
        (trainer/ckpt_cli.py reads it from `base_chain`); full-model ones are then refused.
        `direct_positions`, `group_below`: how deltas code positions and which tensors travel
        in group records (trainer.publisher.Publisher's)."""
        self.key = keys.load_private(Path(key_path))
        self.base = base
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
        self.direct_positions = direct_positions
        self.group_below = group_below
        self.ledger = self._load_ledger()

    # --- the ledger of published directories -------------------------------------------------
    def _load_ledger(self) -> dict[str, Any]:
        if not self.ledger_path.exists():
            return {"run": self.run, "published": [], "pending": None, "refused": []}
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

    def refused(self) -> list[dict[str, Any]]:
        """Directories refused (the last MAX_REFUSED, each with its latest reason), oldest
        first: {dir, step, reason, at}."""
        return list(self.ledger.get("refused", []))

    def record_refused(self, path: Path | str, step: int | None, reason: str) -> None:
        """Note in published.json that `path` was refused and why (what status shows)."""
        entry = {"dir": str(Path(path).resolve()), "step": step, "reason": reason[:2000],
                 "at": round(time.time(), 3)}
        others = [r for r in self.refused() if r.get("dir") != entry["dir"]]  # the latest only
        self.ledger["refused"] = [*others, entry][-MAX_REFUSED:]
        self._write_ledger(self.ledger)
        refusals.record(self.store.root, entry)  # what the trainer daemon's status shows

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
        if ckpt.adapter and self.base is None:
            raise Refused(f"{ckpt.path} is a PEFT adapter checkpoint ({ADAPTER_CONFIG}); set "
                          "base_chain in the publish config to the chain its base was "
                          "published to, so each version names the base it applies to")
        if not ckpt.adapter and self.base is not None:
            raise Refused(f"{ckpt.path} is a full-model checkpoint, but this run publishes LoRA "
                          f"adapters over base {self.base.run} v{self.base.version}; save the "
                          "adapter (PEFT save_pretrained), or drop base_chain")
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
        """Encode, sign and add the delta (and snapshot when due) of `ckpt` as `version`.
        The checkpoint's weights are read with pread (FileSource `only`), not a memory map: a
        trainer truncating a file meanwhile is reported as a change, never a SIGBUS."""
        changed = f"{ckpt.path} changed while it was being published; not signed"
        try:
            files = {name: _read(ckpt.path / name, MAX_FILE) for name in ckpt.files}
            new = FileSource(ckpt.path, only=ckpt.weights)
        except (NotRegular, Refused) as e:  # became a link, a pipe or too big since inspected
            raise Refused(str(e)) from None
        except (ChainError, OSError) as e:  # inspected whole a moment ago: rewritten since
            raise Changed(f"{changed} ({e})") from None
        try:
            return self._encode(ckpt, head, version, new, files)
        except FileChanged as e:
            raise Changed(f"{changed} ({e})") from None
        finally:
            new.close()

    def _encode(self, ckpt: Checkpoint, head: int | None, version: int, new: FileSource,
                files: dict[str, bytes]) -> tuple[Manifest | None, Manifest | None]:
        common = dict(run=self.run, version=version, new=new, files=files,
                      block_size=self.block_size, base=self.base)
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
                                      on_changes=release,
                                      direct_positions=self.direct_positions,
                                      group_below=self.group_below, **common)
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
