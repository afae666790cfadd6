"""Sharded versions: what one rank of a sharded trainer contributes, and how one rank combines
the contributions into a single manifest (format 3: one sub-stream of blocks per rank).

A rank holds elements [lo, lo + count) of some tensors (a dim-0 shard is such a range). It
writes its own records (`at`, `count` in the header) and reports, per slice, its part of the
tensor digest: the lane sums over the 64-bit words wholly inside its range (global word
indices, so parts add up), plus the elements of the words it shares with a neighbour (at most
7 elements at each end), which the assembling rank joins and hashes. A delta moves a part by
the changed words alone, as the single-process publisher does. Every rank's report is a few
hundred bytes per tensor: that, not the weights, is what crosses between ranks.
"""

import math
from collections.abc import Sequence
from typing import Annotated, Protocol

import numpy as np
from numba import njit
from pydantic import BaseModel, ConfigDict, Field

from chain import codec, lanehash
from chain.codec.api import LOG2_SEG, THREADS
from chain.digest import state_digest
from chain.dtypes import lookup
from chain.errors import ChainError
from chain.lanemix import _mix0, _mix1
from chain.manifest import (
    FORMAT_SHARDED,
    BlockEntry,
    FileEntry,
    Manifest,
    Parent,
    TensorEntry,
)
from chain.stream import BlockWriter, RecordHeader

# lanemix.py's digest, compiled into this module's cached kernels (see
# chain.codec.kernels.LANEMIX_DIGEST; a test checks it).
LANEMIX_DIGEST = "1af0bf58416382d6"

SPARSE_BATCH = 1 << 21
"""Changed segments found on a device are rebuilt and encoded this many elements at a time
(bounded scratch: two segments, one per codec thread). Slices on the host are encoded in one
pass instead (chain/host_deltas.py)."""


# ---------------------------------------------------------------- digest parts


@njit(inline="always")
def _word_at(arr, lo, w, sh, width):
    """Global word w assembled from the slice arr (arr[0] is element lo); all of w is inside."""
    x = np.uint64(0)
    base = (w << sh) - lo
    for j in range(1 << sh):
        x |= np.uint64(arr[base + j]) << np.uint64(width * j)
    return x


@njit(nogil=True, cache=True)
def _interior_sum(arr, lo, sh, width, w0, w1):
    a = np.uint64(0)
    b = np.uint64(0)
    for w in range(w0, w1):
        x = _word_at(arr, lo, w, sh, width)
        uw = np.uint64(w)
        a += _mix0(uw, x)
        b += _mix1(uw, x)
    return a, b


@njit(nogil=True, cache=True)
def _interior_move(arr, lo, pos, val, sh, width, w0, w1):
    """Lane-sum change of the interior words when arr[pos] = val (pos sorted, local); arr is
    not written. Positions in shared (edge) words are left to the assembler."""
    a = np.uint64(0)
    b = np.uint64(0)
    ones = ~np.uint64(0) >> np.uint64(64 - width)
    j = 0
    while j < pos.size:
        w = (lo + pos[j]) >> sh
        if w < w0 or w >= w1:
            j += 1
            continue
        xo = _word_at(arr, lo, w, sh, width)
        xn = xo
        while j < pos.size and ((lo + pos[j]) >> sh) == w:
            s = np.uint64(width * ((lo + pos[j]) & ((1 << sh) - 1)))
            xn = (xn & ~(ones << s)) | (np.uint64(val[j]) << s)
            j += 1
        uw = np.uint64(w)
        a += _mix0(uw, xn) - _mix0(uw, xo)
        b += _mix1(uw, xn) - _mix1(uw, xo)
    return a, b


def word_span(lo: int, count: int, itemsize: int) -> tuple[int, int, int]:
    """(log2 elements per word, first and end global word wholly inside [lo, lo+count))."""
    sh = {1: 3, 2: 2, 4: 1, 8: 0}[itemsize]
    per = 1 << sh
    w0 = -(-lo // per)
    w1 = max(w0, (lo + count) // per)
    return sh, w0, w1


def edge_positions(lo: int, count: int, itemsize: int) -> np.ndarray:
    """Local positions of the slice's elements that share a word with another slice."""
    sh, w0, w1 = word_span(lo, count, itemsize)
    per = 1 << sh
    head = np.arange(0, min(count, w0 * per - lo), dtype=np.int64)
    tail = np.arange(max(head.size, w1 * per - lo), count, dtype=np.int64)
    return np.concatenate([head, tail])


def interior_sum(arr: np.ndarray, lo: int) -> tuple[int, int]:
    """Lane sums over the global words wholly inside the slice `arr` (flat bit patterns,
    arr[0] being element lo of its tensor)."""
    sh, w0, w1 = word_span(lo, arr.size, arr.itemsize)
    if w1 <= w0:
        return 0, 0
    per = 1 << sh
    inner = arr[w0 * per - lo: w1 * per - lo]
    if inner.__array_interface__["data"][0] % 8 == 0 and inner.flags.c_contiguous:
        a, b = lanehash._sum_words(inner.view(np.uint8).view(np.uint64), w0)
    else:
        a, b = _interior_sum(arr, lo, sh, 8 * arr.itemsize, w0, w1)
    return int(a), int(b)


def interior_move(arr: np.ndarray, lo: int, pos: np.ndarray, val: np.ndarray) -> tuple[int, int]:
    sh, w0, w1 = word_span(lo, arr.size, arr.itemsize)
    a, b = _interior_move(arr, lo, pos, val, sh, 8 * arr.itemsize, w0, w1)
    return int(a), int(b)


def add_sums(x: Sequence[int], y: Sequence[int]) -> tuple[int, int]:
    return (int(x[0]) + int(y[0])) & lanehash.M64, (int(x[1]) + int(y[1])) & lanehash.M64


# ---------------------------------------------------------------- what a rank reports


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SlicePart(_Strict):
    """One rank's slice of one tensor in one version: where it is, what its record says, and
    its digest part (interior lane sums and the values of its edge elements)."""

    name: str
    dtype: str
    shape: list[int]
    lo: int = Field(ge=0)
    count: int = Field(ge=0)
    op: str  # "delta" (its records, if any, are deltas) or "full"
    a: int = Field(ge=0, lt=1 << 64)
    b: int = Field(ge=0, lt=1 << 64)
    edge_pos: list[int] = []  # local positions
    edge_val: list[Annotated[int, Field(ge=0, lt=1 << 64)]] = []
    changed: int = 0


class RankPart(_Strict):
    """Everything one rank contributes to one version: its slices and its block streams.
    Persisted by the rank before the gather, so after a crash it is reused, not re-encoded."""

    rank: int = Field(ge=0)
    version: int = Field(ge=0)
    parent_digest: str | None
    slices: list[SlicePart]
    delta_blocks: list[BlockEntry] = []
    snapshot_blocks: list[BlockEntry] = []
    encoded_bytes: int = 0
    d2h_bytes: int = 0
    seconds: float = 0.0
    reused: bool = False
    error: str | None = None


def slice_part(name: str, dtype: str, shape: Sequence[int], lo: int, count: int,
               sums: tuple[int, int], op: str, edge_val: np.ndarray, changed: int = 0
               ) -> SlicePart:
    """The part of a slice whose interior sums are `sums` and whose elements at
    `edge_positions(lo, count, itemsize)` hold `edge_val`."""
    edges = edge_positions(lo, count, lookup(dtype).itemsize)
    return SlicePart(name=name, dtype=dtype, shape=list(shape), lo=lo, count=count, op=op,
                     a=int(sums[0]), b=int(sums[1]), edge_pos=edges.tolist(),
                     edge_val=[int(v) for v in edge_val], changed=changed)


# ---------------------------------------------------------------- a rank's records


class Placed(Protocol):
    """Where a rank's records go: elements from `lo` of tensor `name` (`dtype`, global
    `shape`). A SlicePart is one, and so is the trainer's Slice."""

    name: str
    dtype: str
    shape: list[int]
    lo: int


def write_full(writer: BlockWriter, where: Placed, bits: np.ndarray) -> None:
    """The full record of the slice at `where` holding `bits`."""
    if bits.size == 0 and math.prod(where.shape):  # no rows of a non-empty tensor
        return
    writer.write_record(RecordHeader(where.name, "full", where.dtype, where.shape, bits.nbytes,
                                     at=where.lo, count=bits.size),
                        memoryview(np.ascontiguousarray(bits)).cast("B"))


def write_segment(writer: BlockWriter, where: Placed, s0: int, s1: int,
                  payload: bytes) -> int:
    """The delta record of elements [s0, s1) of the slice at `where`; its payload bytes."""
    writer.write_record(RecordHeader(where.name, "delta", where.dtype, where.shape, len(payload),
                                     at=where.lo + s0, count=s1 - s0), payload)
    return len(payload)


def write_delta(writer: BlockWriter, where: Placed, old: np.ndarray, pos: np.ndarray,
                val: np.ndarray, threads: int = THREADS, direct: int = codec.DIRECT) -> int:
    """Records turning slice `old` into old-with-old[pos]=val, for changes found elsewhere (on
    the device that holds the new slice): one codec payload per segment that changed, each
    rebuilt from `old` in bounded scratch, so the new slice is never held whole. Returns the
    payload bytes written. `direct`: how positions are coded (chain.codec.api.DIRECT)."""
    seg = 1 << LOG2_SEG
    bounds = np.searchsorted(pos, np.arange(0, old.size + seg, seg, dtype=np.int64))
    todo = [(s * seg, min(old.size, (s + 1) * seg), bounds[s], bounds[s + 1])
            for s in range(len(bounds) - 1) if bounds[s + 1] > bounds[s]]
    written = 0
    for i in range(0, len(todo), max(1, SPARSE_BATCH // seg)):
        batch = todo[i:i + max(1, SPARSE_BATCH // seg)]
        pairs = []
        for s0, s1, j0, j1 in batch:
            new = old[s0:s1].copy()
            new[pos[j0:j1] - s0] = val[j0:j1]
            pairs.append((old[s0:s1], new, where.dtype))
        coded = codec.encode_changes(pairs, threads, changes=False, direct=direct)
        for (s0, s1, _, _), (payload, _) in zip(batch, coded, strict=True):
            written += write_segment(writer, where, s0, s1, payload)
    return written


# ---------------------------------------------------------------- the assembling rank


def combine_digest(dtype: str, shape: Sequence[int], parts: Sequence[SlicePart]) -> str:
    """The tensor digest from every rank's part (the slices must tile the tensor)."""
    d = lookup(dtype)
    a, b = lanehash.base(dtype, shape)
    shared: dict[int, int] = {}
    sh = {1: 3, 2: 2, 4: 1, 8: 0}[d.itemsize]
    for p in parts:
        a, b = a + p.a, b + p.b
        for lp, v in zip(p.edge_pos, p.edge_val, strict=True):
            g = p.lo + lp
            shared[g >> sh] = shared.get(g >> sh, 0) | (v << (d.bits * (g & ((1 << sh) - 1))))
    for w, x in shared.items():
        pa, pb = lanehash._sum_words(np.array([x], np.uint64), w)
        a, b = a + int(pa), b + int(pb)
    return lanehash.to_hex(a, b)


def tensor_entries(parts: Sequence[RankPart]) -> list[TensorEntry]:
    """Tensor entries of the version, each slice set checked to tile its tensor exactly."""
    by_name: dict[str, list[SlicePart]] = {}
    for rp in parts:
        for s in rp.slices:
            by_name.setdefault(s.name, []).append(s)
    out = []
    for name in sorted(by_name):
        slices = sorted(by_name[name], key=lambda s: (s.lo, s.count))
        first = slices[0]
        numel = int(np.prod(first.shape, dtype=np.int64))
        end = 0
        for s in slices:
            if (s.dtype, s.shape) != (first.dtype, first.shape):
                raise ChainError(f"ranks disagree on {name}: {s.dtype}{s.shape} vs "
                                 f"{first.dtype}{first.shape}")
            if s.count == 0:  # a rank with no rows of it (uneven dim-0 shards)
                continue
            if s.lo != end:
                how = "overlap" if s.lo < end else "leave a gap"
                raise ChainError(f"the ranks' slices of {name} {how} at element "
                                 f"{min(s.lo, end)}: each element needs exactly one owner")
            end = s.lo + s.count
        if len({s.op for s in slices if s.count}) > 1:
            raise ChainError(f"ranks disagree whether {name} is new (full) or changed "
                             "(delta): restart every rank from the same published version")
        if end != numel:
            raise ChainError(f"the ranks' slices of {name} cover {end} of {numel} elements")
        out.append(TensorEntry(name=name, dtype=first.dtype, shape=first.shape,
                               digest=combine_digest(first.dtype, first.shape, slices)))
    return out


def assemble(parts: Sequence[RankPart], *, run: str, version: int, kind: str,
             tensors: list[TensorEntry], parent: Parent | None,
             files: Sequence[tuple[FileEntry, BlockEntry | None]] = (),
             stats: dict[str, int | float] | None = None) -> Manifest:
    """The unsigned format-3 manifest of `kind` over every rank's blocks of that kind (rank
    order, one sub-stream per rank that wrote any) plus the files' blocks."""
    streams = [p.delta_blocks if kind == "delta" else p.snapshot_blocks
               for p in sorted(parts, key=lambda p: p.rank)]
    streams = [s for s in streams if s]
    blocks = [b for s in streams for b in s]
    ids = {b.id for b in blocks}
    extra = [b for _, b in files if b is not None and b.id not in ids]
    return Manifest(format=FORMAT_SHARDED, run=run, version=version, kind=kind,
                    parent=parent if kind == "delta" else None,
                    state_digest=state_digest({t.name: t.digest for t in tensors}),
                    tensors=tensors, blocks=blocks + extra, files=[f for f, _ in files],
                    stats=stats or {}, streams=[len(s) for s in streams])
