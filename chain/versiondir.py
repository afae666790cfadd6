"""The small files inside a reconstructed weights directory: VERSION.json and CHANGES.

VERSION.json says which version a directory holds and every tensor's digest; it is what
`WeightsDir.current()` trusts, so a truncated or garbled one is refused with BadVersionDir,
never a bare JSON or key error. CHANGES lists, per tensor, the element positions that changed
from the previous version to this one: it is how the older of two directories is brought
forward in place by copying only those positions (a tensor listed as whole changed entirely).
"""

import contextlib
import errno
import itertools
import json
import os
import re
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Generic, TypeVar

import numpy as np
import xxhash

from chain.atomic import write_atomic
from chain.errors import ChainError
from chain.slotcolumns import first_row
from chain.tensortable import PLAIN_JSON, interleaved

FORMAT = 2
"""2: digests are additive lane hashes (chain/lanehash.py); directories without a format were
written by an older deltaswarm with xxh3 digests."""
VERSION_FILE = "VERSION.json"
CHANGES_FILE = "CHANGES"
ADVANCE = "ADVANCE.json"  # in a staging dir: an older version being brought forward in place
SHARDS = "SHARDS.json"  # in a staging dir: a fresh build (its shard files)
JOURNAL = "JOURNAL"  # in a staging dir: the tensors already done
OURS = {VERSION_FILE, CHANGES_FILE, ADVANCE, SHARDS, JOURNAL, "model.safetensors.index.json"}
_MAGIC = b"DSC2"
_HEAD = struct.Struct("<4sQ")
WHOLE = -1
_DIGESTS = re.compile(r"[0-9a-f]{32}(?:,[0-9a-f]{32})*")


class BadVersionDir(ChainError):
    """A weights directory's VERSION.json or CHANGES is missing, truncated or inconsistent."""


@dataclass(frozen=True)
class VersionInfo:
    version: int
    state_digest: str
    run: str
    tensors: dict[str, str]

    def to_bytes(self) -> bytes:
        """The same bytes as `json.dumps(..., indent=1)`, with the tensor map written in one
        join of each row's quoted name and its digest (`_row_heads`): with an indent, json
        takes its pure-Python encoder, 0.1-0.2 s for a 50,000-tensor VERSION.json at every
        apply; a row at a time through the C string encoder, ~25 ms."""
        head = json.dumps({"format": FORMAT, "version": self.version,
                           "state_digest": self.state_digest, "run": self.run,
                           "tensors": {}}, indent=1)
        if not self.tensors:
            return head.encode()
        digests = list(self.tensors.values())
        if not PLAIN_JSON.fullmatch("".join(digests)):  # not hex: each quoted as json would
            enc = json.encoder.encode_basestring_ascii  # type: ignore[attr-defined]
            digests = [enc(d)[1:-1] for d in digests]
        rows = interleaved(_row_heads(list(self.tensors)), digests) + '"'
        cut = head.rindex("{}")
        return (head[:cut] + "{\n  " + rows + "\n }" + head[cut + 2:]).encode()


T = TypeVar("T")


class _KeptForNames(Generic[T]):
    """`make(names)` kept for the last list of names asked about, and given again while the
    next list is equal: a region's every VERSION.json and CHANGES lists the same tensors,
    whose equal names are the same string objects, so the check is ~0.3 ms at 50,000 where
    making the answer again cost 12-25 ms. One tuple replaced whole: a race between threads
    only makes an answer twice."""

    def __init__(self, make: Callable[[list[str]], T]) -> None:
        self._make = make
        self._last: tuple[list[str], T] | None = None

    def __call__(self, names: list[str]) -> T:
        last = self._last
        if last is not None and last[0] == names:
            return last[1]
        answer = self._make(names)
        self._last = (names, answer)
        return answer


def _quoted_row_heads(names: list[str]) -> list[str]:
    """Each tensor's row of VERSION.json's map up to its digest's first character (the row
    before closed)."""
    enc = json.encoder.encode_basestring_ascii  # type: ignore[attr-defined]
    heads = [f'",\n  {enc(n)}: "' for n in names]
    if heads:
        heads[0] = heads[0].removeprefix('",\n  ')
    return heads


_row_heads = _KeptForNames(_quoted_row_heads)
_names_json = _KeptForNames(json.dumps)
"""`json.dumps(names)` for CHANGES' header."""


_KNOWN: "OrderedDict[bytes, VersionInfo]" = OrderedDict()
"""VERSION.json files this process wrote or read, by the xxh3-128 of their bytes: a region
reads its current version's (3 MB at 50,000 tensors, 20-40 ms to parse) two or three times an
apply; hashing the bytes read costs ~1 ms. Keyed by content, so an entry is never stale: a
file changed in any byte is parsed (and checked) again."""
_KNOWN_LOCK = threading.Lock()
KNOWN_FILES = 2
"""The current version's and the one being written (each ~10 MB held at 50,000 tensors)."""


def _remember(key: bytes, info: VersionInfo) -> None:
    with _KNOWN_LOCK:
        _KNOWN[key] = info
        _KNOWN.move_to_end(key)
        while len(_KNOWN) > KNOWN_FILES:
            _KNOWN.popitem(last=False)


def read_info(directory: Path) -> VersionInfo:
    """The directory's VERSION.json, checked (BadVersionDir names what is wrong). The result
    is shared with every reader of the same bytes: read it, never change it."""
    path = Path(directory) / VERSION_FILE
    try:
        raw = path.read_bytes()
        key = xxhash.xxh3_128_digest(raw)
        with _KNOWN_LOCK:
            known = _KNOWN.get(key)
        if known is not None:
            return known
        doc = json.loads(raw)
    except FileNotFoundError:
        raise BadVersionDir(f"{path} is missing: the directory is not a finished version") \
            from None
    except (ValueError, UnicodeDecodeError) as e:
        raise BadVersionDir(f"{path} is truncated or not JSON ({e}); the directory cannot be "
                            "trusted and will be rebuilt from the chain") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else None
        raise BadVersionDir(f"{path} has format {got!r}, this build writes {FORMAT} (it was "
                            "made by another deltaswarm version); it will be rebuilt")
    try:
        tensors = doc["tensors"]
        # JSON object keys are strings; the values are checked in one C-level pass (a dict
        # comprehension converting each was 20-40 ms a read at 50,000 tensors)
        if type(tensors) is not dict or not set(map(type, tensors.values())) <= {str}:
            raise TypeError("tensors")
        # 32 lowercase hex digits each, checked in C over the joined text: a bring-forward
        # adds moves to these and would stop on a ValueError instead of copying from current
        if tensors and not _DIGESTS.fullmatch(",".join(tensors.values())):
            raise ValueError("tensors: a digest is not 32 hex digits")
        info = VersionInfo(int(doc["version"]), str(doc["state_digest"]), str(doc["run"]),
                           tensors)
    except (KeyError, TypeError, ValueError) as e:
        raise BadVersionDir(f"{path} lacks or garbles field {e}; it will be rebuilt") from None
    _remember(key, info)
    return info


def write_info(directory: Path, info: VersionInfo, mode: int | None) -> None:
    raw = info.to_bytes()
    write_atomic(Path(directory) / VERSION_FILE, raw, mode)
    _remember(xxhash.xxh3_128_digest(raw), info)


class ChangedPositions:
    """What CHANGES will hold, collected as an apply finishes tensors: runs of tensors with
    their positions end to end, a group record's members as the one array their group
    decoded to and a tensor alone as its own; a run is written as it lies. At 50,000 tensors in
    ~1,000 groups, cutting each group's array into its members' views and joining them again
    was ~80 ms of an apply's main thread (py-spy); collecting and writing 1,000 groups' positions
    took ~119 ms that way and ~80 ms this way with glibc's heap held fixed (docs/MEASURED.md,
    stop 49)."""

    def __init__(self) -> None:
        self._names: list[list[str]] = []
        self._counts: list[list[int]] = []  # WHOLE for a tensor changed whole
        self._positions: list[np.ndarray] = []

    @classmethod
    def of(cls, changes: Mapping[str, np.ndarray | None]) -> "ChangedPositions":
        """Each tensor of `changes` a run of its own (None: changed whole); `ordered` sorts."""
        out = cls()
        for name, pos in changes.items():
            out.tensor(name, pos)
        return out

    def tensor(self, name: str, pos: np.ndarray | None) -> None:
        """`name`'s own positions (None: changed whole)."""
        self._names.append([name])
        self._counts.append([WHOLE if pos is None else int(pos.size)])
        self._positions.append(_EMPTY if pos is None else pos)

    def members(self, names: list[str], own: np.ndarray, cuts: list[int]) -> None:
        """Consecutive tensors' positions end to end in `own` (each its own positions; member
        j's from cuts[j] to cuts[j + 1]), as codec.own_positions gives a group's."""
        if not names or len(cuts) != len(names) + 1:
            raise ValueError(f"{len(names)} tensors need {len(names) + 1} cuts, not {len(cuts)}"
                             + ("" if names else ", and a run needs a tensor"))
        self._names.append(names)
        self._counts.append([b - a for a, b in itertools.pairwise(cuts)])
        self._positions.append(own[cuts[0]:cuts[-1]])

    def as_dict(self) -> dict[str, np.ndarray | None]:
        """Each tensor's positions (None: changed whole); a tensor given twice, its last."""
        out: dict[str, np.ndarray | None] = {}
        for names, counts, pos in zip(self._names, self._counts, self._positions, strict=True):
            at = 0
            for name, count in zip(names, counts, strict=True):
                out[name] = None if count == WHOLE else pos[at:at + max(count, 0)]
                at += max(count, 0)
        return out

    def ordered(self) -> tuple[list[str], list[int], list[np.ndarray]]:
        """Every tensor's name and count in name order, and the runs' position arrays in the
        same order (end to end: every count's positions)."""
        order = sorted(range(len(self._names)), key=lambda k: self._names[k][0])
        names = [n for k in order for n in self._names[k]]
        if any(a >= b for a, b in itertools.pairwise(names)):  # runs interleave, or a repeat
            return ChangedPositions.of(self.as_dict()).ordered()
        return (names, [c for k in order for c in self._counts[k]],
                [self._positions[k] for k in order])


_EMPTY = np.empty(0, np.int64)


def write_changes(directory: Path, version: int,
                  changes: "Mapping[str, np.ndarray | None] | ChangedPositions",
                  mode: int | None = None) -> None:
    """Positions changed on the way to `version`, per tensor (None: the whole tensor), as a
    mapping or as an apply collected them (ChangedPositions). Not fsync'd: a file lost to a
    power cut is noticed (checksum) and costs a full copy."""
    if not isinstance(changes, ChangedPositions):
        changes = ChangedPositions.of(changes)
    names, counts, parts = changes.ordered()
    # hashed and written in runs of many tensors: per-tensor hashing and writes cost ~10 us
    # a tensor (half a second of a 50,000-tensor apply), one body would copy every position.
    # The body goes first behind a header holding a blank check of the same length, then the
    # header is written again with the check: each chunk is joined once, not once to hash it
    # and again to write it.
    listing = (f'{{"version": {json.dumps(version)}, "tensors": {_names_json(names)}, '
               f'"counts": {json.dumps(counts)}}}')

    def header(check: str) -> bytes:  # the listing made once (50,000 names: ~12 ms a dump)
        head = f'{listing[:-1]}, "check": "{check}"}}'.encode()
        return _HEAD.pack(_MAGIC, len(head)) + head

    h = xxhash.xxh3_64()
    blank = header("0" * len(h.hexdigest()))
    with _written_over(Path(directory) / CHANGES_FILE, mode) as f:
        f.write(blank)  # first: from here until the end a reader finds the check wrong
        for chunk in _chunks([p for p in parts if p.size]):
            raw = memoryview(chunk).cast("B")
            h.update(raw)
            f.write(raw)
        f.truncate()
        final = header(h.hexdigest())
        assert len(final) == len(blank)  # xxh3_64's hex digest: always 16 characters
        f.seek(0)
        f.write(final)


@contextlib.contextmanager
def _written_over(path: Path, mode: int | None) -> Iterator[BinaryIO]:
    """`path` opened to be written over in place, not replaced: CHANGES is as large as every
    changed position (8 bytes each: 80 MB a version at 1 % of 1B elements), and a new file
    takes that many fresh pages from the kernel at each apply, which on this host's VM cost
    0.04-0.2 s depending on where they come from (the same write swung 5x between applies,
    docs/MEASURED.md stop 56); the file brought forward already holds pages of about that
    size. Once the blank check is in the header (the first write), a write cut short leaves
    it there, so read_changes refuses the file and the next apply copies whole tensors, as
    for any damaged CHANGES; cut shorter, the file still holds the older version's, which
    nothing asks a staging directory for. Only the staging directory's own CHANGES is
    written this way (never a file other directories share); a symlink there is replaced by a
    file of its own, not followed into the file it names."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        os.unlink(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "r+b") as f:
        if mode is not None:
            os.fchmod(fd, mode)
        yield f


def _chunks(parts: list[np.ndarray], elements: int = 1 << 23, alone: int = 1 << 12
            ) -> Iterator[np.ndarray]:
    """`parts` as contiguous int64 arrays, in order: one of at least `alone` elements as it
    is, smaller ones joined into arrays of about `elements` (64 MiB), so neither 50,000 small
    writes (~10 us each) nor a copy of the large ones is made."""
    run: list[np.ndarray] = []
    size = 0
    for p in parts:
        if p.size >= alone:
            if run:
                yield np.concatenate(run, dtype=np.int64)
                run, size = [], 0
            yield np.ascontiguousarray(p, dtype=np.int64)
            continue
        run.append(p)
        size += p.size
        if size >= elements:
            yield np.concatenate(run, dtype=np.int64)
            run, size = [], 0
    if run:
        yield np.concatenate(run, dtype=np.int64)


def read_changes(directory: Path, version: int) -> "StoredChanges | None":
    """What write_changes stored for `version`, or None if absent, for another version, or
    damaged (the caller then copies whole tensors instead)."""
    path = Path(directory) / CHANGES_FILE
    try:
        raw = np.fromfile(path, np.uint8)
        magic, n = _HEAD.unpack(raw[: _HEAD.size].tobytes())
        if magic != _MAGIC:
            return None
        head = json.loads(raw[_HEAD.size : _HEAD.size + n].tobytes())
        if head["version"] != version:
            return None
        body = raw[_HEAD.size + n :]
        if body.size % 8 or xxhash.xxh3_64_hexdigest(memoryview(body)) != head["check"]:
            return None
        return StoredChanges(head["tensors"], head["counts"], body.view(np.int64))
    except (OSError, ValueError, KeyError, TypeError, OverflowError, struct.error):
        return None


def _all_among(these: np.ndarray, sorted_values: np.ndarray) -> bool:
    """Whether every one of `these` is in `sorted_values` (ascending): a binary search each,
    where np.isin sorts both together (8 against 1 ms at 50,000 tensors' firsts)."""
    if not these.size:
        return True
    if not sorted_values.size:
        return False
    at = np.minimum(np.searchsorted(sorted_values, these), sorted_values.size - 1)
    return bool(np.array_equal(sorted_values[at], these))


class StoredChanges(Mapping[str, "np.ndarray | None"]):
    """A CHANGES file's positions as read: each tensor's (None: changed whole), a slice of one
    array made when asked for, and a run of consecutive tensors' at once (`run`). A dict of
    50,000 slices made at every read, then gathered back a group at a time, cost a region
    ~30 ms a delta (py-spy, docs/MEASURED.md stop 50).

    What `write_changes` writes is checked as it is read, since the apply leans on it (the
    header is outside the checksum): names strictly in order, counts whole numbers that take
    every position, each tensor's positions strictly increasing from 0 up. A group's check
    that its positions lie inside their members looks only at each member's first and last
    (`fill._group_positions`): an unsorted list would slip a stray position into the next
    member, which the kernels, checking no bounds, would write. ValueError otherwise."""

    def __init__(self, names: list[str], counts: list[int], pos: np.ndarray) -> None:
        self.names, self.pos = names, pos
        if len(counts) != len(names) or any(type(c) is not int or c < WHOLE for c in counts) \
                or any(a >= b for a, b in itertools.pairwise(names)):
            raise ValueError("CHANGES lists its tensors out of order, twice, or with counts "
                             "that are not whole numbers")
        self.counts = np.asarray(counts, np.int64)  # OverflowError past 2^63
        self.starts = np.zeros(len(names) + 1, np.int64)
        np.cumsum(np.maximum(self.counts, 0), out=self.starts[1:])
        if int(self.starts[-1]) != pos.size:
            raise ValueError(f"CHANGES counts take {int(self.starts[-1])} positions; it holds "
                             f"{pos.size}")
        # each tensor's positions strictly increasing from 0: a step down only where a
        # tensor's first position follows the one before's last
        down = np.flatnonzero(pos[1:] <= pos[:-1]) + 1
        firsts = self.starts[:-1][self.counts > 0]
        if not _all_among(down, firsts) or (pos[firsts] < 0).any():
            raise ValueError("CHANGES positions are not sorted within a tensor, or negative")
        self._at: dict[str, int] | None = None

    def _rows(self) -> dict[str, int]:
        """Each tensor's row, made at the first lookup (a pass over every tensor)."""
        if self._at is None:
            self._at = {n: i for i, n in enumerate(self.names)}
        return self._at

    def __getitem__(self, name: str) -> np.ndarray | None:
        i = self._rows()[name]
        if self.counts[i] == WHOLE:
            return None
        return self.pos[self.starts[i]:self.starts[i + 1]]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def with_positions(self) -> list[str]:
        """The tensors not changed whole."""
        return [n for n, c in zip(self.names, self.counts.tolist(), strict=True) if c != WHOLE]

    def run(self, names: list[str]) -> tuple[np.ndarray, np.ndarray] | None:
        """Consecutive tensors' positions end to end (each its own) and their counts, where
        `names` are consecutive here in this order and none changed whole; else None."""
        i = first_row(self._rows(), self.names, names)
        if i is None:
            return None
        counts = self.counts[i:i + len(names)]
        if (counts == WHOLE).any():
            return None
        return self.pos[self.starts[i]:self.starts[i + len(names)]], counts
