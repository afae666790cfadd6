"""Reconstruction: applying artifacts to produce verified, immutable HF weight directories.

Layout under `root`: `v00000005/` (safetensors shards, config.json, tokenizer files,
VERSION.json), a `current` symlink, and at most one `.staging-<artifact>/` being built. A new
version is built in staging from the immutable parent directory plus the artifact's records,
one tensor at a time; each finished tensor is checked against its digest and appended to the
staging JOURNAL (fsync'd), so a process killed at any instant resumes where it stopped: journal
entries are done, other slots are checked against the child digest and otherwise rebuilt from
the parent. Only a fully verified staging dir is renamed into place and made current, so
engines never see a half-written directory.
"""

import contextlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from chain import codec
from chain.atomic import fsync_dir, symlink_atomic, write_atomic
from chain.digest import state_digest, tensor_digest
from chain.errors import BadDelta, ChainError, DigestMismatch
from chain.manifest import BlockEntry, Manifest, TensorEntry
from chain.safetensors_io import WritableFiles, allocate, layout, write_index
from chain.sources import FileSource, TensorSource
from chain.stream import BlockReader, RecordHeader

Progress = Callable[[str, int, int], None]
GetBlock = Callable[[BlockEntry], bytes]


@dataclass(frozen=True)
class Current:
    version: int
    state_digest: str
    path: Path


def version_dir_name(version: int) -> str:
    return f"v{version:08d}"


class WeightsDir:
    def __init__(self, root: Path, keep: int = 2) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep = keep

    def current(self) -> Current | None:
        link = self.root / "current"
        if not link.is_symlink():
            return None
        path = self.root / os.readlink(link)
        info = json.loads((path / "VERSION.json").read_text())
        return Current(info["version"], info["state_digest"], path.resolve())

    def path(self, version: int) -> Path:
        return self.root / version_dir_name(version)

    def staging(self) -> list[Path]:
        return sorted(self.root.glob(".staging-*"))

    def apply(self, manifests: list[Manifest], get_block: GetBlock,
              progress: Progress | None = None) -> Current:
        """Apply a planned path of artifacts in order; each step leaves a verified version."""
        cur = self.current()
        for m in manifests:
            if m.kind == "delta":
                if cur is None or cur.version != m.version - 1:
                    raise ChainError(
                        f"{m.artifact} needs v{m.version - 1} as its base; this node has "
                        f"{'nothing' if cur is None else f'v{cur.version}'}"
                    )
                if cur.state_digest != m.parent.state_digest:
                    raise DigestMismatch(
                        f"{m.artifact}'s parent digest differs from v{cur.version}'s"
                    )
            cur = self._build(m, cur if m.kind == "delta" else None, get_block, progress)
        assert cur is not None
        return cur

    def _build(self, m: Manifest, parent: Current | None, get_block: GetBlock,
               progress: Progress | None) -> Current:
        for stale in [*self.staging(), *self.root.glob(".prep-*")]:
            if stale.name != f".staging-{m.artifact}":
                shutil.rmtree(stale)
        staging = self.root / f".staging-{m.artifact}"
        resumed = (staging / "SHARDS.json").is_file()
        if not resumed:
            # No staging, or one killed inside _commit after SHARDS.json went: build afresh.
            shutil.rmtree(staging, ignore_errors=True)
            self._prepare(staging, m, get_block)
        journal_path = staging / "JOURNAL"
        done = set(journal_path.read_text().split("\n")) if journal_path.exists() else set()
        out = WritableFiles(staging, json.loads((staging / "SHARDS.json").read_text()))
        base = FileSource(parent.path) if parent else None
        reader = BlockReader.of_blocks(m.stream_blocks, get_block)
        with open(journal_path, "a") as journal:

            def journaled(name: str, i: int) -> None:
                out.flush(name)
                journal.write(name + "\n")
                journal.flush()
                os.fsync(journal.fileno())
                if progress:
                    progress(m.artifact, i + 1, len(m.tensors))

            fill_tensors(out, m.tensors, reader, base, done, journaled, m.artifact, resumed)
        if state_digest({t.name: t.digest for t in m.tensors}) != m.state_digest:
            raise DigestMismatch(f"{m.artifact}: state digest mismatch")
        return self._commit(staging, m)

    def _prepare(self, staging: Path, m: Manifest, get_block: GetBlock) -> None:
        tmp = self.root / f".prep-{m.artifact}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        shards = layout([(t.name, t.dtype, t.shape, t.nbytes) for t in m.tensors])
        for fname, entries in shards.items():
            allocate(tmp / fname, entries)
        write_index(tmp, shards)
        by_id = {b.id: b for b in m.blocks}
        for f in m.files:
            write_atomic(tmp / f.name, get_block(by_id[f.block]))
        write_atomic(tmp / "SHARDS.json", json.dumps(sorted(shards)).encode())
        fsync_dir(tmp)
        os.rename(tmp, staging)
        fsync_dir(self.root)

    def _commit(self, staging: Path, m: Manifest) -> Current:
        (staging / "JOURNAL").unlink(missing_ok=True)
        (staging / "SHARDS.json").unlink(missing_ok=True)
        info = {"version": m.version, "state_digest": m.state_digest, "run": m.run,
                "tensors": {t.name: t.digest for t in m.tensors}}
        write_atomic(staging / "VERSION.json", json.dumps(info, indent=1).encode())
        final = self.path(m.version)
        if final.exists():
            shutil.rmtree(final)
        os.rename(staging, final)
        fsync_dir(self.root)
        symlink_atomic(final.name, self.root / "current")
        self._retain(m.version)
        return Current(m.version, m.state_digest, final.resolve())

    def _retain(self, head: int) -> None:
        versions = sorted(int(p.name[1:]) for p in self.root.glob("v[0-9]*") if p.is_dir())
        for v in versions[: max(0, len(versions) - self.keep)]:
            if v != head:
                with contextlib.suppress(FileNotFoundError):
                    shutil.rmtree(self.path(v))

    def verify(self) -> Current:
        """Recompute every tensor digest of the current version and compare."""
        cur = self.current()
        if cur is None:
            raise ChainError(f"no current version in {self.root}")
        info = json.loads((cur.path / "VERSION.json").read_text())
        src = FileSource(cur.path)
        got = {}
        for name in src.names():
            dtype, shape = src.meta(name)
            got[name] = tensor_digest(dtype, shape, src.bits(name))
        if got != info["tensors"] or state_digest(got) != cur.state_digest:
            bad = sorted(n for n in set(got) | set(info["tensors"])
                         if got.get(n) != info["tensors"].get(n))
            raise DigestMismatch(f"{cur.path}: tensors differ from VERSION.json: {bad[:5]}")
        return cur


def fill_tensors(out: WritableFiles, tensors: list[TensorEntry], reader: BlockReader,
                 base: TensorSource | None, done: set[str],
                 on_done: Callable[[str, int], None], what: str, resumed: bool = False) -> None:
    """Write every tensor of `tensors` into `out` from `base` plus the record stream, verifying
    each against its digest; tensors in `done` are skipped, and after a crash (`resumed`) so are
    unchanged tensors whose slot already matches the child digest."""
    pending = reader.next_header()
    for i, t in enumerate(tensors):
        rec: RecordHeader | None = None
        if pending is not None and pending.name == t.name:
            rec, pending = pending, None
        elif pending is not None and pending.name < t.name:
            raise BadDelta(f"record for {pending.name!r} is not a tensor of {what} or is out of "
                           "order")
        if t.name in done:
            if rec is not None:
                reader.skip(rec.n)
        else:
            slot = out.bits(t.name)
            if rec is not None or not resumed or tensor_digest(t.dtype, t.shape, slot) != t.digest:
                _fill(slot, t, rec, reader, base, what)
            if tensor_digest(t.dtype, t.shape, slot) != t.digest:
                raise DigestMismatch(f"tensor {t.name} of {what} does not match its digest after "
                                     "apply; the artifact is bad and was not applied")
            on_done(t.name, i)
        if pending is None:
            pending = reader.next_header()
    if pending is not None or not reader.at_end():
        raise BadDelta(f"{what} has records after its last tensor")


def _fill(slot: np.ndarray, t: TensorEntry, rec: RecordHeader | None, reader: BlockReader,
          base: TensorSource | None, what: str) -> None:
    if rec is not None and (rec.dtype != t.dtype or rec.shape != t.shape):
        raise BadDelta(f"record for {t.name} disagrees with the manifest's dtype/shape")
    if rec is not None and rec.op == "full":
        if rec.n != t.nbytes:
            raise BadDelta(f"full record for {t.name} has {rec.n} bytes, needs {t.nbytes}")
        reader.read_into(memoryview(slot).cast("B"))
        return
    if base is None or t.name not in base.names() or base.meta(t.name) != (t.dtype, t.shape):
        raise BadDelta(f"{what}: tensor {t.name} needs a full record (no parent tensor)")
    slot[:] = base.bits(t.name)
    if rec is not None:
        if rec.n > 8 * t.nbytes + (1 << 20):
            raise BadDelta(f"delta record for {t.name} is implausibly large ({rec.n} bytes)")
        payload = reader.read(rec.n)
        codec.apply_tensor_delta(slot, payload, t.dtype)
