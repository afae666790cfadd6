"""Public entry points of the tensor delta codec: encode, apply in place, stats, batches.

Work is cut into segments of 2^20 elements; batches spread segments over two threads (the
kernels release the GIL). Each thread keeps a workspace that grows to the largest segment and is
reused, so a call allocates only its output and an exact-size scratch for the decoded changes.
Guarantee on refusal: `apply_*` raises BadDelta before writing anything to any target.
"""

import functools
import itertools
import os
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from chain import lanehash
from chain.codec import header as hdr
from chain.codec import kernels
from chain.codec.aot import bind
from chain.codec.kernels import ERR_COUNT, ERR_GAP, ERR_STREAM, ERR_VALUE, model_size
from chain.errors import BadDelta

T = TypeVar("T")
R = TypeVar("R")

LOG2_SEG = 20
DIRECT = -1
"""A segment codes its positions directly (decoded in O(changes), with no pass over the old
segment) when that takes at most this many percent more bits than coding them as ranks within
their contexts (mode CODED_POS); -1: ranks always (mode CODED, which every build reads). On
Adam-like bf16 updates at 1 % density direct positions cost 1.38x the bytes and a region decodes
them in 0.55x the time (bench/positions.py at 1B); on changes spread evenly over contexts they
cost the same (docs/MEASURED.md)."""
THREADS = 2
_PARALLEL_MIN = 1 << 18
_CHANGE_COST = 30  # decoding one change takes about as long as stepping 30 elements
_ERRORS = {ERR_STREAM: "its stream is truncated or malformed",
           ERR_COUNT: "its change counts do not fit the target",
           ERR_VALUE: "it holds a non-canonical value",
           ERR_GAP: "its positions run past the target"}


class _Workspace:
    """Per-thread buffers, grown on demand and kept."""

    def __init__(self) -> None:
        self.models = np.empty(model_size(256, 64), np.int32)
        self.hist = np.empty(4 * 256, np.int64)  # one quarter per lane of a 64-bit word
        self.ctx = [np.empty(256, np.int64) for _ in range(5)]
        self.chg = [np.empty(0, np.int64) for _ in range(5)]
        self.out = [np.empty(0, np.uint8) for _ in range(hdr.STREAMS)]
        self.keep = np.empty(0, np.int64)
        self.seg = np.empty(0, np.uint8)
        self.vals = np.empty(0, np.uint8)

    def values(self, n: int, dtype: np.dtype) -> np.ndarray:
        """`n` elements of `dtype`: a segment's changed new values (encode_pieces)."""
        self.vals, out = _typed(self.vals, n, dtype)
        return out

    def changes(self, n: int) -> list[np.ndarray]:
        if self.chg[0].size < n:
            self.chg = [np.empty(max(n, 2 * self.chg[0].size), np.int64) for _ in range(5)]
        return self.chg

    def kept(self, n: int) -> np.ndarray:
        if self.keep.size < n:
            self.keep = np.empty(max(n, 2 * self.keep.size), np.int64)
        return self.keep

    def segment(self, n: int, dtype: np.dtype) -> np.ndarray:
        """A buffer of `n` elements of `dtype` (a segment's old elements, overlaid)."""
        self.seg, out = _typed(self.seg, n, dtype)
        return out

    def outbufs(self, n: int) -> list[np.ndarray]:
        if self.out[0].size < n:
            self.out = [np.empty(max(n, 2 * self.out[0].size), np.uint8)
                        for _ in range(hdr.STREAMS)]
        return [o[:n] for o in self.out]


def _typed(buf: np.ndarray, n: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """`buf` (bytes, kept) grown to hold `n` elements of `dtype` where it is short, and a
    view of its first `n` as that dtype."""
    nbytes = n * np.dtype(dtype).itemsize
    if buf.size < nbytes:
        buf = np.empty(max(nbytes, 2 * buf.size), np.uint8)
    return buf, buf[:nbytes].view(dtype)


_NO_KEEP = np.empty(0, np.int64)
# The kernels compiled at install when present, else numba's JIT (chain/codec/aot.py).
encode_segment = bind(kernels.encode_segment, "encode_segment")
encode_pieces = bind(kernels.encode_pieces, "encode_pieces")
decode_segment = bind(kernels.decode_segment, "decode_segment")
scatter = bind(kernels.scatter, "scatter")
scatter_from = bind(kernels.scatter_from, "scatter_from")
_merge_sorted = bind(kernels.merge_sorted, "merge_sorted")
_local = threading.local()
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _ws() -> _Workspace:
    ws = getattr(_local, "ws", None)
    if ws is None:
        ws = _local.ws = _Workspace()
    return ws


def usable_cpus() -> int:
    """CPUs this thread may run on: a process pinned to one core (vLLM's CPU worker on a
    2-core host, a service with CPUAffinity=) gains nothing from a second thread."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def run_jobs(jobs: list[tuple[int, Callable[[], None]]], threads: int = THREADS) -> None:
    """Run (weight, job) pairs, heaviest first, on `threads` workers that each take the next
    job when done with one: the weights only order the work, so a segment that turns out
    cheaper or dearer than its weight says does not leave a thread idle."""
    start_jobs(jobs, threads)()


def run_scatters(writes: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]],
                 threads: int = THREADS) -> None:
    """Each (target, positions, values): the values written at those positions of the flat
    `target`, the largest first over the codec's threads (run_jobs); numpy checks the
    bounds. How a kept copy takes a version's changes: a publisher's (chain.sources) and a
    sharded rank's (trainer.rank_encoder). numpy writes a fancy index without the GIL, so
    two threads write at once; gathered into one scatter first, a version at 1 % of 1e9
    elements spent ~0.1 s more on one thread joining every position."""
    run_jobs([(pos.size, functools.partial(_scatter, target, pos, val))
              for target, pos, val in writes if pos.size], threads)


def _scatter(target: np.ndarray, pos: np.ndarray, val: np.ndarray) -> None:
    target[pos] = val


def start_jobs(jobs: list[tuple[int, Callable[[], None]]], threads: int = THREADS
               ) -> Callable[[], None]:
    """`run_jobs` begun on the codec's worker threads only, returning at once; the calling
    thread joins in, taking the jobs left, when it calls the result, which returns once every
    job has ended (raising the first error). Meanwhile the caller may do other work (a
    writer readying its next batch): a worker takes the GIL only for the Python around a
    job's kernels (chain/gilswitch.py shortens its waits for it). With one thread usable,
    or little work, the jobs all run in the join."""
    global _pool
    total = sum(w for w, _ in jobs)
    ordered = [job for _, job in sorted(jobs, key=lambda j: -j[0])]
    threads = min(threads, usable_cpus())
    shared = iter(ordered)  # next() on a list iterator is atomic under the GIL
    futures = []
    if threads >= 2 and len(jobs) >= 2 and total >= _PARALLEL_MIN:
        with _pool_lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(max_workers=THREADS - 1, thread_name_prefix="codec")
        futures = [_pool.submit(_run_all, shared) for _ in range(min(threads, THREADS) - 1)]

    def join() -> None:
        error: BaseException | None = None
        try:
            _run_all(shared)
        except BaseException as e:
            error = e
        # every job has ended before this returns or raises: a caller handling the error
        # must not race a worker still writing (an engine reloading while a patch job runs).
        # A worker's share not begun yet (the worker busy with jobs started earlier) has no
        # job left to take: withdrawn, not waited for
        for f in futures:
            if f.cancel():
                continue
            try:
                f.result()
            except BaseException as e:
                error = error or e
        if error is not None:
            raise error
    return join


def map_jobs(fn: Callable[[T], R], items: Sequence[T], weight: Callable[[T], int],
             threads: int = THREADS) -> list[R]:
    """[fn(x) for x in items], spread over the codec's threads as `run_jobs` does (`weight`
    orders them, heaviest first): for work whose kernels release the GIL."""
    out: list = [None] * len(items)

    def job(i: int, x: T) -> Callable[[], None]:
        def run() -> None:
            out[i] = fn(x)
        return run

    run_jobs([(weight(x), job(i, x)) for i, x in enumerate(items)], threads)
    return out


_LIGHT = 1 << 12
"""Segments lighter than this (in elements, plus changes) are coded on the calling thread
alone: their time is mostly Python, and two threads taking turns at the GIL around each short
kernel call ran them 1.3-1.8x slower than one (50,000 tensors of 960 elements)."""
_GROUP = 1 << 18
"""Heavier segments up to this weight share jobs of about this weight (one job, one kernel
lookup, for many 20,000-element tensors), spread over the codec's threads."""


def _run_grouped(segments: list[tuple[int, tuple]],
                 make: Callable[[list[tuple]], Callable[[], None]], threads: int) -> None:
    """Run `segments` (weight, spec) through jobs `make(specs)`: see _LIGHT and _GROUP."""
    _start_grouped(segments, make, threads)()


def _start_grouped(segments: list[tuple[int, tuple]],
                   make: Callable[[list[tuple]], Callable[[], None]], threads: int
                   ) -> Callable[[], None]:
    """`_run_grouped` begun as `start_jobs` begins jobs: the light segments run in the join."""
    jobs = [(w, make([spec])) for w, spec in segments if w >= _GROUP]
    group: list[tuple] = []
    weight = 0
    for w, spec in segments:
        if _LIGHT <= w < _GROUP:
            group.append(spec)
            weight += w
            if weight >= _GROUP:
                jobs.append((weight, make(group)))
                group, weight = [], 0
    if group:
        jobs.append((weight, make(group)))
    heavy = start_jobs(jobs, threads)

    def join() -> None:
        heavy()
        light = [spec for w, spec in segments if w < _LIGHT]
        for at in range(0, len(light), 256):
            make(light[at:at + 256])()
    return join


def _run_all(jobs) -> None:
    for job in jobs:
        job()


@dataclass
class Changes:
    """What a delta changes in one tensor: sorted absolute element positions, their new bit
    patterns, and (from the encoder, which sees both sides) how the tensor digest moves."""

    pos: np.ndarray
    val: np.ndarray
    digest: tuple[int, int] | None = None

    @classmethod
    def none(cls, uint: np.dtype) -> "Changes":
        return cls(np.empty(0, np.int64), np.empty(0, uint), (0, 0))


def _check_pair(old: np.ndarray, new: np.ndarray, dtype: str) -> hdr.Coding:
    c = hdr.coding(dtype)
    for name, a in (("old", old), ("new", new)):
        if a.ndim != 1 or a.dtype != c.dtype.uint:
            raise ValueError(f"{name} must be a flat {c.dtype.uint} view of {dtype} bits, "
                             f"got {a.dtype} with shape {a.shape}")
    if old.shape != new.shape:
        raise ValueError(f"old has {old.size} elements, new has {new.size}")
    return c


def merge_changes(earlier: Changes, later: Changes) -> Changes:
    """Two versions' changes of one tensor as one set (positions ascending, the later value
    where both change an element), in one linear walk; no digest move."""
    pos = np.empty(earlier.pos.size + later.pos.size, np.int64)
    val = np.empty(pos.size, later.val.dtype)
    n = _merge_sorted(np.ascontiguousarray(earlier.pos, np.int64),
                      np.ascontiguousarray(earlier.val, later.val.dtype),
                      np.ascontiguousarray(later.pos, np.int64), np.ascontiguousarray(later.val),
                      pos, val)
    return Changes(pos[:n], val[:n])


def split_changes(changes: Changes, offsets: np.ndarray,
                  moves: np.ndarray | None = None) -> list[Changes]:
    """A group record's changes (positions in its tensors' elements end to end, member j
    from offsets[j] to offsets[j + 1]) as each member's, in its own positions: one array
    operation for the whole group, each member's arrays views of it. `moves`: the members'
    digest moves, (members, 2) lane sums (lanehash.moved_by_groups)."""
    own, cuts = own_positions(changes.pos, offsets)
    moved = moves.tolist() if moves is not None else None
    return [Changes(own[a:b], changes.val[a:b], None if moved is None else
                    (moved[j][0], moved[j][1]))
            for j, (a, b) in enumerate(itertools.pairwise(cuts))]


def split_positions(pos: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    """`split_changes`' positions alone (what a region's CHANGES file keeps a tensor): no
    values cut and no Changes made, a third of the time at 50,000 members."""
    own, cuts = own_positions(pos, offsets)
    return [own[a:b] for a, b in itertools.pairwise(cuts)]


def own_positions(pos: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Group positions as each member's own, end to end, and where each member's begin
    (members + 1 cuts): what a region's CHANGES keeps of a group, uncut."""
    cuts = np.searchsorted(pos, offsets)
    return pos - np.repeat(offsets[:-1], np.diff(cuts)), cuts.tolist()


def encode_many(pairs: Sequence[tuple[np.ndarray, np.ndarray, str]],
                threads: int = THREADS) -> list[bytes]:
    """Payloads for several (old, new, dtype) tensors, segments spread over `threads`."""
    return [p for p, _ in encode_changes(pairs, threads, changes=False)]


Moved = Callable[[int, int, np.ndarray, np.ndarray, np.ndarray, np.ndarray], tuple[int, int]]
"""How one segment's changes move a digest: (pair index, segment start, old, new, pos, val)
-> lane sums, where `pos` (sorted) and `val` are the segment's changes indexing the pair's
`old` and `new`. One that also has a `pieces(pair, first, moves) -> bool` method is first
offered, for a `Pieces` pair, the moves of each piece's own digest as the encoder found them
in its scan (`moves`: (pieces, 2) lane sums of pieces first, first + 1, ...), wherever the
encoder could find them all (see kernels._find_rank_pieces); it is called only if the offer
is declined."""


def moved_alone(i: int, lo: int, old: np.ndarray, new: "np.ndarray | Pieces",
                pos: np.ndarray, val: np.ndarray) -> tuple[int, int]:
    """The default `Moved`: a segment's move of its own pair's digest."""
    if isinstance(new, Pieces):  # the new values at pos are `val`
        return lanehash.moved_by_changes(old, pos, val)
    return lanehash.moved_between(old, new, pos)


class Pieces:
    """A pair's new elements where they lie, in pieces, read in place by the encoder: piece
    j holds elements [starts[j], starts[j + 1]) at address addrs[j] (a group's member tensors
    in the trainer's state dict; `hold` keeps those objects, not the memory they point at,
    alive: re-pointing one while the encode runs frees what is being read). Laying 50,000
    small tensors end to end first cost a publish a 2 GB copy, ~0.2 s of its 1.4 s on this
    host; read where they are, the encoder's one pass over them is the only one. `whole()`:
    the elements end to end, for a payload sent raw. The caller vouches that each address
    holds its piece's count of elements of the pair's width, contiguous, while the encode
    runs: a wrong one reads the wrong memory (StateDictSource.pieces checks CPU, contiguous,
    size and element size)."""

    __slots__ = ("addrs", "hold", "starts", "whole")

    def __init__(self, addrs: np.ndarray, starts: np.ndarray,
                 whole: Callable[[], np.ndarray], hold: object = None) -> None:
        self.addrs = np.ascontiguousarray(addrs, np.int64)
        self.starts = np.ascontiguousarray(starts, np.int64)
        self.whole = whole
        self.hold = hold
        if self.starts.size != self.addrs.size + 1 or self.starts[0] != 0 or \
                np.any(np.diff(self.starts) < 0):
            raise ValueError("Pieces need one start per address and one more, rising from 0")
        if np.any((self.addrs == 0) & (np.diff(self.starts) > 0)):
            raise ValueError("a piece with elements has no address")

    @property
    def size(self) -> int:
        return int(self.starts[-1])

    def tobytes(self) -> bytes:
        return np.ascontiguousarray(self.whole()).tobytes()


def encode_changes(pairs: Sequence[tuple[np.ndarray, "np.ndarray | Pieces", str]],
                   threads: int = THREADS, changes: bool = True, moved: Moved | None = None,
                   direct: int = DIRECT) -> list[tuple[bytes, Changes | None]]:
    """`encode_many` that also returns each tensor's Changes (positions, new values, digest
    move), found in the same pass: O(changes) extra work and memory. The digest move is
    summed over segments, each computed by `moved` on the thread that encoded it, while the
    segment is still in cache (default: the pair's own digest; chain/shards.py passes the
    move of a slice keyed by its tensor's word indices). `direct`: see DIRECT. A pair's new
    side may be `Pieces`, read where they lie."""
    return start_encode(pairs, threads, changes, moved, direct)()


def start_encode(pairs: Sequence[tuple[np.ndarray, "np.ndarray | Pieces", str]],
                 threads: int = THREADS, changes: bool = True, moved: Moved | None = None,
                 direct: int = DIRECT
                 ) -> Callable[[], list[tuple[bytes, Changes | None]]]:
    """`encode_changes` begun on the codec's worker threads (`start_jobs`); calling the
    result joins in and returns what encode_changes returns. The pairs' arrays must stay
    as they are until then."""
    seg = 1 << LOG2_SEG
    plans = []
    jobs = []
    for old, new, dtype in pairs:
        if isinstance(new, Pieces) and not _LITTLE:  # the word scan's lanes are little-endian
            new = np.ascontiguousarray(new.whole())
        if isinstance(new, Pieces):
            c = _check_pair(old, old, dtype)  # old's checks; the pieces' are their size here
            if new.size != old.size:
                raise ValueError(f"old has {old.size} elements, new has {new.size}")
            old = np.ascontiguousarray(old)
            n, words = old.size, False
        else:
            c = _check_pair(old, new, dtype)
            old, new = np.ascontiguousarray(old), np.ascontiguousarray(new)
            n, words = old.size, _words(old, new)
        parts: list = [None] * ((n + seg - 1) // seg)
        found: list = [None] * len(parts) if changes else []
        plans.append((old, new, dtype, c, parts, found))
        for s in range(len(parts)):
            lo, hi = s * seg, min(n, (s + 1) * seg)
            jobs.append((hi - lo, (old, new, lo, hi, words, c, parts, s, found,
                                   moved or moved_alone, len(plans) - 1, direct)))
    joined = _start_grouped(jobs, _encode_job, threads)
    mode = hdr.CODED_POS if direct >= 0 else hdr.CODED

    def join() -> list[tuple[bytes, Changes | None]]:
        joined()
        return [(_assemble(old, new, dtype, c, parts, mode),
                 _gathered(found, c) if changes else None)
                for old, new, dtype, c, parts, found in plans]
    return join


def _gathered(found: list, c: hdr.Coding) -> Changes:
    if not found:
        return Changes.none(c.dtype.uint)
    a = b = 0
    for f in found:
        a, b = a + int(f[2][0]), b + int(f[2][1])
    if len(found) == 1:  # one segment: its arrays as they are
        return Changes(found[0][0], found[0][1], (a & lanehash.M64, b & lanehash.M64))
    return Changes(np.concatenate([f[0] for f in found]), np.concatenate([f[1] for f in found]),
                   (a & lanehash.M64, b & lanehash.M64))


def _words(*arrays: np.ndarray) -> bool:
    """Whether the kernels may read 2-byte elements four at a time as 64-bit words.
    (`__array_interface__`, not `.ctypes`: the latter costs tens of microseconds a call.)"""
    return arrays[0].itemsize == 2 and _LITTLE and \
        all(not a.__array_interface__["data"][0] % 8 for a in arrays)


_LITTLE = sys.byteorder == "little"


def _encode_job(specs: list[tuple]) -> Callable[[], None]:
    def job() -> None:
        ws = _ws()
        variants: dict = {}
        for spec in specs:
            _encode_segment(ws, variants, *spec)
    return job


def _encode_segment(ws: _Workspace, variants: dict, old, new, lo, hi, words: bool,
                    c: hdr.Coding, parts: list, s: int, found: list, moved: Moved, pair: int,
                    direct: int) -> None:
    """Encode segment `s` of one pair into `parts[s]` (and its changes into `found[s]`).
    `variants`: the compiled encoder by element type, looked up once per job."""
    raw = (hi - lo) * c.dtype.itemsize + 64
    keep = ws.kept(hi - lo + 1) if found else _NO_KEEP
    common = (c.shift, c.cmask, c.nctx, c.dtype.bits, c.is_float, ws.models, ws.hist,
              *ws.ctx[:3], *ws.changes(hi - lo + 1), *ws.outbufs(raw), keep, direct)
    placed = isinstance(new, Pieces)
    if placed:
        vals = ws.values(hi - lo + 1, old.dtype)
        first = int(np.searchsorted(new.starts, lo, side="right")) - 1
        touched = int(np.searchsorted(new.starts, hi, side="left")) - first
        moves = np.zeros(2 * touched + 1, np.uint64)
        args = (old, new.addrs, new.starts, lo, hi, *common, vals, moves)
    else:
        args = (old, new, lo, hi, words, *common)
    fn = variants.get((old.dtype, placed))
    if fn is None:
        fn = variants[(old.dtype, placed)] = (encode_pieces if placed
                                               else encode_segment).variant(args)
    k, *lens, hsh = fn(*args)
    if found:
        pos = keep[:k] + lo
        if placed:
            val = vals[:k].copy()
        elif k < 1024:  # numpy's gather costs less than a kernel call for a few changes
            val = new[pos]
        else:
            val = np.empty(k, old.dtype)
            lanehash.fast_gather(new, pos, val)
        by_piece = getattr(moved, "pieces", None) if placed and moves[-1] == 0 else None
        if by_piece is not None and by_piece(pair, first, moves[:-1].reshape(-1, 2)):
            found[s] = (pos, val, (0, 0))
        else:
            found[s] = (pos, val, moved(pair, lo, old, new, pos, val))
    if k == 0:
        parts[s] = (0, [b""] * hdr.STREAMS, 0)
    elif max(lens) <= raw:
        parts[s] = (k, [o[:n].tobytes() for o, n in zip(ws.out, lens, strict=True)],
                    int(hsh))
    else:
        parts[s] = (k, None, 0)


def _assemble(old, new, dtype: str, c: hdr.Coding, parts: list, mode: int) -> bytes:
    n = old.size
    if len(parts) == 1:  # most tensors of a MoE model: one segment
        k, streams, hsh = parts[0]
        if k == 0:
            return hdr.pack(hdr.NONE, dtype, n, 0, [])
        if streams is None or sum(map(len, streams)) >= n * c.dtype.itemsize:
            return hdr.pack(hdr.RAW, dtype, n, k, [new.tobytes()])
        return hdr.pack(mode, dtype, n, k, streams, LOG2_SEG, [k], hsh & 0xFFFFFFFF)
    k = sum(p[0] for p in parts)
    if k == 0:
        return hdr.pack(hdr.NONE, dtype, n, 0, [])
    raw_size = n * c.dtype.itemsize
    if any(p[1] is None for p in parts) or \
            sum(len(b) for p in parts for b in p[1]) >= raw_size:
        return hdr.pack(hdr.RAW, dtype, n, k, [new.tobytes()])
    streams = [b for p in parts for b in p[1]]
    return hdr.pack(mode, dtype, n, k, streams, LOG2_SEG, [p[0] for p in parts],
                    _combine(p[2] for p in parts if p[0]))


def _combine(hashes) -> int:
    total = 0
    for h in hashes:
        total ^= h
    return total & 0xFFFFFFFF


def encode_tensor_delta(old: np.ndarray, new: np.ndarray, dtype: str) -> bytes:
    """The payload that turns `old` into `new` (flat unsigned views of `dtype` bit patterns)."""
    return encode_many([(old, new, dtype)])[0]


Layers = Sequence[tuple[np.ndarray, np.ndarray]]
"""Changes to lay over a decode's base first, in order: (sorted int64 positions, values)."""


def _decode_all(items: Sequence[tuple[np.ndarray, bytes | memoryview, str]], threads: int,
                write: bool, moves: bool = False, overlays: Sequence[Layers] | None = None
                ) -> list:
    return _start_decode_all(items, threads, write, moves, overlays)()


def _start_decode_all(items: Sequence[tuple[np.ndarray, bytes | memoryview, str]],
                      threads: int, write: bool, moves: bool = False,
                      overlays: Sequence[Layers] | None = None) -> Callable[[], list]:
    """`_decode_all` begun on the codec's worker threads (`_start_grouped`): every payload's
    header is checked now, its heavier segments decoded in the workers, its light ones
    (under _LIGHT) in the caller's join, which then checks their errors and hashes."""
    decoded = []
    segments: list[tuple] = []
    for t, (target, payload, dtype) in enumerate(items):
        plan = _plan_apply(t, target, payload, dtype, segments, write, moves,
                           overlays[t] if overlays else ())
        if plan is not None:
            decoded.append(plan)
    joined = _start_grouped(segments, _decode_job, threads)

    def join() -> list:
        joined()
        for t, errs, _, kind, _, want, _ in decoded:
            bad = [e[0] for e in errs if e[0]]
            if bad:
                raise BadDelta(f"tensor delta #{t} does not decode against its base: "
                               f"{_ERRORS.get(bad[0], 'unknown error')}")
            if kind != hdr.RAW and _combine(e[1] for e in errs) != want:
                raise BadDelta(f"tensor delta #{t} decodes to a result whose hash does not "
                               "match the payload's: wrong base tensor, or a forged payload")
        return decoded
    return join


def decode_many(items: Sequence[tuple[np.ndarray, bytes | memoryview, str]],
                threads: int = THREADS, moves: bool = False,
                overlays: Sequence[Layers] | None = None) -> list[Changes]:
    """The Changes each (base, payload, dtype) makes, decoded against `base` without writing
    it (it may be a read-only map of the current version). BadDelta as for apply_many.
    `moves`: each Changes also carries how `base`'s digest moves (chain.lanehash, word 0 of
    `base` as word 0), computed by the thread that decoded each segment while the segment
    is still in cache: a separate pass afterwards misses the cache at every change.
    `overlays[i]`: changes that bring items[i]'s base forward first (a region decoding a
    version its disk has not caught up to). Each segment is copied into its thread's buffer
    and overlaid there, so the base is never copied whole: a fresh copy of every tensor,
    overlaid in one thread, cost a third of the decode at 1B."""
    return start_decode(items, threads, moves, overlays)()


def start_decode(items: Sequence[tuple[np.ndarray, bytes | memoryview, str]],
                 threads: int = THREADS, moves: bool = False,
                 overlays: Sequence[Layers] | None = None) -> Callable[[], list[Changes]]:
    """`decode_many` begun on the codec's worker threads (`start_jobs`); calling the result
    joins in and returns what decode_many returns (or raises its BadDelta). The caller may
    do other work meanwhile (a region's fill checks and journals the batch before); the
    bases and payloads must stay as they are until the join."""
    out = [Changes.none(hdr.coding(dtype).dtype.uint) for _, _, dtype in items]
    started = _start_decode_all(items, threads, write=False, moves=moves, overlays=overlays)

    def join() -> list[Changes]:
        for t, errs, base, kind, data, _, at in started():
            if kind == hdr.RAW:
                base = overlaid(base, overlays[t] if overlays else ())
                pos = np.flatnonzero(base != data).astype(np.int64)
                out[t] = Changes(pos, data[pos], lanehash.moved_by_changes(base, pos, data[pos])
                                 if moves else None)
            else:
                digest = None
                if moves:
                    ma = mb = 0
                    for e in errs:
                        ma, mb = ma + e[2], mb + e[3]
                    digest = (ma & lanehash.M64, mb & lanehash.M64)
                # the jobs wrote each segment's positions into `at` (the tensor's, as int64) and
                # its values one after the other: no serial concatenation after the threads (a
                # coded payload has changes, header.parse refuses k = 0, so `data` is never empty)
                out[t] = Changes(at, data[0][2], digest)
        return out
    return join


def overlaid(base: np.ndarray, layers: Layers) -> np.ndarray:
    """`base` with `layers` written over it, in a copy (or `base` itself if none)."""
    if not len(layers):
        return base
    out = base.copy()
    for pos, val in layers:
        out[pos] = val
    return out


def apply_many(items: Sequence[tuple[np.ndarray, bytes | memoryview, str]],
               threads: int = THREADS) -> None:
    """Patch several targets in place. Every payload is decoded and checked first; on any
    BadDelta no target has been written."""
    decoded = _decode_all(items, threads, write=True)
    scat = []
    for _, _, target, kind, data, _, _ in decoded:
        if kind == hdr.RAW:
            scat.append((target.size, _raw_job(target, data)))
        else:
            for lo, pos, val, a, b in data:
                scat.append((b - a, _scatter_job(target, lo, pos, val, a, b)))
    run_jobs(scat, threads)


def _raw_job(target: np.ndarray, data: np.ndarray) -> Callable[[], None]:
    def job() -> None:
        target[:] = data
    return job


def _scatter_job(target, lo, pos, val, a, b) -> Callable[[], None]:
    def job() -> None:
        scatter(target, lo, pos, val, a, b)
    return job


def _plan_apply(t: int, target: np.ndarray, payload, dtype: str, jobs: list, write: bool,
                moves: bool = False, layers: Layers = ()):
    c = hdr.coding(dtype)
    if target.ndim != 1 or target.dtype != c.dtype.uint or not target.flags.c_contiguous \
            or (write and not target.flags.writeable):
        raise BadDelta(f"tensor delta #{t}: target must be a writable flat contiguous "
                       f"{c.dtype.uint} array, got {target.dtype} shape {target.shape}")
    h = hdr.parse(payload)
    if h.dtype != dtype:
        raise BadDelta(f"tensor delta #{t} is for {h.dtype}, the tensor is {dtype}")
    if h.n != target.size:
        raise BadDelta(f"tensor delta #{t} is for {h.n} elements, the tensor has {target.size}")
    buf = np.frombuffer(payload, np.uint8)
    if h.mode == hdr.NONE:
        return None
    if h.mode == hdr.RAW:
        data = buf[h.body_start:h.body_end].view(c.dtype.uint)
        return t, [], target, hdr.RAW, data, 0, None
    seg, words = 1 << h.log2_seg, _words(target)
    # where each segment's changes begin in each overlay layer, found once per tensor; the
    # compiled scatter checks no bounds, so a layer must lie inside the tensor
    for lpos, lval in layers:
        if lpos.size != lval.size or (lpos.size and (lpos[0] < 0 or lpos[-1] >= h.n)):
            raise BadDelta(f"tensor delta #{t}: an overlay of {lpos.size} positions does not "
                           f"fit its {h.n} elements")
    cuts = [np.searchsorted(lpos, np.arange(0, h.n + seg, seg, dtype=np.int64))
            for lpos, _ in layers] if layers else []
    pos = np.empty(h.k, np.int32)
    val = np.empty(h.k, c.dtype.uint)
    at = None if write else np.empty(h.k, np.int64)  # decode_many's: each segment's job
    # writes its positions there as the tensor's own
    errs = [(0, 0, 0, 0)] * len(h.seg_k)
    segs = []
    start, base = h.body_start, 0
    for s, (ks, lens) in enumerate(zip(h.seg_k, h.seg_len, strict=True)):
        lo, hi = s * seg, min(h.n, (s + 1) * seg)
        bounds = [start]
        for n in lens:
            bounds.append(bounds[-1] + n)
        if ks:
            over = [(lpos, lval, int(cut[s]), int(cut[s + 1]))
                    for (lpos, lval), cut in zip(layers, cuts, strict=True)
                    if cut[s + 1] > cut[s]]  # a segment no layer touches is read in place
            jobs.append((hi - lo + _CHANGE_COST * ks,
                         (target, lo, hi, words, buf, bounds, ks, c, pos, val, base, errs, s,
                          moves, over, at, h.mode == hdr.CODED_POS)))
            segs.append((lo, pos, val, base, base + ks))
        elif sum(lens):
            errs[s] = (ERR_STREAM, 0, 0, 0)
        start = bounds[-1]
        base += ks
    return t, errs, target, hdr.CODED, segs, h.result, at




def _decode_job(specs: list[tuple]) -> Callable[[], None]:
    def job() -> None:
        ws = _ws()
        variants: dict = {}
        for spec in specs:
            _decode_segment(ws, variants, *spec)
    return job


def _decode_segment(ws: _Workspace, variants: dict, target, lo, hi, words, buf, bounds, ks,
                    c: hdr.Coding, pos, val, base, errs, s, moves: bool,
                    over: list[tuple[np.ndarray, np.ndarray, int, int]],
                    at: np.ndarray | None, flagged: bool) -> None:
    """Decode segment `s` of one tensor into `pos`/`val` from `base` on, its error, hash and
    (with `moves`) digest move into `errs[s]`. `variants`: the compiled decoder by element
    type, looked up once per job (every other argument's type is fixed)."""
    old, toff = target, 0
    if over:  # the segment's old elements, brought forward in this thread's buffer
        old, toff = ws.segment(hi - lo, target.dtype), lo
        old[:] = target[lo:hi]
        for lpos, lval, a, b in over:  # this segment's share of each layer, in order
            scatter_from(old, lpos, lval, lo, a, b)
        words = words and _words(old)
    args = (old, lo, hi, words, buf, *bounds, ks, c.shift, c.cmask, c.nctx, c.dtype.bits,
            c.is_float, ws.models, *ws.ctx[:5], *ws.changes(ks + c.nctx)[:2], pos, val, base,
            toff, flagged)
    fn = variants.get(old.dtype)
    if fn is None:
        fn = variants[old.dtype] = decode_segment.variant(args)
    err, hsh = fn(*args)
    ma = mb = 0
    if at is not None and not err:  # the tensor's positions, made here while in cache
        mine = at[base:base + ks]
        np.add(pos[base:base + ks], np.int64(lo), out=mine)
        if moves and old is not target:  # scratch: writing the changes there is cheaper
            ma, mb, _ = lanehash.moved_by_put_at(old, mine, val[base:base + ks], toff)
        elif moves:
            ma, mb = lanehash.moved_by_changes(target, mine, val[base:base + ks])
    errs[s] = (int(err), int(hsh), int(ma), int(mb))


def apply_tensor_delta(target: np.ndarray, payload: bytes | memoryview, dtype: str) -> None:
    """Patch `target` (old bits, flat unsigned view) in place into the new bits."""
    apply_many([(target, payload, dtype)])


def payload_stats(payload: bytes | memoryview) -> dict:
    """Sizes of a payload's parts, read from its header (no base tensor needed)."""
    h = hdr.parse(payload)
    nbytes = len(memoryview(payload).cast("B"))
    body_bits = 8 * (h.body_end - h.body_start)
    pos_bits = 8 * sum(lens[0] + lens[1] for lens in h.seg_len)  # table and gaps
    buf = memoryview(payload).cast("B")
    direct, at = 0, h.body_start
    for lens in h.seg_len:  # CODED_POS: a segment's gap stream starts with its mode bit
        if h.mode == hdr.CODED_POS and lens[1]:
            direct += buf[at + lens[0]] & 1
        at += sum(lens)
    return {
        "dtype": h.dtype,
        "mode": {hdr.NONE: "unchanged", hdr.CODED: "coded", hdr.CODED_POS: "coded",
                 hdr.RAW: "raw"}[h.mode],
        "changed": h.k,
        "total": h.n,
        "density": h.k / h.n if h.n else 0.0,
        "nbytes": nbytes,
        "bits_header": 8 * nbytes - body_bits,
        "bits_positions": pos_bits if h.mode in hdr.CODED_MODES else 0,
        "bits_values": body_bits - pos_bits if h.mode in hdr.CODED_MODES else body_bits,
        "bits_per_changed": 8 * nbytes / h.k if h.k else 0.0,
        "segments": len(h.seg_len),
        "direct_segments": direct,
    }
