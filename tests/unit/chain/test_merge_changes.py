"""Merging consecutive versions' changes of a tensor (a region's disk catch-up over several
patches): the union of positions, ascending, the later value where both versions changed an
element, compared with a sort-based reference."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from chain.codec import aot
from chain.codec.api import Changes, merge_changes


def _changes(draw, n: int, dtype) -> Changes:
    pos = np.array(sorted(draw(st.sets(st.integers(0, n - 1), max_size=60))), np.int64)
    val = np.array(draw(st.lists(st.integers(0, np.iinfo(dtype).max), min_size=pos.size,
                                 max_size=pos.size)), dtype)
    return Changes(pos, val)


def _reference(chs: list[Changes]) -> tuple[np.ndarray, np.ndarray]:
    pos = np.concatenate([c.pos for c in chs])[::-1]
    val = np.concatenate([c.val for c in chs])[::-1]
    keep, first = np.unique(pos, return_index=True)
    return keep, val[first]


@settings(max_examples=200, deadline=None)
@given(st.data(), st.sampled_from([np.uint8, np.uint16, np.uint32, np.uint64]),
       st.integers(1, 3))
def test_merged_changes_equal_the_sorted_union_with_the_later_value(data, dtype, extra):
    chs = [_changes(data.draw, 100, dtype) for _ in range(1 + extra)]
    merged = chs[0]
    for ch in chs[1:]:
        merged = merge_changes(merged, ch)
    pos, val = _reference(chs)
    assert merged.pos.dtype == np.int64 and merged.val.dtype == dtype
    np.testing.assert_array_equal(merged.pos, pos)
    np.testing.assert_array_equal(merged.val, val)


def test_a_merge_at_model_size_takes_the_compiled_kernel():
    rng = np.random.default_rng(0)
    positions = [np.unique(rng.integers(0, 1 << 24, 1 << 18)).astype(np.int64) for _ in range(2)]
    chs = [Changes(p, rng.integers(0, 1 << 16, p.size, dtype=np.uint16)) for p in positions]
    before = dict(aot.status()["jit_fallbacks"])
    merged = merge_changes(*chs)
    pos, val = _reference(chs)
    np.testing.assert_array_equal(merged.pos, pos)
    np.testing.assert_array_equal(merged.val, val)
    if aot.status()["kernels"] == "aot":
        assert aot.status()["jit_fallbacks"] == before
