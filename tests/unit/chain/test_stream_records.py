"""The record stream's framing (chain/stream.py): binary headers round-trip every field across
block boundaries, streams written with the first (JSON) headers still read, a header that lies
is refused by name, and the framing stays small against the payload it carries."""

import json
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chain.blocks import BlockStore
from chain.codec.header import DTYPE_CODES
from chain.errors import BadDelta
from chain.stream import BlockReader, BlockWriter, RecordHeader, encode_header

headers = st.builds(
    lambda name, op, dtype, shape, n, rng: RecordHeader(
        name, op, dtype, shape, n, *((rng[0], rng[1]) if rng else (None, None))),
    st.text(min_size=1, max_size=80), st.sampled_from(["delta", "full"]),
    st.sampled_from(DTYPE_CODES), st.lists(st.integers(0, 1 << 40), max_size=5),
    st.integers(0, 1 << 40), st.none() | st.tuples(st.integers(0, 1 << 40),
                                                   st.integers(0, 1 << 40)))


def _read_all(chunks: list[bytes]) -> list[tuple[RecordHeader, bytes]]:
    r, out = BlockReader(chunks), []
    while (h := r.next_header()) is not None:
        out.append((h, r.read(h.n)))
    return out


@settings(deadline=None)  # a GC pause on a loaded host is no failure
@given(st.lists(headers, min_size=1, max_size=6))
def test_binary_headers_round_trip_every_field_across_block_edges(hs: list[RecordHeader]
                                                                  ) -> None:
    recs = [(RecordHeader(h.name, h.op, h.dtype, h.shape, min(h.n, 50), h.at, h.count),
             bytes(range(min(h.n, 50)))) for h in hs]
    stream = b"".join(encode_header(h) + p for h, p in recs)
    chunks = [stream[i:i + 7] for i in range(0, len(stream), 7)]  # headers split anywhere
    assert _read_all(chunks) == recs


def test_a_stream_of_first_format_json_records_still_reads() -> None:
    doc = {"name": "w", "op": "delta", "dtype": "bfloat16", "shape": [2, 3], "n": 4,
           "at": 6, "count": 9}
    body = json.dumps(doc).encode()
    stream = struct.pack("<4sI", b"DSR1", len(body)) + body + b"abcd"
    [(h, payload)] = _read_all([stream])
    assert h == RecordHeader("w", "delta", "bfloat16", [2, 3], 4, 6, 9) and payload == b"abcd"


@pytest.mark.parametrize(("mangle", "says"), [
    (lambda b: b[:8] + bytes([0x80]) + b[9:], "unknown flags"),
    (lambda b: b[:9] + bytes([200]) + b[10:], "dtype code 200"),
    (lambda b: b[:4] + struct.pack("<I", 2) + b[8:10], "truncated"),
    (lambda b: b"DSR9" + b[4:], "bad record magic"),
])
def test_a_header_that_lies_is_refused_by_name(mangle, says: str) -> None:
    good = encode_header(RecordHeader("layer.w", "delta", "bfloat16", [4, 4], 0))
    with pytest.raises(BadDelta, match=says):
        _read_all([mangle(good)])


def test_framing_is_a_few_bytes_beyond_the_name(tmp_path) -> None:
    """What made a 1 %-dense delta of a 100-tensor model 1.03x its payload was ~110 bytes of
    JSON per record; the binary header is the name plus at most a dozen bytes here."""
    name = "model.layers.17.mlp.experts.123.down_proj.weight"
    h = RecordHeader(name, "delta", "bfloat16", [2048, 768], 123_456)
    assert len(encode_header(h)) <= 8 + len(name) + 12
    w = BlockWriter(BlockStore(tmp_path / "b"), 1 << 16)
    w.write_record(h, b"\0" * h.n)
    assert sum(b.size for b in w.close()) == len(encode_header(h)) + h.n
