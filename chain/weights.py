"""Reconstruction: applying artifacts to produce verified HF weight directories.

Layout under `root`: version directories `v00000005/` (safetensors shards, config.json,
tokenizer files, VERSION.json, CHANGES), a `current` symlink, and at most one
`.staging-<artifact>/` being built. At least two version directories are kept. A delta v -> v+1
does not copy the model: the older directory (holding u < v, never `current`) is renamed to
staging and brought forward in place, by copying from `current` the positions that changed
from u to v (the CHANGES files of the directories in between) and writing the delta's changes,
which are decoded against `current` read-only. Tensor digests are additive, so each tensor is
verified from its old digest and the words it touched: the work is one decode pass over the
current version plus O(changes). Only a fully verified staging dir is renamed into place and
made current, so engines only ever see complete versions, and a directory is rewritten only
after `current` has moved off it.

Snapshots, a first delta with no spare directory, and deltas that add, drop or reshape tensors
build a fresh directory (the whole model is written once). Every tensor that is finished is
appended to the staging JOURNAL, so a process killed at any instant resumes: journaled tensors
are done; any other tensor is copied whole from `current` and patched again (redo is idempotent:
`current` is read-only and decoding is deterministic). Nothing is fsync'd per tensor: a kill
leaves the page cache intact, and a power cut is caught by `check_at_start`, which recomputes
every digest and drops a directory that does not match.
"""

import contextlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from chain.atomic import fsync_dir, symlink_atomic, write_atomic
from chain.codec import Changes
from chain.digest import state_digest, tensor_digests
from chain.errors import ChainError, DigestMismatch
from chain.fill import Fill
from chain.gcpause import without_gc
from chain.manifest import BlockEntry, Manifest
from chain.safetensors_io import (
    TensorFiles,
    WritableFiles,
    allocate,
    layout,
    read_columns,
    write_index,
)
from chain.slotcolumns import SlotColumns
from chain.stream import BlockReader
from chain.versiondir import (
    ADVANCE,
    JOURNAL,
    OURS,
    SHARDS,
    BadVersionDir,
    StoredChanges,
    VersionInfo,
    read_changes,
    read_info,
    write_changes,
    write_info,
)

Progress = Callable[[str, int, int], None]
GetBlock = Callable[[BlockEntry], bytes]


@dataclass(frozen=True)
class Current:
    version: int
    state_digest: str
    path: Path


STATE_DIGEST = "(VERSION.json state_digest)"
"""What `WeightsDir.damaged` names when every tensor matches but the state digest does not."""


def version_dir_name(version: int) -> str:
    return f"v{version:08d}"


class WeightsDir:
    def __init__(self, root: Path, keep: int = 2) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep = max(2, keep)  # two at least: the older one is brought forward in place

    def current(self) -> Current | None:
        """The current version; BadVersionDir if its VERSION.json is damaged."""
        link = self.root / "current"
        if not link.is_symlink():
            return None
        path = self.root / os.readlink(link)
        info = read_info(path)
        return Current(info.version, info.state_digest, path.resolve())

    def path(self, version: int) -> Path:
        return self.root / version_dir_name(version)

    def is_current(self, version: int) -> bool:
        """Whether `current` names this version's directory (read from the link alone, so it
        answers even when that directory's VERSION.json is damaged)."""
        link = self.root / "current"
        return link.is_symlink() and os.readlink(link) == version_dir_name(version)

    def staging(self) -> list[Path]:
        return sorted(self.root.glob(".staging-*"))

    def versions(self) -> list[int]:
        return sorted(int(p.name[1:]) for p in self.root.glob("v[0-9]*")
                      if p.is_dir() and p.name[1:].isdigit())

    @without_gc
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
            cur = self._apply_one(m, cur if m.kind == "delta" else None, get_block, progress)
        assert cur is not None
        return cur

    @without_gc
    def apply_changes(self, m: Manifest, parent: int, changes: dict[str, Changes],
                      get_block: GetBlock, progress: Progress | None = None) -> Current:
        """Bring the directory on disk forward from version `parent` (current) to `m`'s, with
        changes already decoded and verified (chain/decode.py; several versions merged when
        `parent` < m.version - 1): the same journaled, resumable, digest-checked pass as a
        delta, without decoding again. The engines were patched first; this is the catch-up."""
        cur = self.current()
        if cur is None or cur.version != parent:
            raise ChainError(f"changes to v{m.version} need v{parent} current; this node has "
                             f"{'nothing' if cur is None else f'v{cur.version}'}")
        if m.kind != "delta":
            raise ChainError(f"{m.artifact} is not a delta")
        return self._apply_one(m, cur, get_block, progress, changes, parent)

    # --- one artifact -----------------------------------------------------------------------
    def _apply_one(self, m: Manifest, cur: Current | None, get_block: GetBlock,
                   progress: Progress | None, changes: dict[str, Changes] | None = None,
                   parent: int | None = None) -> Current:
        staging = self.root / f".staging-{m.artifact}"
        for stale in [*self.staging(), *self.root.glob(".prep-*")]:
            if stale != staging:
                shutil.rmtree(stale)
        if staging.is_dir() and _finished(staging, m):
            return self._commit(staging, m)
        if _finished(self.path(m.version), m):  # killed between the rename and the link
            symlink_atomic(self.path(m.version).name, self.root / "current")
            self._retain(m.version)
            return Current(m.version, m.state_digest, self.path(m.version).resolve())
        resumed = staging.is_dir() and ((staging / ADVANCE).is_file()
                                        or (staging / SHARDS).is_file())
        if not resumed:
            shutil.rmtree(staging, ignore_errors=True)
            spare = self._spare(m, cur)
            if spare is not None:
                self._take(spare, staging, m, cur)
            else:
                self._prepare(staging, m, get_block)
        out = WritableFiles(staging, sorted(p.name for p in staging.glob("*.safetensors")))
        base = TensorFiles(cur.path) if cur else None
        fill = Fill(out, m.tensors, m.artifact, base, read_info(cur.path).tensors if cur else {},
                    progress, staging / JOURNAL)
        if (staging / ADVANCE).is_file() and not resumed:
            plan = json.loads((staging / ADVANCE).read_text())
            fill.in_place(self._steps(plan["from"], cur), _info_or_none(staging))
        if changes is None:
            fill.run([BlockReader.of_blocks(b, get_block) for b in m.substreams], resumed)
        else:
            fill.run_changes(changes, resumed)
        if m.tensors.state_digest() != m.state_digest:
            raise ChainError(f"{m.artifact}: state digest mismatch")
        mode = _file_mode(staging)
        # changes merged over several versions are not the step from m.version - 1: record
        # none, so a later bring-forward copies whole tensors instead of trusting them
        one_step = parent is None or parent == m.version - 1
        write_changes(staging, m.version, fill.changes if one_step else {}, mode)
        _write_files(staging, m, get_block, mode)
        write_info(staging, VersionInfo(m.version, m.state_digest, m.run,
                                        m.tensors.digest_map()), mode)
        return self._commit(staging, m)

    def _spare(self, m: Manifest, cur: Current | None) -> Path | None:
        """The older directory to bring forward, or None to build a fresh one."""
        if m.kind != "delta" or cur is None:
            return None
        others = []
        for v in self.versions():
            if v > cur.version:  # left by a version set aside at start: never current again
                shutil.rmtree(self.path(v))
            elif v != cur.version:
                others.append(v)
        if len(others) + 1 < self.keep:
            return None
        path = self.path(others[0])
        if not _same_layout(path, m):
            shutil.rmtree(path)
            return None
        return path

    def _steps(self, start: int, cur: Current) -> list[StoredChanges | None]:
        """The CHANGES of versions start+1..current (None where a directory lacks them)."""
        out = []
        for v in range(start + 1, cur.version + 1):
            d = cur.path if v == cur.version else self.path(v)
            out.append(read_changes(d, v) if d.is_dir() else None)
        return out

    def _take(self, spare: Path, staging: Path, m: Manifest, cur: Current) -> None:
        """Mark the spare as being brought forward to m, then move it to staging (atomic)."""
        (spare / JOURNAL).unlink(missing_ok=True)
        (spare / SHARDS).unlink(missing_ok=True)
        own = _info_or_none(spare)
        start = cur.version - 1 if own is None else own.version
        write_atomic(spare / ADVANCE, json.dumps({"from": start, "base": cur.version,
                                                  "to": m.version}).encode(), durable=False)
        os.rename(spare, staging)
        fsync_dir(self.root)

    def _prepare(self, staging: Path, m: Manifest, get_block: GetBlock) -> None:
        tmp = self.root / f".prep-{m.artifact}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        shards = layout([(t.name, t.dtype, t.shape, t.nbytes) for t in m.tensors])
        for fname, entries in shards.items():
            allocate(tmp / fname, entries)
        write_index(tmp, shards)
        write_atomic(tmp / SHARDS, json.dumps(sorted(shards)).encode())
        fsync_dir(tmp)
        os.rename(tmp, staging)
        fsync_dir(self.root)

    def _commit(self, staging: Path, m: Manifest) -> Current:
        for name in (JOURNAL, ADVANCE, SHARDS):
            (staging / name).unlink(missing_ok=True)
        final = self.path(m.version)
        if final.exists():
            shutil.rmtree(final)
        os.rename(staging, final)
        fsync_dir(self.root)
        symlink_atomic(final.name, self.root / "current")
        self._retain(m.version)
        return Current(m.version, m.state_digest, final.resolve())

    def _retain(self, head: int) -> None:
        versions = self.versions()
        for v in versions[: max(0, len(versions) - self.keep)]:
            if v != head:
                with contextlib.suppress(FileNotFoundError):
                    shutil.rmtree(self.path(v))

    # --- checks ---------------------------------------------------------------------------
    def verify(self) -> Current:
        """Recompute every tensor digest of the current version and compare."""
        cur = self.current()
        if cur is None:
            raise ChainError(f"no current version in {self.root}")
        _verify_dir(cur.path, read_info(cur.path))
        return cur

    def check_at_start(self) -> tuple[Current | None, str | None]:
        """Verify the current version (every digest recomputed) and the spare directories.
        A current version that fails is quarantined (renamed `.bad-vN`, `current` removed) so
        the caller plans from a snapshot; a spare that fails is deleted. Returns (current or
        None, what was wrong or None)."""
        problem = None
        try:
            cur = self.verify() if (self.root / "current").is_symlink() else None
        except (ChainError, OSError) as e:
            problem = f"current weights failed verification and were set aside: {e}"
            self._quarantine()
            cur = None
        for v in self.versions():
            if cur is not None and v == cur.version:
                continue
            try:
                _verify_dir(self.path(v), read_info(self.path(v)))
            except (ChainError, OSError):
                shutil.rmtree(self.path(v), ignore_errors=True)
        return cur, problem

    def damaged(self, version: int, names: list[str] | None = None,
                read: Callable[[int], None] | None = None) -> list[str]:
        """Names of the tensors of version directory `version` (all, or just `names`) whose
        bytes no longer match its VERSION.json; [] when they all do. For a background pass:
        `read` hears every ~64 MiB read (it paces the pass, or raises to stop it); `names`
        [STATE_DIGEST] checks VERSION.json's state digest against its own tensors. A directory
        an apply renamed away meanwhile raises OSError or BadVersionDir: the caller checks
        again under the writers' lock before acting on a result (`set_aside`)."""
        path = self.path(version)
        info = read_info(path)
        if names == [STATE_DIGEST]:  # VERSION.json against itself: no tensor read
            return [] if state_digest(info.tensors) == info.state_digest else [STATE_DIGEST]
        got = _dir_digests(path, names, read)
        wanted = info.tensors if names is None else {n: info.tensors.get(n, "") for n in names}
        bad = sorted(n for n in set(got) | set(wanted) if got.get(n) != wanted.get(n))
        if not bad and names is None and state_digest(got) != info.state_digest:
            bad = [STATE_DIGEST]
        return bad

    def set_aside(self, version: int) -> str:
        """Take a damaged version directory out of use, as the start-up check does: the
        current one is quarantined (`.bad-vN`, `current` removed, so the caller plans from a
        snapshot), a spare one deleted (the next delta writes a fresh directory). Only with
        every writer of this root stopped. Returns what was done."""
        if self.is_current(version):
            self._quarantine()
            return f"set aside as .bad-{version_dir_name(version)}; rebuilding from a snapshot"
        shutil.rmtree(self.path(version), ignore_errors=True)
        return "deleted (a spare directory: the next version is written whole)"

    def _quarantine(self) -> None:
        link = self.root / "current"
        target = self.root / os.readlink(link)
        for old in self.root.glob(".bad-*"):
            shutil.rmtree(old, ignore_errors=True)
        link.unlink()
        if target.is_dir():
            os.rename(target, self.root / f".bad-{target.name}")
        fsync_dir(self.root)


def _dir_digests(path: Path, names: list[str] | None = None,
                 read: Callable[[int], None] | None = None) -> dict[str, str]:
    """Digests of the tensors in `path` (all, or `names`), recomputed from their bytes in
    batches of ~64 MiB; `read` hears each batch's bytes (to pace or stop a background pass)."""
    files = TensorFiles(path)
    got: dict[str, str] = {}
    batch: list[str] = []
    size = 0

    def flush() -> None:
        items = [(*_meta(files, n), files.bits(n)) for n in batch]
        got.update(zip(batch, tensor_digests(items), strict=True))
        files.release_many(batch)
        batch.clear()
        if read is not None:
            read(size)

    for name in files.names() if names is None else names:
        if name not in files.slots:
            continue  # missing: its digest is absent, which the caller sees as a mismatch
        batch.append(name)
        size += files.slots[name].end - files.slots[name].start
        if size >= 1 << 26:
            flush()
            size = 0
    flush()
    return got


def _verify_dir(path: Path, info: VersionInfo) -> None:
    got = _dir_digests(path)
    if got != info.tensors or state_digest(got) != info.state_digest:
        bad = sorted(n for n in set(got) | set(info.tensors) if got.get(n) != info.tensors.get(n))
        raise DigestMismatch(f"{path}: tensors differ from VERSION.json: {bad[:5]}")


def _meta(files: TensorFiles, name: str) -> tuple[str, list[int]]:
    s = files.slots[name]
    return s.dtype, s.shape


def _finished(staging: Path, m: Manifest) -> bool:
    try:
        info = read_info(staging)
    except BadVersionDir:
        return False
    return info.version == m.version and info.state_digest == m.state_digest


def _info_or_none(path: Path) -> VersionInfo | None:
    try:
        return read_info(path)
    except BadVersionDir:
        return None


def _same_layout(path: Path, m: Manifest) -> bool:
    """Whether the directory holds exactly the manifest's tensors, each of its dtype and shape
    (compared from the table's columns and the files' (`SlotColumns`): two list comparisons
    where the files hold the tensors in the table's order, as a region writes them)."""
    try:
        files = SlotColumns.of([(f.name, read_columns(f)[2])
                                for f in sorted(path.glob("*.safetensors"))])
    except (ChainError, OSError):
        return False
    names, metas = m.tensors.names(), m.tensors.metas()
    if files.names == names:
        return files.metas == metas
    at = files.at
    return len(files.names) == len(names) and all(n in at for n in names) and \
        [files.metas[at[n]] for n in names] == metas


def _write_files(staging: Path, m: Manifest, get_block: GetBlock, mode: int) -> None:
    """The model's other files (config, tokenizer) as the manifest lists them, in `mode`;
    files of the directory's older version that the manifest does not list go."""
    by_id = {b.id: b for b in m.blocks}
    keep = {f.name for f in m.files}
    for f in m.files:
        path = staging / f.name
        data = get_block(by_id[f.block])
        if not path.is_file() or path.read_bytes() != data:
            write_atomic(path, data, mode)
        else:
            path.chmod(mode)
    for p in staging.iterdir():
        if p.is_file() and p.suffix != ".safetensors" and p.name not in keep | OURS \
                and not p.name.startswith("."):
            p.unlink()


def _file_mode(directory: Path) -> int:
    """The shards' permission bits (they follow the umask), for every other file we write."""
    for f in sorted(directory.glob("*.safetensors")):
        return f.stat().st_mode & 0o777
    return 0o644
