"""A manifest's tensors held as columns: same bytes, same refusals, a fraction of the memory."""

import json
import math
import tracemalloc

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from chain.digest import state_digest
from chain.errors import BadManifest
from chain.manifest import Manifest, TensorEntry, canonical_json
from chain.tensortable import TensorTable

MOE_TENSORS = 50_000


def moe_rows(n: int, salt: int = 0) -> list[dict]:
    return [{"name": f"model.layers.{i // 1024:02d}.mlp.experts.{i % 1024:04d}.down_proj.weight",
             "dtype": "bfloat16", "shape": [2048, 768], "digest": f"{i + salt:032x}"}
            for i in range(n)]


def test_a_table_reads_and_dumps_as_the_entries_it_was_made_of():
    rows = moe_rows(300)
    table = TensorTable.of(rows)
    entries = [TensorEntry.model_validate(r) for r in rows]
    assert len(table) == 300
    assert table.as_dicts() == rows
    assert table == entries and entries == list(table)
    assert table[7] == entries[7] and table[-1] == entries[-1]
    assert table[7].numel == entries[7].numel == 2048 * 768
    assert table[7].nbytes == entries[7].nbytes
    assert table[10:13] == entries[10:13]
    assert table.digest_map() == {e.name: e.digest for e in entries}
    assert TensorTable.of(entries) == table
    with pytest.raises(IndexError):
        table[300]


def test_the_kept_digest_list_is_each_tables_own():
    """`digests` keeps the last table's list: asked of tables in turn, each gets its own."""
    a, b = TensorTable.of(moe_rows(40)), TensorTable.of(moe_rows(40, salt=7))
    first = a.digests()
    assert a.digests() is first  # kept
    assert b.digests() == [r["digest"] for r in moe_rows(40, salt=7)]
    assert a.digests() == first == [r["digest"] for r in moe_rows(40)]
    assert a.digest_map() == {r["name"]: r["digest"] for r in moe_rows(40)}


def test_the_manifests_bytes_and_signature_are_those_of_the_entry_list(signing_key):
    """The canonical JSON a trainer signs is unchanged: an old build's manifest parses, and
    the parsed manifest dumps to the very bytes it was read from."""
    rows = moe_rows(2000)
    doc = {"format": 2, "run": "r", "version": 0, "kind": "snapshot", "parent": None,
           "state_digest": state_digest({r["name"]: r["digest"] for r in rows}),
           "tensors": rows, "blocks": [], "files": [], "stats": {}, "created": 1.0}
    m = Manifest.model_validate(doc).signed(signing_key)
    raw = m.to_bytes()
    assert json.loads(raw)["tensors"] == rows
    parsed = Manifest.parse(raw, signing_key.public_key())
    assert parsed.to_bytes() == raw and parsed == m
    assert isinstance(parsed.tensors, TensorTable)


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda r: r.update(dtype="complex64"), "unsupported dtype"),
    (lambda r: r.update(shape=[3, -1]), "tensors.5.shape.1"),
    (lambda r: r.update(shape=[True]), "tensors.5.shape.0"),
    (lambda r: r.update(digest="AB" * 16), "tensors.5.digest"),
    (lambda r: r.update(name=""), "tensors.5.name"),
    (lambda r: r.update(name="x" * 1025), "tensors.5.name"),
    (lambda r: r.update(extra=1), "tensors.5.extra"),
    (lambda r: r.pop("digest"), "tensors.5.digest"),
    (lambda r: r.update(name="expert\ud800"), "tensors.5.name"),
    (lambda r: r.update(shape=[2**63]), "dimension over"),
])
def test_a_bad_entry_is_refused_by_its_index_and_field(mutate, message, signing_key):
    rows = moe_rows(10)
    mutate(rows[5])
    with pytest.raises(ValueError, match=message):
        TensorTable.of(rows)
    doc = {"format": 2, "run": "r", "version": 0, "kind": "snapshot", "parent": None,
           "state_digest": "0" * 32, "tensors": rows, "blocks": []}
    with pytest.raises(BadManifest, match=message):
        Manifest.parse(json.dumps(doc).encode(), None)


def test_columns_with_a_bad_entry_are_refused_like_rows():
    with pytest.raises(ValueError, match=r"tensors\.1\.name"):
        TensorTable.from_columns(["a", ""], b"\x00\x00", [1, 1], [1, 1], ["0" * 32] * 2)
    with pytest.raises(ValueError, match="columns disagree"):
        TensorTable.from_columns(["a", "b"], b"\x00", [1, 1], [1, 1], ["0" * 32] * 2)
    with pytest.raises(ValueError, match=r"tensors\.0\.digest"):  # boundaries would shift
        TensorTable.from_columns(["a", "b"], b"\x00\x00", [1, 1], [1, 1], ["0" * 31, "0" * 33])
    with pytest.raises(ValueError, match=r"tensors\.1\.shape"):
        TensorTable.from_columns(["a", "b"], b"\x00\x00", [1, 1.5], [1, 1], ["0" * 32] * 2)
    # digests: lowercase hex only (bytes.fromhex takes capitals and skips spaces)
    for bad in ("A" * 32, " " + "0" * 30 + " ", "g" * 32, "\u00e9" * 32):
        with pytest.raises(ValueError, match=r"tensors\.1\.digest"):
            TensorTable.from_columns(["a", "b"], b"\x00\x00", [1, 1], [1, 1], ["0" * 32, bad])
    table = TensorTable.from_columns(["a", "b"], b"\x00\x00", [1, 1], [1, 1],
                                     ["0" * 32, "0123456789abcdef" * 2])
    assert table.digests() == ["0" * 32, "0123456789abcdef" * 2]


def test_rows_are_read_only():
    """A row handed back to `TensorTable.of` is taken as checked: it cannot have changed."""
    row = TensorTable.of(moe_rows(2))[0]
    with pytest.raises(AttributeError, match="read-only"):
        row.dtype = "x"


def test_memory_per_tensor_at_moe_scale_and_versions_share_their_layout():
    """50,000 entries (a 30B MoE lists 18,000, Kimi-K2 ~69,000): the first version of a run
    costs under 150 bytes a tensor (pydantic entries cost 560-850), each further version with
    the same tensors about its 16-byte digests."""
    v0, v1 = moe_rows(MOE_TENSORS), moe_rows(MOE_TENSORS, salt=1)
    tracemalloc.start()
    try:
        first = TensorTable.of(v0)
        after_first, _ = tracemalloc.get_traced_memory()
        second = TensorTable.of(v1)
        after_second, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert after_first / MOE_TENSORS < 150, f"{after_first / MOE_TENSORS:.0f} B per tensor"
    assert (after_second - after_first) / MOE_TENSORS < 24
    assert first.shares_layout(second) and first != second
    assert second.digest(0) == f"{1:032x}" and first.digest(0) == f"{0:032x}"


@settings(deadline=None)  # a GC pause on a loaded host is no failure
@given(st.lists(st.tuples(st.text(min_size=1, max_size=40),
                          st.sampled_from(["bfloat16", "float32", "int8", "float16"]),
                          st.lists(st.integers(0, 2**40), max_size=4),
                          st.binary(min_size=16, max_size=16)), max_size=30))
def test_any_valid_list_round_trips(entries):
    rows = [{"name": n, "dtype": d, "shape": s, "digest": g.hex()} for n, d, s, g in entries]
    table = TensorTable.of(rows)
    assert table.as_dicts() == rows
    assert [t.model_dump() for t in table] == rows
    assert [table.name(i) for i in range(len(rows))] == [r["name"] for r in rows]
    # the list a manifest signs, written from the columns: byte for byte json's
    assert table.canonical_json() == canonical_json(rows)
    assert [t.numel for t in table] == [math.prod(r["shape"]) for r in rows]
    assert table.metas() == [(r["dtype"], r["shape"]) for r in rows]
    if len({r["name"] for r in rows}) == len(rows):  # a manifest's names are unique
        assert table.state_digest() == state_digest(table.digest_map()) \
            == streamed_state_digest({r["name"]: r["digest"] for r in rows})
    # a manifest's order (names unique and sorted): the text made in one join a layout keeps
    ordered = TensorTable.of(sorted({r["name"]: r for r in rows}.values(),
                                    key=lambda r: r["name"]))
    assert ordered.ascending() and (table.ascending() or len(table) > len(ordered)
                                    or table.names() != ordered.names())
    assert ordered.state_digest() == streamed_state_digest(ordered.digest_map())
    assert ordered.canonical_json() == canonical_json(ordered.as_dicts())


def streamed_state_digest(digests: dict[str, str]) -> str:
    """The state digest as it was first written (four hash updates a tensor): the one-string
    form must give the same value, which manifests sign and regions compare."""
    h = xxhash.xxh3_128()
    for name in sorted(digests):
        h.update(name.encode())
        h.update(b"\0")
        h.update(digests[name].encode())
        h.update(b"\n")
    return h.hexdigest()


@pytest.mark.parametrize("name", ['say "hi"', "back\\slash", "tab\tand\x01", "\x7f",
                                  "é", "\U0001f600", "\u2028", "plain.name-1_[2]"])
def test_names_json_must_escape_are_escaped_as_json_does(name, signing_key):
    rows = [{"name": name, "dtype": "bfloat16", "shape": [], "digest": "0" * 32},
            {"name": name + "z", "dtype": "int8", "shape": [0, 3], "digest": "f" * 32}]
    table = TensorTable.of(rows)
    assert table.canonical_json() == canonical_json(rows)
    doc = {"format": 2, "run": "r", "version": 0, "kind": "snapshot", "parent": None,
           "state_digest": state_digest({r["name"]: r["digest"] for r in rows}),
           "tensors": rows, "blocks": [], "files": [], "stats": {}, "created": 1.0}
    m = Manifest.model_validate(doc).signed(signing_key)
    assert m.to_bytes() == canonical_json(m.model_dump(mode="json", exclude={"streams", "base"}))
    assert Manifest.parse(m.to_bytes(), signing_key.public_key()).to_bytes() == m.to_bytes()


def test_names_are_the_callers_to_change_and_rows_share_the_layouts_shapes():
    """Names and shapes are cut from their columns once a layout (every version of a run
    shares it): names() hands out a copy, so changing it changes no table; rows and metas
    of two versions read the same shape lists."""
    rows = [{"name": f"m.{i}", "dtype": "bfloat16", "shape": [i + 1, 2], "digest": f"{i:032x}"}
            for i in range(5)]
    a = TensorTable.of(rows)
    b = TensorTable.of([r | {"digest": f"{i + 7:032x}"} for i, r in enumerate(rows)])
    names = a.names()
    names.reverse()
    names.append("x")
    assert a.names() == [f"m.{i}" for i in range(5)] == b.names()
    assert [r.shape for r in a] == [[i + 1, 2] for i in range(5)]
    assert all(x.shape is y.shape for x, y in zip(a, b, strict=True))
    assert [s for _, s in a.metas()] == [r.shape for r in b]
    assert [r.digest for r in b] == [f"{i + 7:032x}" for i in range(5)]
    assert a.as_dicts()[0]["shape"] is not next(iter(a)).shape  # the JSON form is a copy


def test_a_table_moved_is_each_digest_moved_as_lanehash_moves_one():
    """`moved` (a steady delta's table: the parent's with each digest moved) gives what
    `lanehash.add` gives a digest at a time, wrapping modulo 2^64, on the same layout; moves
    that do not fit the table are refused by their shape."""
    import numpy as np

    from chain import lanehash

    rows = [*moe_rows(500), {"name": "x", "dtype": "bfloat16", "shape": [1],
                             "digest": "f" * 32}]
    table = TensorTable.of(rows)
    rng = np.random.default_rng(3)
    moves = rng.integers(0, 2**64, (len(rows), 2), np.uint64, endpoint=False)
    moves[-1] = (2**64 - 1, 1)  # wraps both lanes
    moved = table.moved(moves)
    assert moved.digests() == [lanehash.add(d, (int(a), int(b)))
                               for d, (a, b) in zip(table.digests(), moves, strict=True)]
    assert moved.digest(len(rows) - 1) == "f" * 15 + "e" + "0" * 16
    assert moved.shares_layout(table) and moved.names() == table.names()
    assert table.moved(np.zeros((len(rows), 2), np.uint64)) == table
    for bad in (np.zeros((len(rows) - 1, 2), np.uint64), np.zeros((len(rows), 2), np.int64)):
        with pytest.raises(ValueError, match="one \\(a, b\\) uint64 pair a tensor"):
            table.moved(bad)
