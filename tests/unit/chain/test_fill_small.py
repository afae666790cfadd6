"""The fill's path for small tensors (at most chain.fill.PART elements, written together in
shared jobs): what the per-part path refuses, it refuses too."""

import numpy as np
import pytest

from chain import codec
from chain.digest import tensor_digest
from chain.errors import BadDelta
from chain.fill import Fill
from chain.manifest import TensorEntry
from chain.safetensors_io import TensorFiles, WritableFiles, allocate


@pytest.mark.parametrize("shape", [[0], [3, 0], [16]])
def test_a_tensor_with_neither_record_nor_parent_is_refused_even_when_empty(tmp_path, shape):
    numel = 1
    for d in shape:
        numel *= d
    allocate(tmp_path / "m.safetensors", [("e", "bfloat16", shape, 2 * numel)])
    t = TensorEntry(name="e", dtype="bfloat16", shape=shape, digest="0" * 32)
    fill = Fill(WritableFiles(tmp_path, ["m.safetensors"]), [t], "v00000001.delta", None, {})
    with pytest.raises(BadDelta, match="tensor e needs a full record"):
        fill.run_changes({})


def test_changes_past_a_small_tensor_never_reach_the_next_tensor_in_the_file(tmp_path):
    """A caller's Changes with a position past its tensor: the shared small-tensor jobs cut it
    as the per-part path does (the compiled kernels check no bounds; uncut, element 5 of the
    next tensor in the file was overwritten and journaled as verified)."""
    layout = [("b", "bfloat16", [16], 32), ("a", "bfloat16", [16], 32)]  # b first in the file
    for sub in ("base", "out"):
        (tmp_path / sub).mkdir()
        allocate(tmp_path / sub / "m.safetensors", layout)
    base = WritableFiles(tmp_path / "base", ["m.safetensors"])
    base.bits("a")[:] = np.arange(16, dtype=np.uint16) + 100
    base.bits("b")[:] = np.arange(16, dtype=np.uint16) + 200
    base.flush()
    src = TensorFiles(tmp_path / "base")
    digests = {n: tensor_digest("bfloat16", [16], src.bits(n)) for n in ("a", "b")}
    want_b = src.bits("b").copy()
    want_b[3] = 7
    tensors = [TensorEntry(name="a", dtype="bfloat16", shape=[16], digest=digests["a"]),
               TensorEntry(name="b", dtype="bfloat16", shape=[16],
                           digest=tensor_digest("bfloat16", [16], want_b))]
    out = WritableFiles(tmp_path / "out", ["m.safetensors"])
    fill = Fill(out, tensors, "v00000001.delta", src, digests)
    fill.run_changes({"b": codec.Changes(np.array([3, 21], np.int64),
                                         np.array([7, 0xDEAD], np.uint16))})
    assert np.array_equal(out.bits("a"), src.bits("a"))
    assert np.array_equal(out.bits("b"), want_b)


@pytest.mark.parametrize("names", [["b", "a"], ["a", "a"]], ids=["unsorted", "twice"])
def test_a_tensor_list_out_of_name_order_is_refused(tmp_path, names):
    """The record checks rest on name order (a group covers the tensors up to its last name):
    a delta file's list, which no manifest check has sorted, is refused before any write."""
    allocate(tmp_path / "m.safetensors", [("a", "bfloat16", [4], 8), ("b", "bfloat16", [4], 8)])
    tensors = [TensorEntry(name=n, dtype="bfloat16", shape=[4], digest="0" * 32) for n in names]
    with pytest.raises(BadDelta, match="not in name order or names a tensor twice"):
        Fill(WritableFiles(tmp_path, ["m.safetensors"]), tensors, "d.delta", None, {})
