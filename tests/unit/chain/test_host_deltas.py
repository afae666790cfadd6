"""A rank's host slices encoded in one pass (chain/host_deltas.py) give what finding the
changes first gives: the same positions and values, the same digest-part move (also for words
split between two segments of a slice that starts mid-word, and for slices split between two
batches), and byte-identical records to `shards.write_delta`'s."""

import numpy as np
import pytest

from chain import shards
from chain.blocks import BlockStore
from chain.codec.api import LOG2_SEG
from chain.host_deltas import HostDeltas
from chain.stream import BlockWriter

SEG = 1 << LOG2_SEG
DTYPES = [("bfloat16", np.uint16), ("float32", np.uint32), ("uint8", np.uint8)]


class _At:
    def __init__(self, name: str, dtype: str, n: int, lo: int) -> None:
        self.name, self.dtype, self.shape, self.lo = name, dtype, [lo + n + 5], lo


def _case(rng, uint, n, lo):
    """A slice of n elements from element lo, changed at about 1 % of places plus every
    element within a word of each segment boundary and of both ends."""
    old = rng.integers(0, np.iinfo(uint).max, n, dtype=uint, endpoint=True)
    near = [p for b in [0, *range(SEG, n, SEG), n] for p in range(b - 9, b + 9) if 0 <= p < n]
    pos = np.unique(np.concatenate([rng.choice(n, n // 100, replace=False),
                                    np.array(near, np.int64)]))
    new = old.copy()
    new[pos] ^= rng.integers(1, np.iinfo(uint).max, pos.size, dtype=uint, endpoint=True)
    return old, new, pos.astype(np.int64)


@pytest.mark.parametrize(("dtype", "uint"), DTYPES)
@pytest.mark.parametrize("lo", [0, 4096, 3, 1 << 21 | 5])
def test_one_pass_finds_moves_and_writes_what_finding_first_does(tmp_path, dtype, uint, lo):
    rng = np.random.default_rng(lo)
    sizes = [2 * SEG + 777, 3, 0, SEG]
    cases = [(_At(f"t{i}", dtype, n, lo), *_case(rng, uint, n, lo)) for i, n in enumerate(sizes)]
    store = BlockStore(tmp_path / "b")
    one = BlockWriter(store, 1 << 20)
    deltas = HostDeltas(one, batch=SEG)  # small batches: the first slice spans three
    got = [deltas.add(at, old, new) for at, old, new, _ in cases]
    deltas.flush()
    ref = BlockWriter(store, 1 << 20)
    for (at, old, new, pos), d in zip(cases, got, strict=True):
        assert d.pos.tolist() == pos.tolist(), at.name
        assert d.val.dtype == old.dtype and d.val.tolist() == new[pos].tolist()
        assert d.move == shards.interior_move(old, lo, pos, new[pos]), at.name
        assert d.written == shards.write_delta(ref, at, old, pos, new[pos])
    assert [b.id for b in one.close()] == [b.id for b in ref.close()]


def test_an_unchanged_slice_has_no_records_and_no_move(tmp_path):
    w = BlockWriter(BlockStore(tmp_path / "b"), 1 << 16)
    old = np.arange(SEG + 10, dtype=np.uint16)
    deltas = HostDeltas(w)
    d = deltas.add(_At("t", "bfloat16", old.size, 1), old, old.copy())
    deltas.flush()
    assert d.pos.size == 0 and d.move == (0, 0) and d.written == 0 and not w.close()


@pytest.mark.skipif(__import__("chain.codec.aot", fromlist=["status"]).status()["kernels"] != "aot",
                    reason="no compiled kernels here; make install builds them")
def test_a_word_aligned_slice_moves_its_digest_with_the_compiled_kernel(tmp_path):
    """A rank's first publish must not wait on numba's JIT for the digest-move kernel: with the
    kernels built at install, a word-aligned slice takes moved_words' compiled variant."""
    from chain.codec import aot

    rng = np.random.default_rng(7)
    old, new, pos = _case(rng, np.uint16, SEG + 300, 0)
    before = aot.status()["jit_fallbacks"].get("moved_words", 0)
    deltas = HostDeltas(BlockWriter(BlockStore(tmp_path / "b"), 1 << 20))
    d = deltas.add(_At("t", "bfloat16", old.size, 4096), old, new)
    deltas.flush()
    assert d.move == shards.interior_move(old, 4096, pos, new[pos])
    assert aot.status()["jit_fallbacks"].get("moved_words", 0) == before
