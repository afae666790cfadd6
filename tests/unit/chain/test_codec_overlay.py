"""decode_many with overlays: decoding against a base brought forward by later changes, laid
over it segment by segment in the decoder's threads, must equal decoding against a copy of the
base with those changes written, in positions, values and the digest move."""

import numpy as np
import pytest

from chain import lanehash
from chain.codec import decode_many, encode_tensor_delta
from chain.codec.api import LOG2_SEG
from chain.dtypes import BY_NAME

SEG = 1 << LOG2_SEG


def _changed(rng, arr: np.ndarray, share: float) -> tuple[np.ndarray, np.ndarray]:
    pos = np.sort(rng.choice(arr.size, max(1, int(arr.size * share)), replace=False))
    info = np.iinfo(arr.dtype)
    return pos.astype(np.int64), rng.integers(0, info.max, pos.size, dtype=arr.dtype,
                                              endpoint=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float8_e4m3fn"])
@pytest.mark.parametrize("raw", [False, True], ids=["coded", "raw"])
def test_an_overlaid_decode_equals_a_decode_against_the_overlaid_copy(dtype, raw):
    rng = np.random.default_rng(7)
    uint = BY_NAME[dtype].uint
    n = 2 * SEG + 12_345  # three segments, the last ragged: the first starts at element 0
    disk = rng.integers(0, np.iinfo(uint).max, n, dtype=uint, endpoint=True)
    parent, layers = disk.copy(), []
    for share in (0.01, 0.02):  # two versions the disk has not caught up to
        pos, val = _changed(rng, parent, share)
        parent[pos] = val
        layers.append((pos, val))
    new = parent.copy()
    pos, val = _changed(rng, new, 0.9 if raw else 0.01)
    new[pos] = val
    payload = encode_tensor_delta(parent, new, dtype)
    want = decode_many([(parent, payload, dtype)], moves=True)[0]
    for threads in (1, 2):
        got = decode_many([(disk, payload, dtype)], threads=threads, moves=True,
                          overlays=[layers])[0]
        np.testing.assert_array_equal(got.pos, want.pos)
        np.testing.assert_array_equal(got.val, want.val)
        assert got.digest == want.digest == lanehash.moved_between(parent, new, want.pos)
    # the base itself was only read
    assert not np.array_equal(disk, parent)


def test_without_the_overlay_the_decode_is_refused_not_wrong():
    """The decoder checks its result hash: the wrong parent is an error, never silent."""
    from chain.errors import BadDelta

    rng = np.random.default_rng(8)
    disk = rng.integers(0, 1 << 16, SEG + 100, dtype=np.uint16)
    parent = disk.copy()
    pos, val = _changed(rng, parent, 0.02)
    parent[pos] = val
    new = parent.copy()
    p2, v2 = _changed(rng, new, 0.01)
    new[p2] = v2
    payload = encode_tensor_delta(parent, new, "bfloat16")
    with pytest.raises(BadDelta):
        decode_many([(disk, payload, "bfloat16")], moves=True)


def test_an_overlay_outside_the_tensor_is_refused_before_anything_runs():
    """The segment buffer's scatter is compiled without bounds checks: a layer that does not
    fit the tensor must be a clear error, never a write past the buffer."""
    from chain.errors import BadDelta

    rng = np.random.default_rng(9)
    old = rng.integers(0, 1 << 16, SEG + 10, dtype=np.uint16)
    new = old.copy()
    new[::1000] += 1
    payload = encode_tensor_delta(old, new, "bfloat16")
    for pos in ([5, SEG + 10], [-1, 3]):
        bad = (np.array(pos, np.int64), np.zeros(2, np.uint16))
        with pytest.raises(BadDelta, match="overlay"):
            decode_many([(old, payload, "bfloat16")], overlays=[[bad]])
