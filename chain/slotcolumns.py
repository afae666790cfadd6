"""Where each tensor of a safetensors directory lies, as columns in byte order.

A region's apply asks its two directories about groups of tensors thousands of times a
version: are these 50 tensors back to back (one view, one kernel call), and which byte ranges
do these 10,000 tensors cover (one madvise per run). Walking a `Slot` object a tensor for
that cost ~0.1 s of a 50,000-tensor apply's main thread (py-spy, docs/MEASURED.md stop 50).
Here every tensor has a row (its place in byte order), and each question is a slice or an
array operation over rows; a file's columns are built once per header (`FileColumns.of`,
cached with the parsed header).
"""

import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


class _SlotLike(Protocol):
    name: str
    dtype: str
    start: int
    end: int


@dataclass(frozen=True)
class FileColumns:
    """One file's tensors in byte order: names, byte ranges (data offsets), dtypes and
    shapes."""

    names: list[str]
    start: np.ndarray
    end: np.ndarray
    metas: list[tuple[str, list[int]]] = field(repr=False)
    """Each row's (dtype, shape), as a tensor table lists them (TensorTable.metas)."""
    at: dict[str, int] = field(repr=False)
    """A name's row."""

    @classmethod
    def of(cls, slots: Iterable[_SlotLike]) -> "FileColumns":
        """The columns of one file's slots. A file written here lists its tensors in byte
        order already (`allocate`): then no sort."""
        rows = list(slots)
        start = np.fromiter((s.start for s in rows), np.int64, len(rows))
        end = np.fromiter((s.end for s in rows), np.int64, len(rows))
        if start.size > 1 and not ((start[1:] > start[:-1]) |
                                   ((start[1:] == start[:-1]) & (end[1:] >= end[:-1]))).all():
            order = np.lexsort((end, start))
            rows = [rows[i] for i in order.tolist()]
            start, end = start[order], end[order]
        names = [s.name for s in rows]
        start.setflags(write=False)  # shared by every reader of this header (cached)
        end.setflags(write=False)
        return cls(names, start, end, [(s.dtype, s.shape) for s in rows],
                   {n: i for i, n in enumerate(names)})


class SlotColumns:
    """A directory's files' columns end to end, in the order the files are given: rows, the
    file each row is in, and two run numbers: rows share `run` while each starts where the
    one before ends in the same file, and `typed_run` while they also share a dtype. Never
    changed once made: `of` hands the same one to every reader of the same headers."""

    @classmethod
    def of(cls, files: list[tuple[str, FileColumns]]) -> "SlotColumns":
        """`SlotColumns(files)`, or the one made before from the same files' columns (each
        `FileColumns` is cached with its parsed header, so the same header gives the same
        object; the ones kept here are held, so their ids are not reused)."""
        key = tuple((name, id(c)) for name, c in files)
        with _known_lock:
            known = _known.pop(key, None)
            if known is not None:
                _known[key] = known  # the most recently used goes last
                return known[1]
        made = cls(files)
        with _known_lock:
            _known[key] = (list(files), made)
            while len(_known) > _KEEP:
                _known.popitem(last=False)
        return made

    def __init__(self, files: list[tuple[str, FileColumns]]) -> None:
        self.files = [name for name, _ in files]
        if len(files) == 1:
            one = files[0][1]
            self.names, self.start, self.end, self.at = one.names, one.start, one.end, one.at
            self.metas = one.metas
            self.file = np.zeros(len(one.names), np.int32)
        else:
            self.names = [n for _, c in files for n in c.names]
            self.start = np.concatenate([c.start for _, c in files] or [np.empty(0, np.int64)])
            self.end = np.concatenate([c.end for _, c in files] or [np.empty(0, np.int64)])
            self.at = {n: i for i, n in enumerate(self.names)}
            self.metas = [m for _, c in files for m in c.metas]
            self.file = np.repeat(np.arange(len(files), dtype=np.int32),
                                  [len(c.names) for _, c in files])
        self.dtypes = dtypes = [dtype for dtype, _ in self.metas]
        n = len(self.names)
        breaks = np.ones(n, bool)
        breaks[1:] = (self.file[1:] != self.file[:-1]) | (self.start[1:] != self.end[:-1])
        self.run = np.cumsum(breaks)
        codes = {d: k for k, d in enumerate(sorted(set(dtypes)))}
        typed = np.fromiter((codes[d] for d in dtypes), np.int32, n)
        breaks[1:] |= typed[1:] != typed[:-1]
        self.typed_run = np.cumsum(breaks)
        for column in (self.file, self.start, self.end, self.run, self.typed_run):
            column.setflags(write=False)  # shared by every reader of these headers (`of`)

    def rows(self, names: list[str], known_only: bool = False) -> np.ndarray:
        """The rows of `names`, in the order given (KeyError on a name not here, unless
        `known_only`: then those are left out). Names that are consecutive rows (a batch of
        a table, in a directory written from it) take one lookup and a list comparison: a
        lookup a name, its dict entry out of cache, cost ten times as much (~0.3 us)."""
        first = self.first_row(names)
        if first is not None:
            return np.arange(first, first + len(names), dtype=np.int64)
        if known_only:
            at = self.at
            found = [at.get(n, -1) for n in names]
            rows = np.fromiter(found, np.int64, len(found))
            return rows[rows >= 0]
        return np.fromiter(map(self.at.__getitem__, names), np.int64, len(names))

    def ranges(self, rows: np.ndarray) -> Iterator[tuple[str, int, int]]:
        """(file, first byte, end byte) of each run of consecutive, adjacent rows in `rows`
        (in the order given: rows out of order only make more ranges)."""
        if not rows.size:
            return
        cut = np.flatnonzero((rows[1:] != rows[:-1] + 1) |
                             (self.run[rows[1:]] != self.run[rows[:-1]])) + 1
        firsts = rows[np.concatenate(([0], cut))]
        lasts = rows[np.concatenate((cut - 1, [rows.size - 1]))]
        files = self.file[firsts].tolist()
        for f, lo, hi in zip(files, self.start[firsts].tolist(), self.end[lasts].tolist(),
                             strict=True):
            yield self.files[f], lo, hi

    def first_row(self, names: list[str]) -> int | None:
        """The row of `names[0]` where `names` are consecutive rows in this order, else None
        (a tensor of no bytes may sort either side of its neighbour: callers check such
        names slot by slot)."""
        return first_row(self.at, self.names, names)

    def back_to_back(self, i: int, count: int) -> tuple[str, int, int, str] | None:
        """(file, first byte, end byte, dtype) of rows i..i+count-1 where they share a dtype
        and each starts where the one before ends in one file; else None."""
        j = i + count - 1
        if self.typed_run[i] != self.typed_run[j]:
            return None
        return self.files[int(self.file[i])], int(self.start[i]), int(self.end[j]), \
            self.dtypes[i]


_known: "OrderedDict[tuple, tuple[list[tuple[str, FileColumns]], SlotColumns]]" = OrderedDict()
"""`SlotColumns.of`'s: by the files' names and their columns' ids, the columns it was made
from (held, so the ids stay theirs) and what it made."""
_known_lock = threading.Lock()
_KEEP = 4
"""Directories' columns kept: a region's apply opens its base, its staging directory and the
spare it brings forward, all of one layout (three builds, ~27 ms a 50,000-tensor apply, are
one)."""


def first_row(at: dict[str, int], ordered: list[str], names: list[str]) -> int | None:
    """The row of `names[0]` in `ordered` (`at`: each name's row there) where `names` are
    consecutive rows of it in this order, else None: one lookup and one list comparison,
    where a lookup a name, its dict entry out of cache, costs ten times as much."""
    i = at.get(names[0]) if names else None
    if i is None or ordered[i:i + len(names)] != names:
        return None
    return i
