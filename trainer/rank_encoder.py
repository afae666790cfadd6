"""One rank's half of a sharded publish, with no collectives (so one process can test it).

The rank keeps what it last published of each slice it holds: a host copy of the bit patterns
(the codec's base; 1x the shard) and, when the weights live on a GPU, a device copy to compare
against (on CPU the host copy serves as both). A version is found by comparing on the device,
copying the changed positions and values to the host, moving the slice's digest part by the
changed words, and writing records for the changed segments only. Nothing the rank keeps
changes until `commit`, which the publisher calls once the version is signed; a version that
fails is dropped with `discard`, leaving the rank at the previous one.

The rank's result is also written to `parts/vNNNNNNNN/rankNNNNN.json` beside its blocks, so a
rank that restarts with the same weights reuses it instead of encoding again.
"""

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from chain import shards
from chain.atomic import write_atomic
from chain.blocks import BlockStore
from chain.errors import ChainError
from chain.stream import BlockWriter
from trainer.changes import Found, device_view, find_changes


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
    def __init__(self, blocks: BlockStore, parts_dir: Path, rank: int, block_size: int) -> None:
        self.blocks, self.parts_dir, self.rank = blocks, Path(parts_dir), rank
        self.block_size = block_size
        self.held: dict[str, _Held] = {}
        self._pending: dict[str, _Held | tuple[Found, tuple[int, int]]] | None = None

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
        self._pending = {}
        parts: list[shards.SlicePart] = []
        d2h = 0
        for s in sorted(slices, key=lambda s: (s.name, s.lo)):
            h = self.held.get(s.name)
            if delta and h is not None and h.fits(s):
                f = find_changes(h.dev, s.bits)
                d2h += f.d2h_bytes
                sums = shards.add_sums(h.sums, shards.interior_move(h.host, s.lo, f.pos, f.val))
                self._pending[s.name] = (f, sums)
                parts.append(shards.slice_part(s.name, s.dtype, s.shape, s.lo, s.bits.numel(),
                                               sums, "delta", _edges(s), int(f.pos.size)))
            else:
                n = _held(s, _host_copy(s.bits))
                self._pending[s.name] = n
                parts.append(shards.slice_part(s.name, s.dtype, s.shape, s.lo, s.bits.numel(),
                                               n.sums, "full", _edges(s), s.bits.numel()))
        stored = self._stored(version, parent_digest, parts, snapshot)
        if stored is not None:
            return stored
        by_name = {s.name: s for s in slices}
        dw = BlockWriter(self.blocks, self.block_size)
        sw = BlockWriter(self.blocks, self.block_size)
        encoded = 0
        for p in parts:
            pend = self._pending[p.name]
            if isinstance(pend, tuple):
                pend = pend[0]
            if delta and isinstance(pend, Found):
                if pend.pos.size:
                    encoded += shards.write_delta(dw, p, self.held[p.name].host, pend.pos,
                                                  pend.val)
            elif delta:
                shards.write_full(dw, p, pend.host)
                encoded += pend.host.nbytes
            if snapshot:
                bits = pend.host if isinstance(pend, _Held) else _host_view(by_name[p.name].bits)
                shards.write_full(sw, p, bits)
        part = shards.RankPart(rank=self.rank, version=version, parent_digest=parent_digest,
                               slices=parts, delta_blocks=dw.close() if delta else [],
                               snapshot_blocks=sw.close() if snapshot else [],
                               encoded_bytes=encoded, d2h_bytes=d2h,
                               seconds=time.perf_counter() - t0)
        path = self.part_path(version)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, part.model_dump_json().encode())
        return part

    def _stored(self, version: int, parent_digest: str | None, parts: list[shards.SlicePart],
                snapshot: bool) -> shards.RankPart | None:
        """The part this rank wrote for these very weights before a crash, if its blocks are
        all still here (claimed: retention now counts them as written under this version's
        write lease)."""
        try:
            old = shards.RankPart.model_validate_json(self.part_path(version).read_bytes())
        except (OSError, ValueError):
            return None
        if old.parent_digest != parent_digest or old.slices != parts or \
                bool(old.snapshot_blocks) != snapshot or \
                self.blocks.claim(b.id for b in old.delta_blocks + old.snapshot_blocks):
            return None
        return old.model_copy(update={"reused": True})

    def commit(self) -> None:
        """The version was signed: what this rank holds becomes it."""
        if self._pending is None:
            raise ChainError("nothing to commit: encode or adopt first")
        held = {}
        for name, p in self._pending.items():
            if isinstance(p, _Held):
                held[name] = p
                continue
            h = self.held[name]
            p, h.sums = p
            if p.pos.size:
                h.host[p.pos] = p.val
                if h.dev.device.type != "cpu":
                    h.dev[p.pos_dev] = p.val_dev
            held[name] = h
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
