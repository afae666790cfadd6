"""The byte layout around a tensor delta's coded streams, and its strict parser.

    0xD5 | format<<4 | mode | dtype code | varint n | varint k
    mode CODED or CODED_POS: log2(segment) | 4-byte result hash
                | per segment: [varint k, if more than one segment] and the varint lengths of
                  its four streams (context table, gaps, step sizes, signs and exceptions)
    body (the streams, or the raw new bits in mode RAW) | 4-byte xxh3-64 of all before it

Every count is checked against the target before any decoding starts. The checksum catches
damaged bytes; the result hash (over the changed positions and their new values, computed while
decoding) catches a payload applied to the wrong base or a forged stream.
"""

from dataclasses import dataclass, field
from functools import cache

import numpy as np
import xxhash

from chain.dtypes import DType, lookup
from chain.errors import BadDelta

MAGIC = 0xD5
FORMAT = 2
STREAMS = 4  # per segment, in this order: table, gaps, steps, signs (see kernels.py)
NONE, CODED, RAW, CODED_POS = 0, 1, 2, 3
CODED_MODES = (CODED, CODED_POS)
"""CODED_POS: each segment's gap stream starts with a bit saying whether its positions are
coded as ranks within their contexts (as in CODED) or directly (chain/codec/kernels.py)."""
CHECK = 4
LOG2_SEG_MIN, LOG2_SEG_MAX = 8, 26
DTYPE_CODES = ["bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2",
               "int8", "uint8", "int16", "int32", "int64", "bool"]
_CODE = {name: i for i, name in enumerate(DTYPE_CODES)}


@dataclass(frozen=True)
class Coding:
    """How elements of one dtype are coded: context = (bits >> shift) & cmask."""

    dtype: DType
    shift: int
    cmask: int
    is_float: bool

    @property
    def nctx(self) -> int:
        return self.cmask + 1


@cache
def coding(dtype: str) -> Coding:
    dt = lookup(dtype)
    if dt.exponent_bits:
        extra = max(0, dt.exponent_bits - 8)
        return Coding(dt, dt.mantissa_bits + extra, (1 << min(dt.exponent_bits, 8)) - 1, True)
    return Coding(dt, max(0, dt.bits - 8), 0xFF, False)


@dataclass
class Header:
    mode: int
    dtype: str
    n: int
    k: int
    log2_seg: int = 0
    result: int = 0
    seg_k: list[int] = field(default_factory=list)
    seg_len: list[tuple[int, ...]] = field(default_factory=list)
    body_start: int = 0
    body_end: int = 0


def put_varint(out: bytearray, v: int) -> None:
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)


def pack(mode: int, dtype: str, n: int, k: int, body: list[bytes], log2_seg: int = 0,
         seg_k: list[int] | None = None, result: int = 0) -> bytes:
    """`body`: the raw bytes (RAW), or STREAMS streams per segment (CODED, CODED_POS)."""
    out = bytearray((MAGIC, (FORMAT << 4) | mode, _CODE[dtype]))
    put_varint(out, n)
    put_varint(out, k)
    if mode in CODED_MODES:
        out.append(log2_seg)
        out += result.to_bytes(4, "little")
        seg_k = seg_k or []
        for s, ks in enumerate(seg_k):
            if len(seg_k) > 1:
                put_varint(out, ks)
            for part in body[STREAMS * s : STREAMS * (s + 1)]:
                put_varint(out, len(part))
    for part in body:
        out += part
    out += (xxhash.xxh3_64_intdigest(out) & 0xFFFFFFFF).to_bytes(CHECK, "little")
    return bytes(out)


class ByteReader:
    """Bytes and LEB128 varints from `buf[:end]`; BadDelta naming `what` when it runs short."""

    def __init__(self, buf: memoryview, end: int, what: str = "delta payload"):
        self.buf, self.pos, self.end, self.what = buf, 0, end, what

    def byte(self) -> int:
        if self.pos >= self.end:
            raise BadDelta(f"{self.what} is truncated inside its header")
        b = self.buf[self.pos]
        self.pos += 1
        return b

    def varint(self) -> int:
        buf, pos, end = self.buf, self.pos, self.end
        v = shift = 0
        while pos < end and shift < 63:
            b = buf[pos]
            pos += 1
            v |= (b & 0x7F) << shift
            if b < 0x80:
                self.pos = pos
                return v
            shift += 7
        if shift >= 63:
            raise BadDelta(f"{self.what} has an over-long varint in its header")
        raise BadDelta(f"{self.what} is truncated inside its header")


def claimed_changes(payload: bytes | memoryview) -> int:
    """How many elements a payload says it changes, read from its first bytes and checked no
    further: for statistics of a payload this process has just encoded (`parse` checks a
    payload from elsewhere)."""
    return _claimed(payload)[1]


def claimed_elements(payload: bytes | memoryview) -> int:
    """How many elements a payload says it is coded over, checked no further (`parse` still
    checks the whole header when it decodes): for naming a group record whose tensors hold
    another number before decoding it."""
    return _claimed(payload)[0]


def _claimed(payload: bytes | memoryview) -> tuple[int, int]:
    """(elements, changes) from a payload's first bytes, unchecked beyond running short."""
    buf = memoryview(payload).cast("B")
    r = ByteReader(buf, len(buf))
    r.pos = 3
    return r.varint(), r.varint()


def parse(payload: bytes | memoryview, verify: bool = True) -> Header:
    """Header of a payload, every field range-checked; BadDelta on anything malformed."""
    buf = memoryview(payload).cast("B")
    if len(buf) < 3 + 2 + CHECK:
        raise BadDelta(f"delta payload of {len(buf)} bytes is too short to be one")
    end = len(buf) - CHECK
    if verify:
        want = int.from_bytes(buf[end:], "little")
        if xxhash.xxh3_64_intdigest(buf[:end]) & 0xFFFFFFFF != want:
            raise BadDelta("delta payload checksum mismatch: it is corrupted or truncated; "
                           "fetch the block again")
    r = ByteReader(buf, end)
    if r.byte() != MAGIC:
        raise BadDelta("not a deltaswarm tensor delta (bad magic byte)")
    fm = r.byte()
    if fm >> 4 > FORMAT:
        raise BadDelta(f"tensor delta format {fm >> 4} is newer than this build reads "
                       f"({FORMAT}); upgrade deltaswarm")
    if fm >> 4 != FORMAT:
        raise BadDelta(f"tensor delta format {fm >> 4} was written by an older deltaswarm; this "
                       f"build reads format {FORMAT} only: bootstrap from a snapshot (they hold "
                       "raw tensors) or re-publish the chain")
    mode, code = fm & 0xF, r.byte()
    if mode not in (NONE, RAW, *CODED_MODES) or code >= len(DTYPE_CODES):
        raise BadDelta(f"tensor delta has unknown mode {mode} or dtype code {code}: a newer "
                       "deltaswarm may have written it (upgrade this one), or it is corrupt")
    h = Header(mode, DTYPE_CODES[code], r.varint(), r.varint())
    if h.k > h.n:
        raise BadDelta(f"tensor delta claims {h.k} changes in {h.n} elements")
    if mode == NONE and h.k:
        raise BadDelta("tensor delta of mode 'unchanged' claims changes")
    if mode in CODED_MODES:
        h.log2_seg = r.byte()
        if not LOG2_SEG_MIN <= h.log2_seg <= LOG2_SEG_MAX:
            raise BadDelta(f"tensor delta segment size 2^{h.log2_seg} is out of range")
        if r.pos + 4 > end:
            raise BadDelta(f"{r.what} is truncated inside its header")
        h.result = int.from_bytes(buf[r.pos:r.pos + 4], "little")
        r.pos += 4
        seg = 1 << h.log2_seg
        nseg = (h.n + seg - 1) // seg
        if nseg == 0 or h.k == 0:
            raise BadDelta("coded tensor delta has no elements or no changes")
        if nseg > end:
            raise BadDelta(f"tensor delta needs {nseg} segment entries; payload is truncated")
        for s in range(nseg):
            h.seg_k.append(r.varint() if nseg > 1 else h.k)
            h.seg_len.append(tuple([r.varint() for _ in range(STREAMS)]))
            if h.seg_k[-1] > min(seg, h.n - s * seg):
                raise BadDelta(f"tensor delta segment {s} claims too many changes")
        if sum(h.seg_k) != h.k:
            raise BadDelta("tensor delta segment change counts do not add up")
    h.body_start, h.body_end = r.pos, end
    body = end - r.pos
    if mode == NONE and body:
        raise BadDelta("tensor delta of mode 'unchanged' has trailing bytes")
    if mode == RAW and body != h.n * lookup(h.dtype).itemsize:
        raise BadDelta(f"raw tensor delta has {body} bytes of values for {h.n} elements")
    streams = sum(map(sum, h.seg_len))
    if mode in CODED_MODES and streams != body:
        raise BadDelta(f"tensor delta streams take {streams} bytes; the payload holds "
                       f"{body}: it is truncated or corrupted")
    return h


def as_bytes(arr: np.ndarray) -> bytes:
    return np.ascontiguousarray(arr).tobytes()
