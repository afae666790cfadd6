"""The tensor record stream that an artifact's blocks carry, cut into bounded blocks.

An artifact is one byte stream, split at fixed sizes into blocks: a sequence of records, one per
tensor that is new or changed, in name order. A record is
`b"DSR2" | u32 header length | header | n payload bytes`, the header being binary:
`u8 flags | u8 dtype code | varint ndim | varint shape... | varint n | [varint at | varint count]
| [varint tensors] | name (UTF-8, the rest)`, flags bit 0 = op `full` (raw bytes; else `delta`, a
codec payload against the parent's tensor), bit 1 = `at`/`count` present, bit 2 = op `group`.
Unchanged tensors have no record. A record of a sharded trainer's rank (manifest format 3) covers
only elements [at, at + count) of its tensor. A `group` record (no shape) covers `tensors`
(its `count`) consecutive tensors of the manifest's table, the first one named: its codec
payload is coded against their parent elements laid end to end, in table order. Writing and
reading are streaming, so memory stays near one block plus one tensor.

Why binary: a record's framing is paid per changed tensor, and models carry 50,000 tensors
(MoE experts), each with a few changes per version. The first format (`DSR1`, a JSON header of
~110 bytes plus the name) cost 1-3 % of a 1 %-dense delta on a 100-tensor model; this one costs
about 10 bytes plus the name. Groups exist for the same reason at MoE scale: a run of small
tensors (experts of a few thousand elements) pays one record, one codec job and one payload
header instead of one each (chain/writer.py). Streams written as `DSR1` are still read.
"""

import json
import struct
from collections.abc import Callable, Iterable
from typing import NamedTuple

from chain.blocks import DEFAULT_BLOCK, BlockStore
from chain.codec.header import DTYPE_CODES, ByteReader, put_varint
from chain.digest import pieces_root
from chain.errors import BadDelta
from chain.manifest import BlockEntry

MAGIC = b"DSR2"
MAGIC_JSON = b"DSR1"
"""The first record format (JSON headers): read, never written."""
_HDR = struct.Struct("<4sI")
MAX_RECORD_HEADER = 1 << 20
MAX_GROUP = 1 << 22
"""The most elements a group record may cover: a reader copies its tensors' parent elements
end to end to decode it (chain/fill.py), so a forged count must not make that the whole
model; writers stay under it (chain.writer._units)."""
_FULL, _RANGE, _GROUP = 1, 2, 4
_DTYPE_CODE = {name: i for i, name in enumerate(DTYPE_CODES)}


class RecordHeader(NamedTuple):
    """One record's header (a NamedTuple: built once per tensor read or written, where a
    frozen dataclass's __init__ cost a few percent of an apply at 50,000 tensors). `op`:
    full | delta | group; a group's `count` is its number of tensors (`at` None, `shape` [])."""

    name: str
    op: str
    dtype: str
    shape: list[int]
    n: int
    at: int | None = None
    count: int | None = None


def encode_header(h: RecordHeader) -> bytes:
    flags = _FULL if h.op == "full" else _GROUP if h.op == "group" else 0
    body = bytearray((flags | (_RANGE if h.at is not None else 0), _DTYPE_CODE[h.dtype]))
    put_varint(body, len(h.shape))
    for s in h.shape:
        put_varint(body, s)
    put_varint(body, h.n)
    if h.at is not None:
        put_varint(body, h.at)
        put_varint(body, h.count)
    if h.op == "group":
        put_varint(body, h.count)
    body += h.name.encode()
    return _HDR.pack(MAGIC, len(body)) + bytes(body)


def _decode_binary(raw: bytes) -> RecordHeader:
    r = ByteReader(memoryview(raw), len(raw), "record header")
    flags, code = r.byte(), r.byte()
    if flags & ~(_FULL | _RANGE | _GROUP) or code >= len(DTYPE_CODES) or \
            (flags & _GROUP and flags & (_FULL | _RANGE)):
        raise BadDelta(f"record header has unknown flags {flags:#x} or dtype code {code} (a "
                       "group record is written by a newer deltaswarm: upgrade this node)")
    ndim = r.varint()
    if ndim > 64:
        raise BadDelta(f"record header claims {ndim} dimensions")
    shape = [r.varint() for _ in range(ndim)]
    n = r.varint()
    at = count = None
    if flags & _RANGE:
        at, count = r.varint(), r.varint()
    if flags & _GROUP:
        count = r.varint()
        if ndim or count < 1:
            raise BadDelta(f"group record has a shape or covers {count} tensors")
    try:
        name = raw[r.pos:].decode()
    except UnicodeDecodeError:
        raise BadDelta("record header's tensor name is not UTF-8") from None
    op = "full" if flags & _FULL else "group" if flags & _GROUP else "delta"
    return RecordHeader(name=name, op=op,
                        dtype=DTYPE_CODES[code], shape=shape, n=n, at=at, count=count)


def _decode_json(raw: bytes) -> RecordHeader:
    try:
        doc = json.loads(raw)
        return RecordHeader(name=str(doc["name"]), op=str(doc["op"]), dtype=str(doc["dtype"]),
                            shape=[int(s) for s in doc["shape"]], n=int(doc["n"]),
                            at=None if "at" not in doc else int(doc["at"]),
                            count=None if "at" not in doc else int(doc["count"]))
    except (ValueError, KeyError, TypeError) as e:
        raise BadDelta(f"record header is malformed: {e}") from None


class BlockWriter:
    """Accepts stream bytes, emits fixed-size blocks into a BlockStore as they fill."""

    def __init__(self, store: BlockStore, block_size: int = DEFAULT_BLOCK) -> None:
        self.store = store
        self.block_size = block_size
        self.blocks: list[BlockEntry] = []
        self._buf = bytearray()

    def write(self, data: bytes | memoryview) -> None:
        if len(self._buf) + len(data) < self.block_size and isinstance(data, bytes):
            self._buf += data  # most records of a many-tensor model: no view, no loop
            return
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), self.block_size - len(self._buf))
            self._buf += view[:take]
            view = view[take:]
            if len(self._buf) == self.block_size:
                self._emit()

    def write_record(self, h: RecordHeader, payload: bytes | memoryview) -> None:
        self.write(encode_header(h))
        self.write(payload)

    def _emit(self) -> None:
        data = bytes(self._buf)
        bid = self.store.put(data)
        self.blocks.append(BlockEntry(id=bid, size=len(data), root=pieces_root(data)))
        self._buf.clear()

    def close(self) -> list[BlockEntry]:
        if self._buf:
            self._emit()
        return self.blocks


class BlockReader:
    """Reads the stream back across chunk boundaries; each chunk (a block, fetched and verified
    by the caller's generator) is pulled only when needed."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks = iter(chunks)
        self._cur = memoryview(b"")

    @classmethod
    def of_blocks(cls, blocks: list[BlockEntry], get_block: Callable[[BlockEntry], bytes]
                  ) -> "BlockReader":
        return cls(get_block(b) for b in blocks)

    def _fill(self) -> bool:
        chunk = next(self._chunks, None)
        if chunk is None:
            return False
        self._cur = memoryview(chunk).cast("B")
        return True

    def at_end(self) -> bool:
        while not len(self._cur):
            if not self._fill():
                return True
        return False

    def read_into(self, out: memoryview) -> None:
        out = out.cast("B")
        pos = 0
        while pos < len(out):
            if not len(self._cur) and not self._fill():
                raise BadDelta(f"stream truncated: needed {len(out) - pos} more bytes")
            take = min(len(self._cur), len(out) - pos)
            out[pos : pos + take] = self._cur[:take]
            self._cur = self._cur[take:]
            pos += take

    def read(self, n: int) -> bytes:
        if n <= len(self._cur):  # within the current chunk: one copy
            out = bytes(self._cur[:n])
            self._cur = self._cur[n:]
            return out
        buf = bytearray(n)
        self.read_into(memoryview(buf))
        return bytes(buf)

    def skip(self, n: int) -> None:
        while n:
            if not len(self._cur) and not self._fill():
                raise BadDelta("stream truncated while skipping a record")
            take = min(len(self._cur), n)
            self._cur = self._cur[take:]
            n -= take

    def next_header(self) -> RecordHeader | None:
        if self.at_end():
            return None
        magic, length = _HDR.unpack(self.read(_HDR.size))
        if magic not in (MAGIC, MAGIC_JSON):
            raise BadDelta(f"bad record magic {magic!r}: the stream is corrupt or not a delta")
        if length > MAX_RECORD_HEADER:
            raise BadDelta(f"record header of {length} bytes is implausibly large")
        raw = self.read(length)
        h = _decode_binary(raw) if magic == MAGIC else _decode_json(raw)
        if h.op not in ("delta", "full", "group") or h.n < 0:
            raise BadDelta(f"record for {h.name!r} has invalid op {h.op!r} or length {h.n}")
        if h.op == "group" and (magic != MAGIC or h.at is not None):
            raise BadDelta(f"record for {h.name!r} is a malformed group")
        if h.at is not None and (h.at < 0 or h.count < 0):
            raise BadDelta(f"record for {h.name!r} covers a negative range ({h.at}, {h.count})")
        return h
