"""The fill's path for small tensors (at most chain.fill.PART elements, written together in
shared jobs): what the per-part path refuses, it refuses too."""

import pytest

from chain.errors import BadDelta
from chain.fill import Fill
from chain.manifest import TensorEntry
from chain.safetensors_io import WritableFiles, allocate


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
