"""A pair whose new elements lie in pieces (codec.Pieces: a group's member tensors read where
they are, not copied end to end first) codes exactly what the same elements end to end code:
the same payload bytes, the same changes and the same digest move, for every element width,
pieces of any size (empty ones too) at any address alignment, across segment boundaries,
on the compiled kernels and on the JIT. A payload sent raw takes the elements from `whole`."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chain import lanehash
from chain.codec import aot, api
from chain.codec.api import Pieces, encode_changes
from chain.dtypes import lookup

DTYPES = ["bfloat16", "float32", "float64", "int8", "float16"]


def _new_in_pieces(new: np.ndarray, sizes: list[int], shift: int
                   ) -> tuple[Pieces, list[np.ndarray]]:
    """`new` cut into `sizes`, each piece copied into memory of its own that starts `shift`
    elements into an allocation (so addresses need not be 8-byte aligned)."""
    held, addrs, at = [], [], 0
    for size in sizes:
        home = np.empty(size + shift + 1, new.dtype)
        piece = home[shift:shift + size]
        piece[:] = new[at:at + size]
        held.append(piece)
        addrs.append(piece.__array_interface__["data"][0])
        at += size
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return Pieces(np.array(addrs, np.int64), starts, lambda: np.concatenate(held), held), held


def _pair(dtype: str, n: int, density: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    uint = lookup(dtype).uint
    rng = np.random.default_rng(seed)
    old = rng.integers(0, np.iinfo(uint).max, n, dtype=uint, endpoint=True)
    new = old.copy()
    idx = rng.choice(n, int(n * density), replace=False) if n else np.empty(0, np.int64)
    new[idx] = new[idx] + rng.integers(1, 3, idx.size).astype(uint)
    return old, new


def _same_coding(old: np.ndarray, new: np.ndarray, pieces: Pieces, dtype: str) -> None:
    (want, wc), (got, gc) = encode_changes([(old, new, dtype), (old, pieces, dtype)])
    assert got == want
    assert np.array_equal(gc.pos, wc.pos) and np.array_equal(gc.val, wc.val)
    assert gc.digest == wc.digest


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(DTYPES),
       sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=12),
       shift=st.integers(0, 3), density=st.sampled_from([0.0, 0.001, 0.02, 0.3]),
       seed=st.integers(0, 2**16))
def test_pieces_code_what_the_elements_end_to_end_code(dtype, sizes, shift, density, seed):
    old, new = _pair(dtype, sum(sizes), density, seed)
    pieces, _ = _new_in_pieces(new, sizes, shift)
    _same_coding(old, new, pieces, dtype)


class _MemberMoves:
    """A `Moved` hook summing each piece's own digest move: offered by the encoder's scan
    (`pieces`) or computed from a segment's changes (lanehash.moved_by_groups) when called."""

    def __init__(self, starts: np.ndarray) -> None:
        self.starts = starts
        self.total = np.zeros((starts.size - 1, 2), np.uint64)
        self.offered = self.called = 0

    def __call__(self, pair, lo, old, new, pos, val) -> tuple[int, int]:
        self.called += 1
        self.total += lanehash.moved_by_groups(old, pos, val, self.starts)
        return 0, 0

    def pieces(self, pair: int, first: int, moves: np.ndarray) -> bool:
        self.offered += 1
        self.total[first:first + len(moves)] += moves
        return True


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(["bfloat16", "bfloat16", "float32"]),
       sizes=st.lists(st.integers(0, 700).map(lambda x: 4 * x), min_size=1, max_size=10),
       odd=st.booleans(), shift=st.integers(0, 3), density=st.sampled_from([0.0, 0.01, 0.3]),
       seed=st.integers(0, 2**16))
def test_each_pieces_digest_move_as_the_scan_finds_it(dtype, sizes, odd, shift, density,
                                                      seed):
    """Each piece's own digest move (a member tensor's, chain.lanehash), found by the encoder
    in its scan where the scan's words are the piece's own (2-byte elements, whole words,
    8-byte aligned), else by the caller's hook: the same as moved_by_groups over all the
    changes, either way; and the scan's wherever it can."""
    if odd:
        sizes = [*sizes[:-1], sizes[-1] + 1, 3]  # a last word partial, a piece after it
    old, new = _pair(dtype, sum(sizes), density, seed)
    pieces, _ = _new_in_pieces(new, sizes, shift)
    hook = _MemberMoves(pieces.starts)
    (_, changes), = encode_changes([(old, pieces, dtype)], moved=hook)
    want = lanehash.moved_by_groups(old, changes.pos, changes.val, pieces.starts)
    assert np.array_equal(hook.total, want)
    if dtype == "bfloat16" and not odd and shift == 0 and changes.pos.size:
        assert hook.offered and not hook.called


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_pieces_across_segment_boundaries(dtype):
    """Three segments, pieces straddling both boundaries (one piece spans a whole segment)."""
    seg = 1 << api.LOG2_SEG
    sizes = [seg - 5, 10, 3, seg + 7, 40_001]
    old, new = _pair(dtype, sum(sizes), 0.01, 3)
    pieces, _ = _new_in_pieces(new, sizes, 1)
    _same_coding(old, new, pieces, dtype)


@pytest.mark.parametrize("sizes", [[(1 << api.LOG2_SEG) - 4, 8, (1 << api.LOG2_SEG) + 4, 40_000],
                                   [(1 << api.LOG2_SEG) - 5, 10, 3, 40_001]],
                         ids=["whole-words", "odd"])
def test_piece_moves_across_segment_boundaries(sizes):
    """A piece in two segments gets its move from both, summed: the same as over all changes."""
    old, new = _pair("bfloat16", sum(sizes), 0.3, 4)  # changes in every odd piece
    pieces, _ = _new_in_pieces(new, sizes, 0)
    hook = _MemberMoves(pieces.starts)
    (_, changes), = encode_changes([(old, pieces, "bfloat16")], moved=hook)
    assert np.array_equal(hook.total,
                          lanehash.moved_by_groups(old, changes.pos, changes.val, pieces.starts))
    assert hook.offered + hook.called >= 2 and (hook.called == 0) == (sizes[-1] % 4 == 0)


@pytest.mark.skipif(aot.status()["kernels"] != "aot", reason="no compiled kernels here")
@pytest.mark.parametrize("dtype", DTYPES)
def test_pieces_take_the_compiled_kernel(dtype):
    """Every width's Pieces call runs the kernel compiled at install, not the JIT."""
    old, new = _pair(dtype, 30_000, 0.02, 9)
    pieces, _ = _new_in_pieces(new, [10_000, 20_000], 0)
    before = dict(aot.status()["jit_fallbacks"])
    _same_coding(old, new, pieces, dtype)
    assert aot.status()["jit_fallbacks"] == before, "a Pieces call missed its compiled variant"


def test_pieces_on_the_jit_agree(monkeypatch: pytest.MonkeyPatch):
    """The JIT kernel (what runs where none were compiled) codes the same bytes."""
    old, new = _pair("bfloat16", 50_000, 0.02, 5)
    pieces, _ = _new_in_pieces(new, [20_000, 1, 29_999], 1)
    want = encode_changes([(old, new, "bfloat16")])[0][0]
    monkeypatch.setattr(api.encode_pieces, "_table", {})
    assert encode_changes([(old, pieces, "bfloat16")])[0][0] == want


def test_the_jit_codes_a_read_only_old_both_ways(monkeypatch: pytest.MonkeyPatch):
    """A read-only old (a file's tensors, a kept copy's span) on the JIT kernels, which type
    every branch: the array path and the Pieces path code the same bytes."""
    old, new = _pair("bfloat16", 20_000, 0.02, 7)
    old.flags.writeable = False
    pieces, _ = _new_in_pieces(new, [7_000, 13_000], 0)
    monkeypatch.setattr(api.encode_segment, "_table", {})
    monkeypatch.setattr(api.encode_pieces, "_table", {})
    _same_coding(old, new, pieces, "bfloat16")


def test_a_payload_sent_raw_takes_the_elements_whole():
    """Every element changed by a random value: coded larger than raw, sent raw."""
    rng = np.random.default_rng(0)
    old = rng.integers(0, 2**16, 10_000, dtype=np.uint16)
    new = rng.integers(0, 2**16, 10_000, dtype=np.uint16)
    pieces, _ = _new_in_pieces(new, [4_000, 6_000], 0)
    (want, _), (got, _) = encode_changes([(old, new, "bfloat16"), (old, pieces, "bfloat16")])
    assert got == want
    assert new.tobytes() in got  # raw: the elements themselves follow the header


def test_pieces_that_do_not_fit_are_refused():
    old, new = _pair("bfloat16", 100, 0.1, 1)
    pieces, _ = _new_in_pieces(new, [50, 49], 0)
    with pytest.raises(ValueError, match="old has 100 elements, new has 99"):
        encode_changes([(old, pieces, "bfloat16")])
    with pytest.raises(ValueError, match="one start per address"):
        Pieces(np.array([1], np.int64), np.array([0, 5, 9], np.int64), lambda: new)
    with pytest.raises(ValueError, match="rising from 0"):
        Pieces(np.array([1, 2], np.int64), np.array([0, 5, 3], np.int64), lambda: new)
    with pytest.raises(ValueError, match="no address"):
        Pieces(np.array([0], np.int64), np.array([0, 5], np.int64), lambda: new)
