"""A directory's slots as columns (chain/slotcolumns.py) answer what walking the slots one by
one answers: the same span views, madvise ranges covering the same bytes, the same `holds`,
for files whose headers list tensors in any order, with empty tensors and several files."""

import json
import struct
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from chain import safetensors_io as sio
from chain.safetensors_io import TensorFiles, _span
from chain.slotcolumns import FileColumns

_DTYPES = {"BF16": 2, "F32": 4}


def _write(path: Path, tensors: list[tuple[str, str, int]], order: list[int]) -> None:
    """A safetensors file of (name, dtype, elements) laid out in the order given, its header
    listing them in `order` (a permutation): other writers than ours list in any order."""
    entries, at = {}, 0
    for name, dtype, n in tensors:
        size = n * _DTYPES[dtype]
        entries[name] = {"dtype": dtype, "shape": [n], "data_offsets": [at, at + size]}
        at += size
    keys = list(entries)
    body = json.dumps({keys[i]: entries[keys[i]] for i in order}).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + bytes(range(256)) * (at // 256 + 1))


_tensor = st.tuples(st.sampled_from(list(_DTYPES)), st.integers(0, 5))


@settings(deadline=None, max_examples=60)
@given(files=st.lists(st.lists(_tensor, min_size=1, max_size=8), min_size=1, max_size=3),
       data=st.data())
def test_columns_answer_as_the_slots_do(tmp_path_factory, files, data) -> None:
    d = tmp_path_factory.mktemp("cols")
    counter = 0
    for f, tensors in enumerate(files):
        named = []
        for dtype, n in tensors:
            named.append((f"t{counter:03d}", dtype, n))
            counter += 1
        order = data.draw(st.permutations(range(len(named))))
        _write(d / f"model-{f}.safetensors", named, order)
    tf = TensorFiles(d)
    names = tf.names()
    # any run of names in name order (what a group asks), and any subset (a batch)
    lo = data.draw(st.integers(0, len(names) - 1))
    hi = data.draw(st.integers(lo + 1, len(names)))
    run = names[lo:hi]
    want = _span(tf._maps, [tf.slots[n] for n in run])
    got = tf.span(run)
    assert (got is None) == (want is None)
    if got is not None:
        assert got.dtype == want.dtype and np.array_equal(got, want)
        assert got.__array_interface__["data"][0] == want.__array_interface__["data"][0]
    picked = data.draw(st.lists(st.sampled_from(names), unique=True))
    calls: list[tuple[int, int]] = []
    real = sio._advise_range
    try:
        sio._advise_range = lambda m, start, end, advice: calls.append((id(m), start, end))
        tf.release_many(picked)
    finally:
        sio._advise_range = real
    want_bytes = {(id(tf._maps[tf.slots[n].file]), b) for n in picked
                  for b in range(tf.slots[n].start, tf.slots[n].end)
                  if tf.slots[n].file in tf._maps}
    got_bytes = {(m, b) for m, lo_, hi_ in calls for b in range(lo_, hi_)}
    assert got_bytes == want_bytes and all(h > lo_ for _, lo_, h in calls)
    metas = [(tf.slots[n].dtype, tf.slots[n].shape) for n in run]
    assert tf.holds(run, metas)
    wrong = [*metas[:-1], (metas[-1][0], [metas[-1][1][0] + 1])]
    assert not tf.holds(run, wrong)


def test_a_header_out_of_byte_order_is_sorted(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    _write(path, [("a", "BF16", 3), ("b", "F32", 2), ("c", "BF16", 0), ("d", "BF16", 4)],
           [3, 1, 2, 0])
    cols = FileColumns.of(sio.read_header(path)[1].values())
    assert cols.names == ["a", "b", "c", "d"]
    assert cols.start.tolist() == [0, 6, 14, 14] and cols.end.tolist() == [6, 14, 14, 22]


def test_names_not_here_are_refused_unless_asked_to_skip(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    _write(path, [("a", "BF16", 3), ("b", "BF16", 2)], [0, 1])
    tf = TensorFiles(path)
    calls: list[tuple[int, int]] = []
    real = sio._advise_range
    try:
        sio._advise_range = lambda m, start, end, advice: calls.append((start, end))
        tf.release_many(["a", "zz", "b"], known_only=True)
        try:
            tf.release_many(["a", "zz"])
        except KeyError as e:
            assert "zz" in str(e)
        else:
            raise AssertionError("an unknown name was not refused")
    finally:
        sio._advise_range = real
    assert calls == [(0, 10)]  # "a" and "b" lie back to back: one call


def test_a_spare_directory_is_reused_only_for_the_same_tensors_dtypes_and_shapes(
        tmp_path: Path) -> None:
    """weights._same_layout, from the files' columns: the same table in any file order is the
    same layout; a changed shape or dtype, a tensor more or less, is not."""
    from types import SimpleNamespace

    from chain.tensortable import TensorTable
    from chain.weights import _same_layout

    def manifest(rows: list[tuple[str, str, list[int]]]) -> SimpleNamespace:
        return SimpleNamespace(tensors=TensorTable.of(
            [{"name": n, "dtype": d, "shape": s, "digest": "0" * 32} for n, d, s in rows]))

    rows = [("a", "bfloat16", [3]), ("b", "float32", [2]), ("c", "bfloat16", [4])]
    d = tmp_path / "v"
    d.mkdir()
    _write(d / "model.safetensors", [("a", "BF16", 3), ("b", "F32", 2), ("c", "BF16", 4)],
           [0, 1, 2])
    assert _same_layout(d, manifest(rows))
    assert not _same_layout(d, manifest([*rows[:2], ("c", "bfloat16", [5])]))
    assert not _same_layout(d, manifest([*rows[:2], ("c", "float32", [4])]))
    assert not _same_layout(d, manifest(rows[:2]))
    assert not _same_layout(d, manifest([*rows, ("d", "bfloat16", [1])]))
    e = tmp_path / "w"  # the same tensors in two files, laid out out of name order
    e.mkdir()
    _write(e / "model-1.safetensors", [("c", "BF16", 4), ("a", "BF16", 3)], [1, 0])
    _write(e / "model-2.safetensors", [("b", "F32", 2)], [0])
    assert _same_layout(e, manifest(rows))
    assert not _same_layout(e, manifest([("a", "bfloat16", [3]), ("b", "float32", [2]),
                                         ("e", "bfloat16", [4])]))
