"""Reading and writing safetensors files as raw bit patterns, tensor by tensor.

The safetensors library loads whole files; reconstruction instead preallocates a file from the
manifest's tensor list and fills one tensor slot at a time through a memory map, so a 1 TB
model streams with memory bounded by about one tensor. Files written here load in safetensors,
transformers and vLLM like any other.
"""

import ctypes
import errno
import itertools
import json
import mmap
import os
import stat
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, NamedTuple

import numpy as np
import xxhash

from chain.dtypes import FROM_SAFETENSORS, SAFETENSORS_NAME, lookup
from chain.errors import ChainError
from chain.slotcolumns import FileColumns, SlotColumns

SHARD_BYTES = 4 * 1024**3
INDEX_NAME = "model.safetensors.index.json"


class NotRegular(ChainError):
    """A path that should be a file holds a symbolic link, a named pipe, a device or a
    directory; nothing was read from it."""


class FileChanged(ChainError):
    """A file ended (was truncated or replaced) while it was being read."""


_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a named pipe"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def kind_of(mode: int) -> str:
    """What a non-regular st_mode is, in words."""
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def open_regular(path: Path, follow: bool = True) -> BinaryIO:
    """`path` opened for reading if it is a regular file, else `NotRegular`. The open never
    blocks (O_NONBLOCK: a named pipe with no writer would hang it forever) and, with
    `follow=False`, never follows a symbolic link (O_NOFOLLOW); the type is checked on the open
    descriptor (fstat), so a file swapped after a check is caught too."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if not follow and e.errno == errno.ELOOP:  # the last component is a symbolic link
            raise NotRegular(f"{path} is a symbolic link; only regular files are read") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotRegular(f"{path} is {kind_of(mode)}; only regular files are read")
    return open(fd, "rb", buffering=0)


@dataclass(frozen=True, slots=True)
class Slot:
    name: str
    dtype: str
    shape: list[int]
    file: str
    start: int
    end: int


def read_header(path: Path, follow: bool = True) -> tuple[int, dict[str, Slot]]:
    """(data start offset, slots) of one safetensors file (a regular file: see open_regular)."""
    with open_regular(path, follow) as f:
        return _parse_header(path, f)


def read_columns(path: Path) -> tuple[int, dict[str, Slot], FileColumns]:
    """`read_header`, with the file's slots as columns in byte order (built once per header,
    kept with it)."""
    with open_regular(path) as f:
        base, parsed = _parsed_header(path, f)
    columns = parsed.columns
    if columns is None:  # two threads may both build it: the same columns either way
        columns = parsed.columns = FileColumns.of(parsed.slots.values())
    return base, dict(parsed.slots), columns


@dataclass
class _Parsed:
    """A parsed, checked header: its slots (never changed once made) and their columns."""
    slots: dict[str, Slot]
    columns: FileColumns | None = None


def _parse_header(path: Path, f: BinaryIO) -> tuple[int, dict[str, Slot]]:
    base, parsed = _parsed_header(path, f)
    return base, dict(parsed.slots)


def _parsed_header(path: Path, f: BinaryIO) -> tuple[int, _Parsed]:
    head = f.read(8)
    if len(head) != 8:
        raise ChainError(f"{path} is not a safetensors file (too short)")
    (n,) = struct.unpack("<Q", head)
    if n > 100 * 1024 * 1024:
        raise ChainError(f"{path}: safetensors header of {n} bytes is implausible")
    raw = f.read(n)
    data_bytes = os.fstat(f.fileno()).st_size - 8 - n
    file = Path(path).name
    key = (file, data_bytes, len(raw), xxhash.xxh3_128_intdigest(raw))
    with _parsed_lock:
        known = _parsed.pop(key, None)
        if known is not None:  # the most recently used goes last
            _parsed[key] = known
    if known is not None:
        return 8 + n, known
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ChainError(f"{path}: safetensors header is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ChainError(f"{path}: safetensors header is not a JSON object")
    slots = {}
    for name, info in doc.items():
        if name == "__metadata__":
            continue
        slots[name] = _slot(path, file, name, info, data_bytes)
    parsed = _Parsed(slots)
    with _parsed_lock:
        _parsed[key] = parsed
        while sum(len(p.slots) for p in _parsed.values()) > _PARSED_SLOTS and len(_parsed) > 1:
            _parsed.pop(next(iter(_parsed)))
    return 8 + n, parsed


_PARSED_SLOTS = 70_000
_parsed: dict[tuple, _Parsed] = {}
"""Headers already parsed and checked, by (file name, data bytes, header bytes), oldest dropped
first past _PARSED_SLOTS tensors (~400 B each, name included, and ~200 B of columns): a region
opens each version's directories again and again, and they share one layout (at 50,000 tensors
a parse costs ~0.25 s, twice per apply). Slots are immutable; callers get their own dict."""
_parsed_lock = threading.Lock()


def _slot(path: Path, file: str, name: str, info: object, data_bytes: int) -> Slot:
    """One header entry, checked: known dtype, offsets inside the file that fit the shape."""
    try:
        dtype, shape, (s, e) = info["dtype"], list(info["shape"]), info["data_offsets"]
        numel = 1
        for d in shape:
            numel *= int(d)
        ok = all(type(x) is int and x >= 0 for x in (*shape, s, e))  # bool is no dimension
    except (TypeError, KeyError, ValueError):
        ok = False
    if not ok:
        raise ChainError(f"{path}: tensor {name} has a malformed header entry {info!r:.120}; "
                         "the file is not valid safetensors")
    if dtype not in FROM_SAFETENSORS:
        raise ChainError(f"{path}: tensor {name} has unsupported dtype {dtype}")
    size = numel * lookup(FROM_SAFETENSORS[dtype]).itemsize
    if e - s != size or e > data_bytes:
        raise ChainError(f"{path}: tensor {name} spans bytes {s}..{e} of {data_bytes}, its "
                         f"shape needs {size}; the file is truncated or corrupt")
    return Slot(name, FROM_SAFETENSORS[dtype], shape, file, s, e)


class _Map(NamedTuple):
    """One file's memory map, its data offset, and the map as a plain array: slicing a
    np.memmap runs Python hooks per slice (microseconds that add up over 50,000 tensors)."""
    mm: np.memmap
    base: int
    flat: np.ndarray

    @classmethod
    def open(cls, path: Path, base: int, mode: str) -> "_Map":
        mm = np.memmap(path, dtype=np.uint8, mode=mode)
        return cls(mm, base, mm.view(np.ndarray))


def _view(maps: dict[str, _Map], slot: Slot) -> np.ndarray:
    dt = lookup(slot.dtype)
    if slot.end == slot.start:
        return np.zeros(0, dtype=dt.uint)
    m = maps[slot.file]
    return m.flat[m.base + slot.start : m.base + slot.end].view(dt.uint)


def _span(maps: dict[str, _Map], slots: list[Slot]) -> np.ndarray | None:
    """The elements of `slots` (one dtype) as one flat view, when they lie back to back in one
    file in this order; else None."""
    first = slots[0]
    for a, b in itertools.pairwise(slots):
        if b.file != first.file or b.start != a.end or b.dtype != first.dtype:
            return None
    if first.file not in maps or slots[-1].end == first.start:
        return None
    m = maps[first.file]
    return m.flat[m.base + first.start : m.base + slots[-1].end].view(lookup(first.dtype).uint)


MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23  # Linux 5.14+; older kernels skip them


def _advise(maps: dict[str, _Map], slot: Slot, advice: int,
            span: tuple[int, int] | None = None) -> None:
    """madvise a tensor's pages. DONTNEED drops them from this process's mappings (its
    resident memory) while the data stays in the page cache, written pages included (the
    mappings are shared): it bounds the footprint while walking a model. POPULATE_* maps them
    in one call: a write fault per page on ext4 costs microseconds (page_mkwrite), and a
    version touches every page of the model at 1 % density. `span`: only these bytes of the
    tensor (from its start)."""
    if slot.end == slot.start or slot.file not in maps:
        return
    start, end = (slot.start, slot.end) if span is None else \
        (slot.start + span[0], min(slot.end, slot.start + span[1]))
    _advise_range(maps[slot.file], start, end, advice)


def _released_madvise() -> "Callable[[int, int, int], int] | None":
    """libc's madvise(addr, length, advice) through ctypes, which lets go of the GIL for the
    call; None where libc has none (`mmap.madvise` is used then). Python's `mmap.madvise`
    holds the GIL: populating a batch's pages (~0.6 s a GB on tmpfs) stopped the other codec
    thread's Python that long, at every hand-back between its kernels (a thread counting in a
    loop beside a 1 GB populate ran at 1/15 of its speed; beside the same call through ctypes,
    at full speed)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _released_madvise()


def _advise_range(m: _Map, start: int, end: int, advice: int) -> None:
    """madvise bytes start..end of a file's data, widened to whole pages. A failed populate
    is ignored (kernels before 5.14 know no MADV_POPULATE_*: the pages then fault in as
    touched); a failed DONTNEED raises."""
    mm, base, flat = m
    raw = getattr(mm, "_mmap", None)
    if raw is None:
        return
    page = mmap.PAGESIZE
    lo = (base + start) // page * page
    hi = min(len(raw), -(-(base + end) // page) * page)
    if hi <= lo:
        return
    if _MADVISE is None:
        try:
            raw.madvise(advice, lo, hi - lo)
        except OSError:
            if advice == mmap.MADV_DONTNEED:
                raise
        return
    # `flat` views the whole map from its first byte (np.memmap at offset 0) and keeps it
    # mapped for the call; a page-aligned address, as madvise needs
    if _MADVISE(flat.__array_interface__["data"][0] + lo, hi - lo, advice) != 0 and \
            advice == mmap.MADV_DONTNEED:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise(DONTNEED) of {mm.filename} bytes {lo}..{hi} failed: "
                           f"{os.strerror(err)}; the map is no longer this file's (closed "
                           "or remapped under the reader?). The apply stops here and resumes "
                           "from its journal when run again; if it recurs, report it as a "
                           "deltaswarm bug with this message")


class _MappedFiles:
    """What `TensorFiles` and `WritableFiles` share: each file's memory map, every tensor's
    slot, and the slots as columns (`SlotColumns`), which answer a group's questions (one
    view? which byte ranges?) without walking a slot a tensor."""

    def _open(self, directory: Path, files: list[str], mode: str) -> None:
        self.slots: dict[str, Slot] = {}
        self._maps: dict[str, _Map] = {}
        columns: list[tuple[str, FileColumns]] = []
        for fname in files:
            base, slots, cols = read_columns(Path(directory) / fname)
            if (Path(directory) / fname).stat().st_size > base:
                self._maps[fname] = _Map.open(Path(directory) / fname, base, mode)
            for name in slots:
                if name in self.slots:
                    raise ChainError(f"tensor {name} appears in two files of {directory}")
            self.slots.update(slots)
            columns.append((fname, cols))
        self._columns = SlotColumns.of(columns)

    def bits(self, name: str) -> np.ndarray:
        return _view(self._maps, self.slots[name])

    def span(self, names: list[str]) -> np.ndarray | None:
        """These tensors' elements as one flat view, if they lie back to back in one file in
        this order (one dtype); else None."""
        first = self._columns.first_row(names)
        if first is None:  # not consecutive rows: slot by slot
            return _span(self._maps, [self.slots[n] for n in names])
        where = self._columns.back_to_back(first, len(names))
        if where is None or where[0] not in self._maps or where[2] == where[1]:
            return None
        file, lo, hi, dtype = where
        m = self._maps[file]
        return m.flat[m.base + lo : m.base + hi].view(lookup(dtype).uint)

    def holds(self, names: list[str], metas: list[tuple[str, list[int]]]) -> bool:
        """Whether these tensors are here with these (dtype, shape)s: one list comparison
        where they are consecutive here (a group of a table, in a directory written from
        it), else a slot each."""
        first = self._columns.first_row(names)
        if first is not None:
            return self._columns.metas[first:first + len(names)] == metas
        slots = self.slots
        return all((s := slots.get(n)) is not None and (s.dtype, s.shape) == m
                   for n, m in zip(names, metas, strict=True))

    def release(self, name: str) -> None:
        _advise(self._maps, self.slots[name], mmap.MADV_DONTNEED)

    def release_many(self, names: list[str], known_only: bool = False) -> None:
        """Drop these tensors' pages from this process, one call per run of adjacent ones
        (`known_only`: names not in these files are skipped, else KeyError)."""
        self._advise_many(names, mmap.MADV_DONTNEED, known_only)

    def _advise_many(self, names: list[str], advice: int, known_only: bool = False) -> None:
        """`_advise` for several tensors, one madvise per run of adjacent ones: tensors lie
        back to back, so a batch of 10,000 small tensors is a few calls, not 10,000. Runs are
        merged in the order given (callers go in table order, which is file order): tensors
        out of order only make more calls."""
        for file, lo, hi in self._columns.ranges(self._columns.rows(names, known_only)):
            if hi > lo and file in self._maps:  # a run of empty tensors: no pages
                _advise_range(self._maps[file], lo, hi, advice)

    def names(self) -> list[str]:
        return sorted(self.slots)


class TensorFiles(_MappedFiles):
    """Read-only bit-pattern views of every tensor in a safetensors file or HF directory."""

    def __init__(self, path: Path) -> None:
        path = Path(path)
        files = ([path] if path.is_file() else sorted(path.glob("*.safetensors")))
        if not files:
            raise ChainError(f"no .safetensors files in {path}")
        self._open(files[0].parent, [f.name for f in files], "r")

    def prefault(self, name: str) -> None:
        _advise(self._maps, self.slots[name], MADV_POPULATE_READ)

    def prefault_many(self, names: list[str]) -> None:
        self._advise_many(names, MADV_POPULATE_READ)


class ReadFiles:
    """Bit patterns of every tensor in named safetensors files, read with pread into memory
    this process owns: for files another process may truncate or rewrite while they are read
    (a trainer's checkpoint). A shared memory map of such a file kills the reader with SIGBUS,
    which Python cannot catch, when a page it touches is cut off; a short read here raises
    `FileChanged` instead. Files are opened once, never through a symbolic link, and only if
    regular. Memory: each `bits` call returns a fresh copy of one tensor."""

    def __init__(self, directory: Path, files: list[str] | tuple[str, ...]) -> None:
        if not files:
            raise ChainError(f"no .safetensors files in {directory}")
        self.slots: dict[str, Slot] = {}
        self._files: dict[str, tuple[BinaryIO, int]] = {}
        try:
            for fname in files:
                f = open_regular(Path(directory) / fname, follow=False)
                self._files[fname] = (f, 0)
                base, slots = _parse_header(Path(directory) / fname, f)
                self._files[fname] = (f, base)
                for name, slot in slots.items():
                    if name in self.slots:
                        raise ChainError(f"tensor {name} appears in two files of {directory}")
                    self.slots[name] = slot
        except BaseException:
            self.close()
            raise
        self.directory = Path(directory)

    def bits(self, name: str) -> np.ndarray:
        slot = self.slots[name]
        dt = lookup(slot.dtype)
        out = np.empty(slot.end - slot.start, dtype=np.uint8)
        f, base = self._files[slot.file]
        view, done = memoryview(out), 0
        while done < len(out):
            got = os.preadv(f.fileno(), [view[done:]], base + slot.start + done)
            if got == 0:
                raise FileChanged(
                    f"{self.directory / slot.file} ended at byte {base + slot.start + done} "
                    f"while tensor {name} (bytes {base + slot.start}..{base + slot.end}) was "
                    "read: it was truncated or rewritten meanwhile")
            done += got
        return out.view(dt.uint)

    def release(self, name: str) -> None:
        """Nothing to drop: `bits` hands out copies the caller frees."""

    def release_many(self, names: list[str], known_only: bool = False) -> None:
        """Nothing to drop (see release)."""

    def prefault(self, name: str) -> None:
        """Nothing to map: `bits` reads on demand."""

    def prefault_many(self, names: list[str]) -> None:
        """Nothing to map (see prefault)."""

    def names(self) -> list[str]:
        return sorted(self.slots)

    def close(self) -> None:
        for f, _ in self._files.values():
            f.close()
        self._files.clear()


def layout(entries: list[tuple[str, str, list[int], int]], shard_bytes: int = SHARD_BYTES
           ) -> dict[str, list[tuple[str, str, list[int], int]]]:
    """Group (name, dtype, shape, nbytes) in name order into shard files of ~shard_bytes."""
    shards: list[list] = [[]]
    size = 0
    for e in sorted(entries):
        if shards[-1] and size + e[3] > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e[3]
    if len(shards) == 1:
        return {"model.safetensors": shards[0]}
    n = len(shards)
    return {f"model-{i + 1:05d}-of-{n:05d}.safetensors": s for i, s in enumerate(shards)}


def allocate(path: Path, entries: list[tuple[str, str, list[int], int]]) -> None:
    """Create a safetensors file with this header and zero-filled (sparse) data."""
    header: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": SAFETENSORS_NAME[dtype], "shape": shape,
                        "data_offsets": [off, off + nbytes]}
        off += nbytes
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(body)))
        f.write(body)
        f.truncate(8 + len(body) + off)


def write_index(directory: Path, shards: dict[str, list]) -> None:
    if len(shards) == 1:
        return
    weight_map = {e[0]: fname for fname, es in shards.items() for e in es}
    total = sum(e[3] for es in shards.values() for e in es)
    doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (Path(directory) / INDEX_NAME).write_text(json.dumps(doc, indent=1, sort_keys=True))


class WritableFiles(_MappedFiles):
    """Writable bit-pattern views over files made by `allocate`."""

    def __init__(self, directory: Path, files: list[str]) -> None:
        self._open(Path(directory), files, "r+")

    def prefault_many(self, names: list[str]) -> None:
        """Map these whole tensors for writing, one call per run of adjacent ones."""
        self._advise_many(names, MADV_POPULATE_WRITE)

    def prefault_view(self, view: np.ndarray) -> None:
        """Map the pages under `view`, a view `span` or `bits` gave, for writing in one call:
        no tensor looked up (a group's 50 names, a thousand groups a version). Without libc's
        madvise (`_MADVISE` None) it does nothing: the pages then fault in as they are
        written, as after a populate a kernel before 5.14 refuses."""
        if _MADVISE is None or not view.nbytes:
            return
        page = mmap.PAGESIZE
        at = view.__array_interface__["data"][0]
        lo = at // page * page
        _MADVISE(lo, -(-(at + view.nbytes) // page) * page - lo, MADV_POPULATE_WRITE)

    def prefault(self, name: str, lo: int = 0, hi: int | None = None) -> None:
        """Map elements lo..hi (default: all) of tensor `name` for writing, in one call."""
        slot = self.slots[name]
        size = lookup(slot.dtype).itemsize
        _advise(self._maps, slot, MADV_POPULATE_WRITE,
                None if (lo, hi) == (0, None) else (lo * size, (slot.end - slot.start)
                                                    if hi is None else hi * size))

    def flush(self, name: str | None = None) -> None:
        """msync to disk: the shard holding tensor `name`, or every shard."""
        files = [self.slots[name].file] if name is not None else list(self._maps)
        for f in files:
            if f in self._maps:
                self._maps[f].mm.flush()
