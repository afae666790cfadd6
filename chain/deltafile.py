"""A standalone delta file: the record stream plus a header, for the CLI and debugging.

`DSDELTA1 | u32 header length | header JSON | record stream`. The header holds the parent and
child state digests and every child tensor entry, so `apply` verifies the result exactly as a
node does.
"""

import json
import struct
from pathlib import Path
from typing import BinaryIO

from chain.errors import BadDelta
from chain.sources import TensorSource, source_digest
from chain.stream import BlockReader, RecordHeader, encode_header
from chain.tensortable import TensorTable
from chain.writer import EncodeStats, encode_stream

MAGIC = b"DSDELTA2"  # 2: tensor digests are additive lane hashes (1: xxh3)
CHUNK = 8 * 1024 * 1024


class _FileSink:
    def __init__(self, f: BinaryIO) -> None:
        self.f = f

    def write_record(self, h: RecordHeader, payload: bytes | memoryview) -> None:
        self.f.write(encode_header(h))
        self.f.write(payload)


def write_delta_file(path: Path, old: TensorSource, new: TensorSource) -> EncodeStats:
    body = Path(path).with_suffix(Path(path).suffix + ".body")
    with open(body, "wb") as f:
        tensors, stats = encode_stream(_FileSink(f), new, old, "delta")
    header = {
        "parent_state_digest": source_digest(old),
        "state_digest": tensors.state_digest(),
        "tensors": tensors.as_dicts(),
        "stats": stats.as_dict(),
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    with open(path, "wb") as out, open(body, "rb") as src:
        out.write(MAGIC + struct.pack("<I", len(raw)) + raw)
        while chunk := src.read(CHUNK):
            out.write(chunk)
    body.unlink()
    return stats


def read_delta_file(path: Path) -> tuple[dict, TensorTable, BlockReader]:
    f = open(path, "rb")  # noqa: SIM115 - the returned reader streams from it
    head = f.read(len(MAGIC) + 4)
    if head[: len(MAGIC)] == b"DSDELTA1":
        raise BadDelta(f"{path} was written by an older deltaswarm (delta file format 1, other "
                       "tensor digests); encode it again with this version")
    if len(head) < len(MAGIC) + 4 or head[: len(MAGIC)] != MAGIC:
        raise BadDelta(f"{path} is not a deltaswarm delta file (bad magic)")
    (n,) = struct.unpack("<I", head[len(MAGIC):])
    try:
        header = json.loads(f.read(n))
        tensors = TensorTable.of(header["tensors"])
    except (ValueError, KeyError) as e:
        raise BadDelta(f"{path}: delta header is malformed: {e}") from None
    return header, tensors, BlockReader(iter(lambda: f.read(CHUNK), b""))
