"""The tensor record stream that an artifact's blocks carry, cut into bounded blocks.

An artifact is one byte stream, split at fixed sizes into blocks: a sequence of records, one per
tensor that is new or changed, in name order. A record is
`b"DSR1" | u32 header length | header JSON {name, op, dtype, shape, n} | n payload bytes`
with op `delta` (codec payload against the parent's tensor) or `full` (raw bytes). Unchanged
tensors have no record. A record of a sharded trainer's rank (manifest format 3) covers only
elements [at, at + count) of its tensor; its header then also holds `at` and `count`.
Writing and reading are streaming, so memory stays near one block plus one tensor.
"""

import json
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from chain.blocks import DEFAULT_BLOCK, BlockStore
from chain.digest import pieces_root
from chain.errors import BadDelta
from chain.manifest import BlockEntry

MAGIC = b"DSR1"
_HDR = struct.Struct("<4sI")
MAX_RECORD_HEADER = 1 << 20


@dataclass(frozen=True)
class RecordHeader:
    name: str
    op: str
    dtype: str
    shape: list[int]
    n: int
    at: int | None = None
    count: int | None = None


def encode_header(h: RecordHeader) -> bytes:
    doc = {"name": h.name, "op": h.op, "dtype": h.dtype, "shape": h.shape, "n": h.n}
    if h.at is not None:
        doc |= {"at": h.at, "count": h.count}
    body = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
    return _HDR.pack(MAGIC, len(body)) + body


class BlockWriter:
    """Accepts stream bytes, emits fixed-size blocks into a BlockStore as they fill."""

    def __init__(self, store: BlockStore, block_size: int = DEFAULT_BLOCK) -> None:
        self.store = store
        self.block_size = block_size
        self.blocks: list[BlockEntry] = []
        self._buf = bytearray()

    def write(self, data: bytes | memoryview) -> None:
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
        if magic != MAGIC:
            raise BadDelta(f"bad record magic {magic!r}: the stream is corrupt or not a delta")
        if length > MAX_RECORD_HEADER:
            raise BadDelta(f"record header of {length} bytes is implausibly large")
        try:
            doc = json.loads(self.read(length))
            h = RecordHeader(name=str(doc["name"]), op=str(doc["op"]), dtype=str(doc["dtype"]),
                             shape=[int(s) for s in doc["shape"]], n=int(doc["n"]),
                           at=None if "at" not in doc else int(doc["at"]),
                           count=None if "at" not in doc else int(doc["count"]))
        except (ValueError, KeyError, TypeError) as e:
            raise BadDelta(f"record header is malformed: {e}") from None
        if h.op not in ("delta", "full") or h.n < 0:
            raise BadDelta(f"record for {h.name!r} has invalid op {h.op!r} or length {h.n}")
        if h.at is not None and (h.at < 0 or h.count < 0):
            raise BadDelta(f"record for {h.name!r} covers a negative range ({h.at}, {h.count})")
        return h
