"""One rank's half of a sharded publish, with no collectives (so one process can test it).

The rank keeps what it last published of each slice it holds: a host copy of the bit patterns
(the codec's base; 1x the shard) and, when the weights live on a GPU, a device copy to compare
against (on CPU the host copy serves as both). A slice on the host is encoded in one pass, as
the single-process Publisher encodes a tensor: the codec compares and encodes each segment at
once and hands back the changed positions and values. A slice on a GPU is compared there, only
the changed positions and values are copied to the host, and the changed segments are rebuilt
from the host copy and encoded (the same records either way). The slice's digest part is moved
by the changed words alone. Nothing the rank keeps changes until `commit`, which the publisher
calls once the version is signed; a version that fails is dropped with `discard`, leaving the
rank at the previous one.

The rank's result is also written to `parts/vNNNNNNNN/rankNNNNN.json` beside its blocks, so a
rank that restarts with the same weights reuses it instead of encoding again: such a rank
compares first (as on a GPU) and writes records only if its weights turn out different.
"""

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from chain import shards
from chain.atomic import write_atomic
from chain.blocks import BlockStore
from chain.codec.api import DIRECT, THREADS, run_scatters
from chain.errors import ChainError
from chain.host_deltas import HostDeltas, SliceDelta
from chain.stream import BlockWriter
from trainer.changes import device_view, find_changes


@dataclass(frozen=True)
class Slice:
    """Elements [lo, lo + bits.numel()) of tensor `name` (dtype, global shape), as a flat
    integer view on the device where they live."""

    name: str
    dtype: str
    shape: list[int]
    lo: int
    bits: torch.Tensor


@dataclass
class _Held:
    dtype: str
    shape: list[int]
    lo: int
    host: np.ndarray
    dev: torch.Tensor
    sums: tuple[int, int]

    def fits(self, s: Slice) -> bool:
        return (self.dtype, self.shape, self.lo, self.host.size, self.dev.device) == \
            (s.dtype, s.shape, s.lo, s.bits.numel(), s.bits.device)


@dataclass
class _Moved:
    """A delta slice's changes (sorted local positions and new values; on the device too when
    the slice lives there); the held copies are patched with them at `commit`."""

    pos: np.ndarray
    val: np.ndarray
    sums: tuple[int, int]
    """The digest part after the changes."""
    pos_dev: torch.Tensor | None = None
    val_dev: torch.Tensor | None = None


def _host_view(bits: torch.Tensor) -> np.ndarray:
    """The bit patterns on the host as flat unsigned ints (a view for CPU tensors)."""
    return bits.detach().cpu().numpy().view(np.dtype(f"uint{8 * bits.element_size()}"))


def _host_copy(bits: torch.Tensor) -> np.ndarray:
    return _host_view(bits).copy()


def _held(s: Slice, host: np.ndarray) -> _Held:
    dev = device_view(host) if s.bits.device.type == "cpu" else s.bits.clone()
    return _Held(s.dtype, s.shape, s.lo, host, dev, shards.interior_sum(host, s.lo))


def _edges(s: Slice) -> np.ndarray:
    pos = shards.edge_positions(s.lo, s.bits.numel(), s.bits.element_size())
    return _host_view(s.bits[torch.from_numpy(pos).to(s.bits.device)])


class RankEncoder:
    def __init__(self, blocks: BlockStore, parts_dir: Path, rank: int, block_size: int,
                 threads: int = THREADS, direct: int = DIRECT) -> None:
        """`direct`: how delta records code positions (chain.codec.api.DIRECT)."""
        self.blocks, self.parts_dir, self.rank = blocks, Path(parts_dir), rank
        self.block_size, self.threads, self.direct = block_size, threads, direct
        self.held: dict[str, _Held] = {}
        self._pending: dict[str, _Held | _Moved | SliceDelta] | None = None

    def part_path(self, version: int) -> Path:
        return self.parts_dir / f"v{version:08d}" / f"rank{self.rank:05d}.json"

    def adopt(self, slices: list[Slice]) -> shards.RankPart:
        """Take `slices` as the last published state (resume); their parts, for the check."""
        self._pending = {}
        out = []
        for s in slices:
            h = _held(s, _host_copy(s.bits))
            self._pending[s.name] = h
            out.append(shards.slice_part(s.name, s.dtype, s.shape, s.lo, s.bits.numel(), h.sums,
                                         "full", _edges(s)))
        return shards.RankPart(rank=self.rank, version=0, parent_digest=None, slices=out)

    def encode(self, version: int, slices: list[Slice], *, parent_digest: str | None,
               snapshot: bool) -> shards.RankPart:
        """This rank's part of `version`: a delta against what it holds (when `parent_digest`
        is set), plus full records when `snapshot`."""
        t0 = time.perf_counter()
        delta = parent_digest is not None
        slices = sorted(slices, key=lambda s: (s.name, s.lo))
        prior = self._prior(version, parent_digest, snapshot)
        self._pending = {}
        dw = BlockWriter(self.blocks, self.block_size)
        one_pass = HostDeltas(dw, threads=self.threads, direct=self.direct)
        later: list[Callable[[BlockWriter], int]] = []  # records held back while `prior`
        d2h = encoded = 0
        for s in slices:
            h = self.held.get(s.name)
            write: Callable[[BlockWriter], int] | None = None
            if delta and h is not None and h.fits(s):
                if s.bits.device.type == "cpu" and prior is None:  # found as it is encoded
                    self._pending[s.name] = one_pass.add(s, h.host, _host_view(s.bits))
                    continue
                f = find_changes(h.dev, s.bits)  # found first, written from the changes
                d2h += f.d2h_bytes
                self._pending[s.name] = _Moved(f.pos, f.val, shards.add_sums(
                    h.sums, shards.interior_move(h.host, s.lo, f.pos, f.val)),
                    f.pos_dev, f.val_dev)
                if f.pos.size:
                    write = _delta_writer(s, h.host, f.pos, f.val, self.threads, self.direct)
            else:
                n = self._pending[s.name] = _held(s, _host_copy(s.bits))
                if delta:
                    write = _full_writer(s, n.host)
            if write is not None and prior is None:
                one_pass.flush()  # the records before this one
                encoded += write(dw)
            elif write is not None:
                later.append(write)
        one_pass.flush()
        for name, p in self._pending.items():
            if isinstance(p, SliceDelta):
                self._pending[name] = _Moved(p.pos, p.val,
                                             shards.add_sums(self.held[name].sums, p.move))
                encoded += p.written
        parts = [self._part(s) for s in slices]
        if prior is not None:
            if self._reusable(prior, parts):
                return prior.model_copy(update={"reused": True})
            for write in later:
                encoded += write(dw)
        sw = BlockWriter(self.blocks, self.block_size)
        if snapshot:
            for s in slices:
                pend = self._pending[s.name]
                shards.write_full(sw, s, pend.host if isinstance(pend, _Held)
                                  else _host_view(s.bits))
        part = shards.RankPart(rank=self.rank, version=version, parent_digest=parent_digest,
                               slices=parts, delta_blocks=dw.close() if delta else [],
                               snapshot_blocks=sw.close() if snapshot else [],
                               encoded_bytes=encoded, d2h_bytes=d2h,
                               seconds=time.perf_counter() - t0)
        path = self.part_path(version)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, part.model_dump_json().encode())
        return part

    def _part(self, s: Slice) -> shards.SlicePart:
        """The slice's report: its digest part after this version, and what changed."""
        pend, count = self._pending[s.name], s.bits.numel()
        if isinstance(pend, _Held):
            return shards.slice_part(s.name, s.dtype, s.shape, s.lo, count, pend.sums, "full",
                                     _edges(s), count)
        return shards.slice_part(s.name, s.dtype, s.shape, s.lo, count, pend.sums, "delta",
                                 _edges(s), int(pend.pos.size))

    def _prior(self, version: int, parent_digest: str | None, snapshot: bool
               ) -> shards.RankPart | None:
        """The part this rank persisted for `version` on the same parent before a crash."""
        try:
            old = shards.RankPart.model_validate_json(self.part_path(version).read_bytes())
        except (OSError, ValueError):
            return None
        if old.parent_digest != parent_digest or bool(old.snapshot_blocks) != snapshot:
            return None
        return old

    def _reusable(self, prior: shards.RankPart, parts: list[shards.SlicePart]) -> bool:
        """Whether `prior` was made of these very weights and its blocks are all still here
        (claimed: retention now counts them as written under this version's write lease)."""
        return prior.slices == parts and \
            not self.blocks.claim(b.id for b in prior.delta_blocks + prior.snapshot_blocks)

    def commit(self) -> None:
        """The version was signed: what this rank holds becomes it."""
        if self._pending is None:
            raise ChainError("nothing to commit: encode or adopt first")
        held = {}
        writes = []
        for name, p in self._pending.items():
            if isinstance(p, _Held):
                held[name] = p
                continue
            h = self.held[name]
            h.sums = p.sums
            if p.pos.size:
                writes.append((h.host, p.pos, p.val))
                if p.pos_dev is not None and h.dev.device.type != "cpu":
                    h.dev[p.pos_dev] = p.val_dev
            held[name] = h
        # the host copies patched over the codec's threads (scale.py --ranks 2 at 1B: 1 rank
        # 0.82 -> 0.69 s a version)
        run_scatters(writes, self.threads)
        self.held, self._pending = held, None

    def discard(self) -> None:
        self._pending = None

    def forget_parts(self, upto: int) -> None:
        """Drop persisted parts of versions <= `upto` (published or abandoned)."""
        if not self.parts_dir.is_dir():
            return
        for d in self.parts_dir.glob("v*"):
            if d.name[1:].isdigit() and int(d.name[1:]) <= upto:
                shutil.rmtree(d, ignore_errors=True)


def _delta_writer(where: Slice, old: np.ndarray, pos: np.ndarray, val: np.ndarray,
                  threads: int, direct: int) -> Callable[[BlockWriter], int]:
    return lambda w: shards.write_delta(w, where, old, pos, val, threads, direct)


def _full_writer(where: Slice, bits: np.ndarray) -> Callable[[BlockWriter], int]:
    def write(w: BlockWriter) -> int:
        shards.write_full(w, where, bits)
        return int(bits.nbytes)
    return write
