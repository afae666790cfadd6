"""A sharded rank's slices whose new bit patterns are on the host, encoded in one pass.

The single-process publisher finds and encodes a tensor's changes in one codec pass
(chain/writer.py): the codec compares old and new a segment (2^20 elements) at a time and hands
back the changed positions and values with the payload. A rank whose shard is on the host does
the same here, with two differences the format-3 stream needs: each changed segment becomes its
own record (`at`, `count`: the very records `shards.write_delta` makes when the changes were
found on a GPU), and the slice's digest part moves by its changed words keyed by the tensor's
word indices (a slice's own word indices are not the tensor's), computed on the thread that
encoded the segment while the segment is still in cache. Segments are queued across slices and
encoded BATCH_ELEMENTS at a time, as the publisher batches tensors, so both codec threads stay
busy through runs of small slices.
"""

from dataclasses import dataclass, field

import numpy as np

from chain import codec
from chain.codec.api import LOG2_SEG, THREADS
from chain.lanehash import fast_moved_words
from chain.shards import Placed, _interior_move, add_sums, word_span, write_segment
from chain.stream import BlockWriter
from chain.writer import BATCH_ELEMENTS


def _index(size: int) -> type:
    return np.int32 if size < 2**31 else np.int64


def _whole_words(arr: np.ndarray) -> np.ndarray | None:
    """`arr`'s whole 64-bit words as a uint64 view, or None when its start is not 8-aligned."""
    if arr.__array_interface__["data"][0] % 8:
        return None
    per = 8 // arr.itemsize
    return arr[: arr.size // per * per].view(np.uint8).view(np.uint64)


@dataclass
class SliceDelta:
    """What a queued slice's delta changes; complete once `HostDeltas.flush` has encoded the
    slice's last segment."""

    pos: np.ndarray | None = None
    """Changed local positions, sorted: int32 below 2^31 elements (kept until the version is
    signed, so 6 bytes a bf16 change rather than 10), else int64."""
    val: np.ndarray | None = None
    """Their new bit patterns."""
    move: tuple[int, int] = (0, 0)
    """How the slice's interior lane sums move (as `shards.interior_move` of the changes)."""
    written: int = 0
    """Payload bytes of its records."""
    _pos: list[np.ndarray] = field(default_factory=list)
    _val: list[np.ndarray] = field(default_factory=list)


@dataclass
class _Open:
    where: Placed
    old: np.ndarray
    new: np.ndarray
    out: SliceDelta


class HostDeltas:
    """Queues slices (old and new on the host) and writes their records to `writer` in the
    order they were added, BATCH_ELEMENTS at a time on `threads` codec threads; `flush`
    before writing anything else. `direct`: how positions are coded (chain.codec.api.DIRECT)."""

    def __init__(self, writer: BlockWriter, batch: int = BATCH_ELEMENTS,
                 threads: int = THREADS, direct: int = codec.DIRECT) -> None:
        self.writer, self.batch, self.threads, self.direct = writer, batch, threads, direct
        self._queue: list[tuple[_Open, int, int]] = []
        self._queued = 0

    def add(self, where: Placed, old: np.ndarray, new: np.ndarray) -> SliceDelta:
        if old.shape != new.shape or old.dtype != new.dtype:
            raise ValueError(f"{where.name}: old {old.dtype}{old.shape} and new "
                             f"{new.dtype}{new.shape} differ")
        sl = _Open(where, old, new, SliceDelta())
        if not old.size:
            self._finish(sl)
        seg = 1 << LOG2_SEG
        for s0 in range(0, old.size, seg):
            s1 = min(old.size, s0 + seg)
            self._queue.append((sl, s0, s1))
            self._queued += s1 - s0
            if self._queued >= self.batch:
                self.flush()
        return sl.out

    def flush(self) -> None:
        queue, self._queue, self._queued = self._queue, [], 0
        if not queue:
            return

        def moved(j: int, _lo: int, old: np.ndarray, new: np.ndarray, pos: np.ndarray,
                  val: np.ndarray) -> tuple[int, int]:
            sl, s0, s1 = queue[j]
            lo = sl.where.lo + s0  # the tensor's element at old[0]
            sh, w0, w1 = word_span(sl.where.lo, sl.old.size, old.itemsize)
            wa, wb = max(w0, -(-lo >> sh)), min(w1, (lo + s1 - s0) >> sh)  # wholly inside
            oldw, neww = _whole_words(old), _whole_words(new)
            if lo % (1 << sh) == 0 and oldw is not None and neww is not None:
                return fast_moved_words(oldw, neww, lo >> sh, pos, sh, wa, wb)
            return _interior_move(old, lo, pos, val, sh, 8 * old.itemsize, wa, wb)

        out = codec.encode_changes([(sl.old[s0:s1], sl.new[s0:s1], sl.where.dtype)
                                    for sl, s0, s1 in queue], self.threads, moved=moved,
                                   direct=self.direct)
        for (sl, s0, s1), (payload, ch) in zip(queue, out, strict=True):
            if ch.pos.size:
                r = sl.out
                r.written += write_segment(self.writer, sl.where, s0, s1, payload)
                r._pos.append(np.add(ch.pos, s0, dtype=_index(sl.old.size),
                                     casting="unsafe"))
                r._val.append(ch.val)
                r.move = add_sums(r.move, ch.digest)
            if s1 == sl.old.size:
                self._finish(sl)

    @staticmethod
    def _finish(sl: _Open) -> None:
        """Join the slice's changes and add the moves of the words that straddle two of its
        segments (only when the slice does not start on a word boundary): neither segment's
        job saw all of such a word."""
        r = sl.out
        if not r._pos:
            r.pos, r.val = np.empty(0, _index(sl.old.size)), np.empty(0, sl.old.dtype)
        else:
            r.pos = np.concatenate(r._pos) if len(r._pos) > 1 else r._pos[0]
            r.val = np.concatenate(r._val) if len(r._val) > 1 else r._val[0]
        r._pos, r._val = [], []
        lo, seg = sl.where.lo, 1 << LOG2_SEG
        sh, w0, w1 = word_span(lo, sl.old.size, sl.old.itemsize)
        if not lo % (1 << sh) or not r.pos.size:
            return
        for s0 in range(seg, sl.old.size, seg):
            w = (lo + s0) >> sh
            if w0 <= w < w1:
                j0, j1 = np.searchsorted(r.pos, [(w << sh) - lo, ((w + 1) << sh) - lo])
                r.move = add_sums(r.move, _interior_move(
                    sl.old, lo, r.pos[j0:j1].astype(np.int64), r.val[j0:j1], sh,
                    8 * sl.old.itemsize, w, w + 1))
