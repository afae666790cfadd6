"""Group records (chain/stream.py, chain/writer.py, chain/fill.py): runs of small tensors coded
as one payload over their elements end to end. A region applies them bit-exactly on disk and
engine-first; each tensor's digest moves by its own share; what a forged group claims is
refused with the tensor named."""

import itertools
import re
import threading
import time
from types import MappingProxyType

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chain import fill as fill_module
from chain import lanehash
from chain.codec.api import usable_cpus
from chain.decode import decode_patch
from chain.digest import tensor_digest
from chain.errors import BadDelta, DigestMismatch
from chain.fill import Fill, _group_positions, _inside
from chain.safetensors_io import TensorFiles
from chain.sources import StateDictSource, source_digest
from chain.store import ChainStore
from chain.stream import MAX_GROUP, BlockReader, BlockWriter, RecordHeader, encode_header
from chain.tensortable import TensorTable
from chain.versiondir import StoredChanges, read_changes, read_info, write_changes
from chain.weights import WeightsDir
from chain.writer import GROUP_BELOW, GROUP_ELEMENTS, encode_stream, write_artifact
from tests.unit.chain.test_weights import getter, same

UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.lists(st.integers(0, 37), min_size=1, max_size=9),
       st.booleans(), st.data())
def test_one_call_moves_every_members_digest_as_alone(itemsize, sizes, whole, data):
    """Members of any length (not whole words: a member's words count from its own start,
    zero-padded at its end), some unchanged, some empty; `whole`: every member whole 64-bit
    words, which takes the straight-loop kernel."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    uint = UINT[itemsize]
    offsets = _offsets(sizes, itemsize if whole else 8)
    old = rng.integers(0, np.iinfo(uint).max, int(offsets[-1]), dtype=uint, endpoint=True)
    pos = np.flatnonzero(rng.random(old.size) < data.draw(st.floats(0, 1))).astype(np.int64)
    val = rng.integers(0, np.iinfo(uint).max, pos.size, dtype=uint, endpoint=True)
    got = lanehash.moved_by_groups(old, pos, val, offsets)
    for j, (lo, hi) in enumerate(itertools.pairwise(offsets)):
        mine = (pos >= lo) & (pos < hi)
        want = lanehash.moved_by_changes(old[lo:hi].copy(), pos[mine] - lo, val[mine])
        assert (int(got[j, 0]), int(got[j, 1])) == (int(want[0]) & lanehash.M64,
                                                    int(want[1]) & lanehash.M64)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.lists(st.integers(0, 37), min_size=1, max_size=9),
       st.booleans(), st.data())
def test_one_call_writes_every_member_and_moves_its_digest_as_alone(itemsize, sizes, whole, data):
    """pull_put_groups against the per-tensor kernels: pulls, then puts (a put wins where
    both touch an element), each member's move as its own digest would have it; `whole` as
    above."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    uint = UINT[itemsize]
    offsets = _offsets(sizes, itemsize if whole else 8)
    n = int(offsets[-1])

    def some(p: float) -> np.ndarray:
        return np.flatnonzero(rng.random(n) < p).astype(np.int64)

    target = rng.integers(0, np.iinfo(uint).max, n, dtype=uint, endpoint=True)
    source = rng.integers(0, np.iinfo(uint).max, n, dtype=uint, endpoint=True)
    ppos, pos = some(data.draw(st.floats(0, 1))), some(data.draw(st.floats(0, 1)))
    val = rng.integers(0, np.iinfo(uint).max, pos.size, dtype=uint, endpoint=True)
    want = target.copy()
    want[ppos] = source[ppos]
    want[pos] = val
    before = target.copy()
    got = lanehash.moved_by_group_writes(target, source, offsets, ppos, pos, val)
    assert np.array_equal(target, want)
    for j, (lo, hi) in enumerate(itertools.pairwise(offsets)):
        alone = before[lo:hi].copy()
        mine = (ppos >= lo) & (ppos < hi)
        a0, b0 = lanehash.moved_by_pull(alone, source[lo:hi], ppos[mine] - lo)
        mine = (pos >= lo) & (pos < hi)
        a1, b1 = lanehash.moved_by_put(alone, pos[mine] - lo, val[mine])
        assert np.array_equal(alone, want[lo:hi])
        assert (int(got[j, 0]), int(got[j, 1])) == ((int(a0) + int(a1)) & lanehash.M64,
                                                    (int(b0) + int(b1)) & lanehash.M64)


def _offsets(sizes: list[int], itemsize: int) -> np.ndarray:
    """Members' bounds end to end; each size counts words of `itemsize`-byte elements' worth
    of 8 bytes (itemsize 8: elements, any length)."""
    offsets = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum([s * (8 // itemsize) for s in sizes], out=offsets[1:])
    return offsets


def test_members_with_more_changes_than_a_kernel_chunk_move_as_alone():
    """Whole-word members of 20,000 bf16 elements, one with 15,000 changes (several of the
    straight loops' chunks), one with none: both group kernels agree with each member alone,
    and with the general walk the same group takes when its members are not whole words."""
    rng = np.random.default_rng(5)
    offsets = np.array([0, 20_000, 40_000, 60_000], np.int64)
    old = rng.integers(0, 2**16, 60_000, dtype=np.uint16)
    pos = np.concatenate([np.sort(rng.choice(20_000, 15_000, replace=False)),
                          40_000 + np.sort(rng.choice(20_000, 300, replace=False))])
    val = rng.integers(0, 2**16, pos.size, dtype=np.uint16)
    got = lanehash.moved_by_groups(old, pos, val, offsets)
    target = old.copy()
    wrote = lanehash.moved_by_group_writes(target, target.copy(), offsets, pos[:0], pos, val)
    for j, (lo, hi) in enumerate(itertools.pairwise(offsets)):
        mine = (pos >= lo) & (pos < hi)
        want = lanehash.moved_by_changes(old[lo:hi].copy(), pos[mine] - lo, val[mine])
        want = (int(want[0]) & lanehash.M64, int(want[1]) & lanehash.M64)
        assert (int(got[j, 0]), int(got[j, 1])) == want
        assert (int(wrote[j, 0]), int(wrote[j, 1])) == want
    assert tuple(got[1]) == (0, 0)
    ragged = offsets + np.array([0, 1, 1, 0])  # members of 20,001 and 19,999: not whole words
    general = lanehash.moved_by_groups(old, pos, val, ragged)
    mine = pos < 20_001
    want = lanehash.moved_by_changes(old[:20_001].copy(), pos[mine], val[mine])
    assert (int(general[0, 0]), int(general[0, 1])) == (int(want[0]) & lanehash.M64,
                                                        int(want[1]) & lanehash.M64)


def test_positions_past_the_group_are_refused():
    old = np.zeros(8, np.uint16)
    with pytest.raises(ValueError, match="past the group"):
        lanehash.moved_by_groups(old, np.array([8], np.int64), np.ones(1, np.uint16),
                                 np.array([0, 4, 8], np.int64))
    with pytest.raises(ValueError, match="past the group"):
        lanehash.moved_by_group_writes(old, old.copy(), np.array([0, 4, 8], np.int64),
                                       np.array([-1], np.int64), np.empty(0, np.int64),
                                       np.empty(0, np.uint16))


def experts(n: int, rows: int, seed: int) -> dict[str, torch.Tensor]:
    """`n` bf16 expert matrices of `rows` x 64 plus two large tensors and odd ones (fp32,
    int64, empty, a 1-element bias, a tensor whose size is no whole number of words)."""
    g = torch.Generator().manual_seed(seed)
    out = {f"layers.{i // 8}.experts.{i % 8}.w": (torch.randn(rows, 64, generator=g) * 0.02
                                                  ).bfloat16() for i in range(n)}
    out |= {"embed.weight": (torch.randn(2048, 64, generator=g) * 0.02).bfloat16(),
            "layers.0.bias": torch.randn(1, generator=g).bfloat16(),
            "layers.0.odd": torch.randn(7, generator=g).bfloat16(),
            "layers.1.empty": torch.zeros(0, 4).bfloat16(),
            "layers.5.frozen": (torch.randn(400, 256, generator=g) * 0.02).bfloat16(),
            "master.scale": torch.randn(33, generator=g),
            "step.count": torch.arange(5, dtype=torch.int64)}
    return out


def step(state: dict[str, torch.Tensor], seed: int, density: float = 0.01
         ) -> dict[str, torch.Tensor]:
    """About `density` of every float tensor's elements moved by one or two bf16 steps; a few
    tensors left unchanged (one large: no record, a gap between groups)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, t in state.items():
        if not t.is_floating_point() or not t.numel() or k.endswith((".3.w", "frozen")):
            out[k] = t.clone()
            continue
        bits = t.reshape(-1).view(torch.int16 if t.element_size() == 2 else torch.int32).clone()
        mask = torch.rand(bits.shape, generator=g) < density
        bits[mask] += 1 + (torch.rand(int(mask.sum()), generator=g) < 0.3).to(bits.dtype)
        out[k] = bits.view(t.dtype).reshape(t.shape)
    return out


def records(store: ChainStore, m) -> list[RecordHeader]:
    reader = BlockReader.of_blocks(m.blocks, getter(store))
    out = []
    while (h := reader.next_header()) is not None:
        reader.skip(h.n)
        out.append(h)
    return out


def chain_of(tmp_path, key, states, source=StateDictSource, **kw) -> tuple[ChainStore, list]:
    store = ChainStore(tmp_path / "chain", key.public_key())
    m, _ = write_artifact(store.blocks, key, run="r", version=0, kind="snapshot",
                          new=StateDictSource(states[0]))
    store.add(m)
    ms = [m]
    for v in range(1, len(states)):
        m, _ = write_artifact(store.blocks, key, run="r", version=v, kind="delta",
                              new=source(states[v]),
                              parent=StateDictSource(states[v - 1]), parent_manifest=ms[-1],
                              trust_parent=True, **kw)
        store.add(m)
        ms.append(m)
    return store, ms


def at_v1(tmp_path, key, first: dict[str, torch.Tensor], seed: int
          ) -> tuple[ChainStore, list, WeightsDir]:
    """A chain of `first` and two steps of it, and a region's weights applied up to v1."""
    states = [first, step(first, seed), step(step(first, seed), seed + 1)]
    store, ms = chain_of(tmp_path, key, states)
    w = WeightsDir(tmp_path / "w")
    w.apply(store.plan(None, 1), getter(store))
    return store, ms, w


def apply_each(path, store: ChainStore, ms: list, versions: tuple[int, ...]):
    """A region's weights at `path` applied to v1, then to each of `versions` in turn, each
    on its published state digest and verified from disk; the last version's state."""
    w = WeightsDir(path)
    w.apply(store.plan(None, 1), getter(store))
    for v in versions:
        cur = w.apply(store.plan(w.current().version, v), getter(store))
        assert cur.version == v and cur.state_digest == ms[v].state_digest
        assert w.verify().version == v
    return cur


class _OneAtATime(StateDictSource):
    """A state dict read one tensor at a time: the source without `cat`."""

    cat = None


class _Copied(StateDictSource):
    """A state dict whose groups are copied end to end (`cat`), never read in place."""

    pieces = None


@pytest.mark.parametrize("trust", [True, False], ids=["moved", "hashed"])
def test_groups_read_in_one_call_write_the_same_artifact_as_one_tensor_at_a_time(
        tmp_path, signing_key, trust):
    """A torch source hands the writer each group where its members lie (StateDictSource.
    pieces: read in place, an empty member among them) or, with members hashed or not
    contiguous, its new elements end to end in one call (StateDictSource.cat), the members'
    own views cut from them where they are hashed: the same records, blocks and digests as
    copying every group and as reading each tensor's bits, on tensors that are not
    contiguous, need grad, or sit among ones that do not group, from a dict or any other
    mapping."""
    first = experts(300, 15, 4)
    first["layers.2.experts.1.w"] = first["layers.2.experts.1.w"].t().contiguous().t()
    second = step(first, 9)
    second["layers.3.experts.2.w"].requires_grad_(True)
    second["layers.2.experts.5.w"] = second["layers.2.experts.5.w"].t().contiguous().t()
    ms = []
    for name, source in (("placed", StateDictSource), ("cat", _Copied), ("each", _OneAtATime),
                         ("mapping", lambda s: StateDictSource(MappingProxyType(s)))):
        store = ChainStore(tmp_path / name / "chain", signing_key.public_key())
        base, _ = write_artifact(store.blocks, signing_key, run="r", version=0, kind="snapshot",
                                 new=StateDictSource(first))
        m, _ = write_artifact(store.blocks, signing_key, run="r", version=1, kind="delta",
                              new=source(second), parent=StateDictSource(first),
                              parent_manifest=base, trust_parent=trust)
        ms.append((m, [h for h in records(store, m)],
                   b"".join(store.blocks.get(b.id, b.size) for b in m.blocks)))
    (m, heads, raw), *others = ms
    assert any(h.op == "group" for h in heads)
    for m_other, heads_other, raw_other in others:
        assert m.tensors.digest_map() == m_other.tensors.digest_map()
        assert m.state_digest == m_other.state_digest == source_digest(StateDictSource(second))
        assert heads == heads_other and raw == raw_other


def test_a_steady_delta_is_its_parents_table_with_every_digest_moved(tmp_path, signing_key,
                                                                     monkeypatch):
    """A delta in its parent's layout with the parent's digests trusted (a trainer's usual
    version) is the parent's table with each digest moved (TensorTable.moved), never built
    again from columns; each digest still equals the new tensor's hashed, including runs of
    empty tensors grouped with no segment to code. A version that reshapes one tensor builds
    its table from columns, and is as right (that empty group's digests crashed it once)."""
    built: list[int] = []
    real = TensorTable.from_columns.__func__

    def counting(cls, names, *rest):
        built.append(len(names))
        return real(cls, names, *rest)

    monkeypatch.setattr(TensorTable, "from_columns", classmethod(counting))
    # batches of ~20,000 elements: the model's ~0.5 M elements in many flushes, so each
    # tensor's index in the table is found across batch edges, as in a model of GB
    monkeypatch.setattr("chain.writer.BATCH_ELEMENTS", 20_000)
    first = experts(300, 15, 5) | {f"layers.6.none.{i}": torch.zeros(0, dtype=torch.int8)
                                   for i in range(5)}  # a group of its own, no segment
    states = [first, step(first, 11), step(step(first, 11), 12)]
    reshaped = dict(step(states[-1], 13))
    reshaped["layers.0.odd"] = torch.randn(8).bfloat16()
    states.append(reshaped)
    store, ms = chain_of(tmp_path, signing_key, states)
    assert built == [len(first)] * 2  # the snapshot and the reshaping version: no steady delta
    for state, m in zip(states, ms, strict=True):
        src = StateDictSource(state)
        assert m.tensors.digest_map() == {n: tensor_digest(*src.meta(n), src.bits(n))
                                          for n in state}
        assert m.state_digest == source_digest(src)
    assert ms[1].tensors.shares_layout(ms[0].tensors)
    apply_each(tmp_path / "w", store, ms, (2, 3))


def test_a_delta_with_its_digests_given_reports_each_members_changes(tmp_path):
    """Digests given (no parent digests moved): groups read in place still report each
    member's own changes, which turn the parent's bits into the new ones."""
    first = experts(120, 15, 2)
    second = step(first, 3)
    given = {n: tensor_digest(*StateDictSource(second).meta(n), StateDictSource(second).bits(n))
             for n in second}
    seen: dict = {}
    table, _ = encode_stream(BlockWriter(ChainStore(tmp_path / "c").blocks),
                             StateDictSource(second), StateDictSource(first), "delta",
                             digests=given, on_changes=seen.__setitem__)
    assert table.digest_map() == given and set(seen) == set(second)
    grouped = 0
    for name, c in seen.items():
        if c is None:
            continue
        bits = StateDictSource(first).bits(name).copy()
        bits[c.pos] = c.val
        assert np.array_equal(bits, StateDictSource(second).bits(name)), name
        grouped += second[name].numel() < GROUP_BELOW and c.pos.size > 0
    assert grouped > 100


def test_a_group_reported_at_once_is_its_members_changes_end_to_end(tmp_path, signing_key):
    """`on_group` gets a group record's members with their offsets and the group's changes in
    their elements end to end: cut at the offsets, exactly what `on_changes` reports member
    by member when no `on_group` is given; a tensor coded alone still goes to `on_changes`."""
    first = experts(200, 12, 4)
    first["big.w"] = torch.randn(300, 300).to(torch.bfloat16)  # over GROUP_BELOW: alone
    second = step(first, 5)
    store = ChainStore(tmp_path / "chain", signing_key.public_key())
    base, _ = write_artifact(store.blocks, signing_key, run="r", version=0, kind="snapshot",
                             new=StateDictSource(first))
    seen: dict[str, dict] = {"each": {}, "whole": {}}
    groups = []
    for how in ("each", "whole"):
        write_artifact(store.blocks, signing_key, run="r", version=1, kind="delta",
                       new=StateDictSource(second), parent=StateDictSource(first),
                       parent_manifest=base, trust_parent=True,
                       on_changes=seen[how].__setitem__,
                       on_group=None if how == "each" else lambda *g: groups.append(g),
                       group_below=70_000)
    grouped = {n for names, _, _ in groups for n in names}
    assert {f"layers.{i // 8}.experts.{i % 8}.w" for i in range(200)} <= grouped
    assert "big.w" in seen["whole"] and set(seen["whole"]) == set(second) - grouped
    for names, offsets, c in groups:
        assert offsets[0] == 0 and offsets[-1] == sum(second[n].numel() for n in names)
        for j, name in enumerate(names):
            inside = (c.pos >= offsets[j]) & (c.pos < offsets[j + 1])
            assert np.array_equal(c.pos[inside] - offsets[j], seen["each"][name].pos)
            assert np.array_equal(c.val[inside], seen["each"][name].val)
    for name, c in seen["whole"].items():
        assert np.array_equal(c.pos, seen["each"][name].pos)


def test_group_members_the_parent_manifest_lacks_are_hashed_and_the_rest_moved(
        tmp_path, signing_key):
    """A trusted parent whose manifest does not list some tensors its source holds (they
    group with the others): those members' digests are hashed, the rest moved, all equal to
    hashing the new state."""
    first = experts(40, 15, 6)
    second = step(first, 7)
    store = ChainStore(tmp_path / "chain", signing_key.public_key())
    lacking = {f"layers.{i // 8}.experts.{i % 8}.w" for i in (3, 4, 17)}
    base, _ = write_artifact(store.blocks, signing_key, run="r", version=0, kind="snapshot",
                             new=StateDictSource({k: v for k, v in first.items()
                                                  if k not in lacking}))
    m, _ = write_artifact(store.blocks, signing_key, run="r", version=1, kind="delta",
                          new=StateDictSource(second), parent=StateDictSource(first),
                          parent_manifest=base, trust_parent=True)
    grouped = [h for h in records(store, m) if h.op == "group"]
    assert grouped and sum(h.count for h in grouped) >= 40
    assert m.state_digest == source_digest(StateDictSource(second))


@pytest.mark.parametrize("torch_flatten", [True, False], ids=["flatten", "without"])
def test_a_sources_cat_is_its_tensors_bits_end_to_end_in_a_new_array(monkeypatch,
                                                                     torch_flatten):
    """With torch's flatten, or on a torch without it (not public API: a cat instead)."""
    if not torch_flatten:
        monkeypatch.delattr(torch._utils, "_flatten_dense_tensors")
    state = {"a": torch.randn(3, 4).bfloat16(), "b": torch.randn(5).bfloat16().requires_grad_(),
             "c": torch.randn(4, 3).bfloat16().t()}
    src = StateDictSource(state)
    both = src.cat(["a", "b", "c"])
    assert np.array_equal(both, np.concatenate([src.bits(n) for n in "abc"]))
    one = src.cat(["a"])
    one[0] ^= 1  # a copy: the state is not written
    assert not np.shares_memory(one, src.bits("a")) and one[0] != src.bits("a")[0]


@pytest.mark.parametrize("source", ["placed", "copied"])
def test_a_member_word_across_a_segment_edge_moves_by_all_its_changes(tmp_path, signing_key,
                                                                      source):
    """A 7-element tensor first, so every member after it starts mid-word: the member word
    at group element 2^20 (a codec segment's edge) changes on both sides. Its digest moves by
    both changes at once (each side's move alone, summed, is another digest): the group's
    digests equal per-tensor records, and a region applies it."""
    g = torch.Generator().manual_seed(8)
    first = {"layers.0.a": torch.randn(7, generator=g).bfloat16()}
    first |= {f"layers.0.b{i:02d}": (torch.randn(65_532, generator=g) * 0.02).bfloat16()
              for i in range(20)}
    second = step(first, 3)
    edge = 1 << 20
    for at in (edge - 1, edge):  # group positions: member j from 7 + 65,532 j
        j, k = divmod(at - 7, 65_532)
        bits = second[f"layers.0.b{j:02d}"].view(torch.int16)
        bits[k] = bits[k] + 3
    store, ms = chain_of(tmp_path / "g", signing_key, [first, second],
                         source=_Copied if source == "copied" else StateDictSource)
    _, pms = chain_of(tmp_path / "p", signing_key, [first, second], group_below=0)
    assert [h.count for h in records(store, ms[1]) if h.op == "group"] == [21]
    assert ms[1].tensors.digest_map() == pms[1].tensors.digest_map()
    w = WeightsDir(tmp_path / "w")
    assert w.apply(store.plan(None, 1), getter(store)).state_digest == ms[1].state_digest


def test_a_large_group_below_still_makes_groups_a_reader_takes(tmp_path, signing_key):
    """group_below up to the trainer's 2^20: members of 600,000 elements, seven of which pass
    MAX_GROUP, make groups within it that apply."""
    g = torch.Generator().manual_seed(6)
    first = {f"layers.{i}.w": (torch.randn(600_000, generator=g) * 0.02).bfloat16()
             for i in range(9)}
    store, ms = chain_of(tmp_path, signing_key, [first, step(first, 2)], group_below=1 << 20)
    counts = [h.count for h in records(store, ms[1]) if h.op == "group"]
    assert counts and max(counts) * 600_000 <= MAX_GROUP and sum(counts) == 9
    w = WeightsDir(tmp_path / "w")
    assert w.apply(store.plan(None, 1), getter(store)).state_digest == ms[1].state_digest


def test_groups_fill_up_to_what_a_reader_takes_and_no_further(tmp_path, signing_key):
    """Members just under GROUP_BELOW: each group ends past GROUP_ELEMENTS but within the
    reader's limit (stream.MAX_GROUP, which chain.fill refuses beyond), and applies."""
    n = GROUP_BELOW - 1
    g = torch.Generator().manual_seed(5)
    first = {f"layers.{i // 8}.experts.{i % 8}.w": (torch.randn(n, generator=g) * 0.02
                                                    ).bfloat16() for i in range(140)}
    states = [first, step(first, 1)]
    store, ms = chain_of(tmp_path, signing_key, states)
    counts = [h.count for h in records(store, ms[1]) if h.op == "group"]
    assert len(counts) >= 2 and sum(counts) == 140
    assert all(GROUP_ELEMENTS <= c * n <= MAX_GROUP for c in counts[:-1])
    w = WeightsDir(tmp_path / "w")
    cur = w.apply(store.plan(None, 1), getter(store))
    assert cur.state_digest == ms[1].state_digest and w.verify().version == 1


@pytest.mark.parametrize("direct", [-1, 1000], ids=["ranks", "direct-positions"])
def test_small_tensors_travel_in_groups_and_apply_bit_exactly(tmp_path, signing_key,
                                                              monkeypatch, direct):
    """600 experts of 960 elements: a few group records instead of ~600 records; digests equal
    those of per-tensor records (moved from the parent, not hashed); applied on disk, in
    batches that never end inside a group, to the exact weights."""
    monkeypatch.setattr("chain.fill.BATCH", 1 << 14)  # batches end often
    states = [experts(600, 15, 0)]
    for v in (1, 2, 3):
        states.append(step(states[-1], v))
    store, ms = chain_of(tmp_path / "g", signing_key, states, direct_positions=direct)
    plain, pms = chain_of(tmp_path / "p", signing_key, states, direct_positions=direct,
                          group_below=0)
    for m, pm in zip(ms[1:], pms[1:], strict=True):
        assert m.tensors.digest_map() == pm.tensors.digest_map()
        assert m.state_digest == pm.state_digest
        hs = records(store, m)
        groups = [h for h in hs if h.op == "group"]
        assert groups and sum(h.count for h in groups) >= 600
        assert len(hs) < 20 and all(h.op == "delta" for h in records(plain, pm)[:3])
        assert max(h.count for h in groups) * 960 <= GROUP_ELEMENTS + 960
    calls: list[bool] = []  # one per group written as one: brought forward or not
    real = lanehash.moved_by_group_writes

    def spy(target, source, offsets, ppos, pos, val):
        calls.append(bool(ppos.size))
        return real(target, source, offsets, ppos, pos, val)

    monkeypatch.setattr(lanehash, "moved_by_group_writes", spy)
    repaired: list[int] = []  # tensors a fill brought forward wrongly and copied whole
    real_run = Fill.run

    def run(self, *args, **kwargs):
        try:
            return real_run(self, *args, **kwargs)
        finally:
            repaired.append(self.repaired)

    monkeypatch.setattr(Fill, "run", run)
    cur = apply_each(tmp_path / "w", store, ms, (2, 3))
    assert True in calls and False in calls
    # each member's CHANGES positions (cut from its group's) brought the spare forward
    assert repaired and sum(repaired) == 0
    from safetensors.torch import load_file

    assert same(load_file(cur.path / "model.safetensors"), states[3])


def _grouped_member(store: ChainStore, m) -> str:
    """A tensor a group record of `m` covers, not its first (one the fill never reads alone)."""
    names = m.tensors.names()
    h = next(h for h in records(store, m) if h.op == "group" and h.count > 2)
    return names[names.index(h.name) + 1]


def _at_v2_of_three(tmp_path, key) -> tuple[list, ChainStore, list, WeightsDir]:
    """600 experts and three deltas; a region at v2 holding v1 as its spare."""
    states = [experts(600, 15, 0)]
    for v in (1, 2, 3):
        states.append(step(states[-1], v))
    store, ms = chain_of(tmp_path / "g", key, states)
    w = WeightsDir(tmp_path / "w")
    w.apply(store.plan(None, 2), getter(store))
    return states, store, ms, w


def _with_wrong_digest(m, name: str, key):
    """`m` signed again with tensor `name`'s digest changed (its records left as they are)."""
    rows = m.tensors.as_dicts()
    row = next(r for r in rows if r["name"] == name)
    row["digest"] = ("1" if row["digest"][0] == "0" else "0") + row["digest"][1:]
    table = TensorTable.of(rows)
    fields = {k: getattr(m, k) for k in type(m).model_fields}
    return type(m)(**(fields | {"tensors": table, "state_digest": table.state_digest(),
                                "signature": None})).signed(key)


def _refused(w: WeightsDir, store: ChainStore, bad, member: str) -> list[str]:
    """Apply `bad` on `w` (at v2), which must stop naming `member` with v2 still current and
    whole; the tensors its staging directory's journal lists."""
    with pytest.raises(DigestMismatch, match=f"tensor {re.escape(member)} of"):
        w.apply([bad], getter(store))
    assert w.current().version == 2 and w.verify().version == 2
    (staging,) = w.staging()
    return (staging / "JOURNAL").read_text().split()


def _member_expansions(monkeypatch) -> list[int]:
    """A list that gets each group's member count as the fill writes it member by member
    (Fill._members), from now on."""
    expanded: list[int] = []
    real = Fill._members

    def members(self, unit):
        expanded.append(unit.count)
        return real(self, unit)

    monkeypatch.setattr(Fill, "_members", members)
    return expanded


def test_a_group_brought_forward_in_part_is_written_member_by_member(tmp_path, signing_key,
                                                                      monkeypatch):
    """One member's step in CHANGES says "whole" (no positions): the group can be neither
    brought forward nor copied as one, so the fill hands it back as members (Fill._members),
    which write the same weights: that member copied from current, the rest brought forward."""
    states, store, ms, w = _at_v2_of_three(tmp_path, signing_key)
    assert w.versions() == [1, 2]  # v1 is the spare v3 brings forward over v2's CHANGES
    member = _grouped_member(store, ms[3])
    changes = dict(read_changes(w.path(2), 2))
    assert changes[member] is not None and changes[member].size
    changes[member] = None
    write_changes(w.path(2), 2, changes)
    expanded = _member_expansions(monkeypatch)
    cur = w.apply([ms[3]], getter(store))
    assert expanded, "no group was handed back as members"
    assert cur.version == 3 and w.verify().version == 3
    from safetensors.torch import load_file

    assert same(load_file(cur.path / "model.safetensors"), states[3])


def test_a_group_whose_parents_are_not_back_to_back_decodes_from_a_copy(tmp_path,
                                                                        signing_key):
    """v2 drops a tensor that lay between two of a group's tensors in v1: in current (v1)
    the group's parents are no longer one run, so it decodes against a copy of them made
    tensor by tensor (by place in the table, a group read as one having no members) and is
    written member by member, bit-exactly."""
    states = [experts(600, 15, 0)]
    states.append(step(states[0], 1))
    names = sorted(n for n in states[1] if ".experts." in n)
    gone = names[len(names) // 2]
    states.append({k: t for k, t in step(states[1], 2).items() if k != gone})
    store, ms = chain_of(tmp_path / "g", signing_key, states)
    assert ms[2].kind == "delta" and gone not in ms[2].tensors.names()
    after = ms[2].tensors.names()
    around = (after[after.index(names[len(names) // 2 - 1])],
              after[after.index(names[len(names) // 2 - 1]) + 1])
    covered = []
    for h in records(store, ms[2]):
        if h.op == "group":
            first = after.index(h.name)
            covered.append(set(after[first:first + h.count]))
    assert any(set(around) <= c for c in covered), "the test needs a group across the gap"
    w = WeightsDir(tmp_path / "w")
    w.apply(store.plan(None, 1), getter(store))
    cur = w.apply([ms[2]], getter(store))
    assert cur.version == 2 and w.verify().version == 2
    from safetensors.torch import load_file

    assert same(load_file(cur.path / "model.safetensors"), states[2])


def test_a_group_member_that_misses_its_digest_is_named_and_nothing_applied(tmp_path,
                                                                           signing_key):
    """A signed manifest whose digest for one grouped tensor is not what its records make:
    the group brought forward misses it, is copied whole from current and still misses it.
    The apply stops naming that tensor, current stays, and the members verified before it
    stay journaled for the retry."""
    _, store, ms, w = _at_v2_of_three(tmp_path, signing_key)
    member = _grouped_member(store, ms[3])
    journaled = _refused(w, store, _with_wrong_digest(ms[3], member, signing_key), member)
    names = ms[3].tensors.names()
    assert member not in journaled
    assert names[names.index(member) - 1] in journaled  # the group's first, verified before


def test_groups_decode_engine_first_over_pending_patches(tmp_path, signing_key):
    """The region's engine-first decode: v2 and v3 decoded over the disk's v1 with v2's patch
    laid over it (the parent elements a group is coded against come overlaid)."""
    states = [experts(300, 15, 1)]
    for v in (1, 2, 3):
        states.append(step(states[-1], 10 + v, density=0.05))
    store, ms = chain_of(tmp_path, signing_key, states)
    assert any(h.op == "group" for h in records(store, ms[2]))
    w = WeightsDir(tmp_path / "w")
    cur = w.apply(store.plan(None, 1), getter(store))
    files, digests = TensorFiles(cur.path), read_info(cur.path).tensors
    patches: list = []
    for v in (2, 3):
        patches.append(decode_patch(ms[v], files, 1, digests, patches, getter(store)))
    state = {k: t.clone() for k, t in states[1].items()}
    for p in patches:
        for t in p.tensors:
            flat = state[t.name].reshape(-1)
            bits = flat.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[
                flat.element_size()])
            bits[torch.from_numpy(t.indices)] = torch.from_numpy(t.values.view(
                bits.numpy().dtype))
        assert same(state, states[p.version])


def forged(store: ChainStore, m, key, edit) -> object:
    """`m` with its records rewritten by `edit(records, m) -> [(header, payload)]`, re-signed."""
    reader = BlockReader.of_blocks(m.blocks, getter(store))
    recs = []
    while (h := reader.next_header()) is not None:
        recs.append((h, reader.read(h.n)))
    w = BlockWriter(store.blocks)
    for h, payload in edit(recs, m):
        w.write(encode_header(h))
        w.write(payload)
    fields = {k: getattr(m, k) for k in type(m).model_fields}
    return type(m)(**(fields | {"blocks": w.close(), "signature": None})).signed(key)


def _regroup(count, last: bool = False):
    """The first (last) group record's tensor count rewritten by `count(header)`."""
    def edit(recs, m):
        groups = [i for i, (h, _) in enumerate(recs) if h.op == "group"]
        first = groups[-1 if last else 0]
        return [(h._replace(count=count(h)) if i == first else h, p)
                for i, (h, p) in enumerate(recs)]
    return edit


def _own_record_too(empty: bool):
    """The first group's first tensor also gets a delta record of its own, right after: a
    whole one, or one covering no element (harmless, but a group's tensors have no other)."""
    def edit(recs, m):
        shapes = {t.name: list(t.shape) for t in m.tensors}
        out, done = [], False
        for h, p in recs:
            out.append((h, p))
            if h.op == "group" and not done:
                out.append((h._replace(op="delta", shape=shapes[h.name], at=0 if empty else None,
                                       count=0 if empty else None), p))
                done = True
        return out
    return edit


@pytest.mark.parametrize("edit,match", [
    (_regroup(lambda h: h.count + 50), r"experts\.\d+\.w has both a group record and another"),
    (_regroup(lambda h: 10**6), "covers 1000000 tensors, past the last of"),
    (_regroup(lambda h: h.count - 1), r"is coded over \d+ elements; they hold"),
    (_regroup(lambda h: h.count + 1), r"is coded over \d+ elements; they hold"),
    (_own_record_too(empty=False), "has both a group record and another record"),
    (_own_record_too(empty=True), "has both a group record and another record"),
], ids=["into-the-next-group", "past-the-table", "one-short", "one-over",
        "member-with-own-record", "member-with-empty-record"])
def test_forged_groups_are_refused_and_nothing_is_applied(tmp_path, signing_key, edit, match):
    """1,200 experts: two groups with an unchanged large tensor between them."""
    store, ms, w = at_v1(tmp_path, signing_key, experts(1200, 15, 2), 21)
    bad = forged(store, ms[2], signing_key, edit)
    with pytest.raises(BadDelta, match=match):
        w.apply([bad], getter(store))
    assert w.current().version == 1 and w.verify().version == 1


def test_a_group_header_with_other_flags_is_refused():
    h = RecordHeader("a", "group", "bfloat16", [], 5, None, 3)
    raw = bytearray(encode_header(h))
    raw[8] |= 1  # group and full at once
    reader = BlockReader([bytes(raw) + b"\0" * 5])
    with pytest.raises(BadDelta, match="unknown flags"):
        reader.next_header()
    assert BlockReader([encode_header(h) + b"\0" * 5]).next_header() == h


def test_a_group_past_the_limit_or_the_last_tensor_is_refused(tmp_path, signing_key,
                                                              monkeypatch):
    full = experts(64, 15, 3)
    store, ms, w = at_v1(tmp_path, signing_key, full, 31)
    monkeypatch.setattr("chain.fill.MAX_GROUP", 2000)
    with pytest.raises(BadDelta, match="covers more than 2000 elements"):
        w.apply([ms[2]], getter(store))
    monkeypatch.undo()
    only_bf16 = {k: t for k, t in full.items() if t.dtype == torch.bfloat16}
    store, ms, w = at_v1(tmp_path / "b", signing_key, only_bf16, 33)
    bad = forged(store, ms[2], signing_key, _regroup(lambda h: h.count + 10**6, last=True))
    with pytest.raises(BadDelta, match="past the last of"):
        w.apply([bad], getter(store))
    assert w.current().version == 1 and w.verify().version == 1


@pytest.mark.parametrize("below,grouped", [(0, False), (1 << 16, True)])
def test_a_publisher_groups_or_not_as_told(tmp_path, below, grouped):
    """`group_below=0`: one record a tensor, what regions from before group records read."""
    from chain import keys
    from trainer.publisher import Publisher

    keys.generate(tmp_path / "k")
    pub = Publisher(tmp_path / "chain", tmp_path / "k", run="r", group_below=below)
    states = [experts(40, 15, 4)]
    states.append(step(states[-1], 41))
    for v, s in enumerate(states):
        out = pub.publish(v, s)
    ops = {h.op for h in records(pub.store, out.delta)}
    assert ("group" in ops) == grouped and "delta" in ops


def test_a_group_payload_larger_than_its_tensors_could_need_is_refused_unread(tmp_path,
                                                                              signing_key):
    """The size bound comes from the tensors the record claims (not the largest group any
    record could claim), checked before the payload is read."""
    store, ms, w = at_v1(tmp_path, signing_key, experts(64, 15, 5), 51)

    def padded(recs, m):
        first = next(i for i, (h, _) in enumerate(recs) if h.op == "group")
        h, p = recs[first]
        big = bytes(p) + bytes(8 * 2 * 15 * 64 * h.count + (1 << 20))
        return [*recs[:first], (h._replace(n=len(big)), big), *recs[first + 1:]]

    bad = forged(store, ms[2], signing_key, padded)
    with pytest.raises(BadDelta, match=r"is implausibly large \(\d+ bytes for \d+ elements"):
        w.apply([bad], getter(store))
    assert w.current().version == 1 and w.verify().version == 1


def test_the_trainer_configs_default_is_the_writers():
    from chain import writer
    from trainer import config

    assert config.GROUP_BELOW == writer.GROUP_BELOW


def test_a_grouped_apply_and_decode_leave_no_cycles_for_the_collector(tmp_path, signing_key):
    """A group and its members refer to each other; the passes unlink them as each batch
    ends, so reference counting frees a batch: left to the cyclic collector, a 50,000-tensor
    apply left ~450,000 objects that one collection took 0.2 s to free, every version."""
    import gc

    from chain.fill import _Group, _Item

    states = [experts(400, 15, 2)]
    for v in (1, 2):
        states.append(step(states[-1], 20 + v))
    store, ms = chain_of(tmp_path, signing_key, states)
    assert any(h.op == "group" for h in records(store, ms[2]))
    w = WeightsDir(tmp_path / "w")
    v1 = w.apply(store.plan(None, 1), getter(store))
    files, digests = TensorFiles(v1.path), read_info(v1.path).tensors
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds is kept in gc.garbage
    try:
        patch = decode_patch(ms[2], files, 1, digests, [], getter(store))
        cur = w.apply(store.plan(1, 2), getter(store))
        gc.collect()
        left = sum(isinstance(o, (_Item, _Group)) for o in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if enabled:
            gc.enable()
    assert patch.version == 2 and cur.version == 2
    assert left == 0


@pytest.mark.parametrize("source, trim, in_scan", [
    ("placed", 0, True), ("placed", 1, False), ("copied", 0, False)],
    ids=["placed", "placed-odd-members", "copied"])
def test_group_digests_moved_in_the_scan_or_on_the_codec_threads_equal_per_tensor_records(
        tmp_path, signing_key, monkeypatch, source, trim, in_scan):
    """Enough changes that the writer moves the groups' member digests where the coding runs:
    in the encoder's own scan where it reads members in place whose words are their own
    (kernels._find_rank_pieces: lanehash.moved_by_groups is never called), else by
    moved_by_groups on the codec's threads (members of 2,047 elements: a member's last word
    is partial and the next one's words are not the scan's; a group copied end to end). Each
    equals the digest of the tensor in its own record."""
    import threading

    from chain.codec.api import usable_cpus

    threads: list[str] = []
    real = lanehash.moved_by_groups

    def spy(old, pos, val, offsets):
        threads.append(threading.current_thread().name)
        return real(old, pos, val, offsets)

    monkeypatch.setattr(lanehash, "moved_by_groups", spy)
    # the experts alone: a small tensor of odd size grouped among them would shift the words
    # of the members after it (the placed-odd-members case)
    first = {k: t.reshape(-1)[:t.numel() - trim].clone() if trim else t
             for k, t in experts(600, 32, 3).items() if ".experts." in k}
    states = [first, step(first, 30, density=0.3)]
    store, ms = chain_of(tmp_path / "g", signing_key, states,
                         source=_Copied if source == "copied" else StateDictSource)
    _, pms = chain_of(tmp_path / "p", signing_key, states, group_below=0)
    assert sum(h.count for h in records(store, ms[1]) if h.op == "group") >= 600
    assert ms[1].tensors.digest_map() == pms[1].tensors.digest_map()
    assert ms[1].state_digest == pms[1].state_digest
    if in_scan:
        assert threads == []
    elif usable_cpus() >= 2:
        assert any(t.startswith("codec") for t in threads)
    else:
        assert threads


@settings(deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.lists(st.integers(0, 45), max_size=12)),
                min_size=2, max_size=8))
def test_a_groups_step_positions_are_its_members_cut_and_moved(members):
    """A group brought forward reads each member's CHANGES positions in the group's positions,
    positions past their member dropped (a damaged file's stray one would land in the next
    member): the array form equals the per-member one. (Negative or unsorted positions never
    get here: reading CHANGES refuses them, tests/unit/chain/test_versiondir.py.)"""
    numels = [n for n, _ in members]
    parts = [np.array(sorted(set(p)), np.int64) for _, p in members]
    offsets = np.zeros(len(numels) + 1, np.int64)
    np.cumsum(numels, out=offsets[1:])
    want = np.concatenate([_inside(p, n)[_inside(p, n) >= 0] + off for p, n, off in
                           zip(parts, numels, offsets[:-1].tolist(), strict=True)])
    names = [f"t{k:03d}" for k in range(len(parts))]
    # the members as one run of the step, and with another tensor between two of them (the
    # step then gives them one by one)
    runs = {"run": StoredChanges(names, [p.size for p in parts], np.concatenate(parts))}
    if len(names) > 1:
        split = [names[0], names[0] + "x", *names[1:]]
        runs["interleaved"] = StoredChanges(
            split, [parts[0].size, 3, *[p.size for p in parts[1:]]],
            np.concatenate([parts[0], np.array([0, 1, 2], np.int64), *parts[1:]]))
    for step in runs.values():
        got = _group_positions(step, names, offsets)
        assert got.dtype == np.int64 and np.array_equal(got, want)
        assert np.all(np.diff(got) > 0)


@pytest.mark.parametrize("edit", [_own_record_too(empty=False), _regroup(lambda h: h.count - 1)],
                         ids=["member-with-own-record", "one-short"])
def test_a_refused_stream_leaves_no_cycles_for_the_collector(tmp_path, signing_key, edit):
    """A forged record stream refused part way (while reading a group's members, or when its
    group decodes): the groups read so far are unlinked from their members as the error
    leaves the pass, as after a batch."""
    import gc

    from chain.fill import _Group, _GroupUnit, _Item

    store, ms, w = at_v1(tmp_path, signing_key, experts(1200, 15, 2), 21)
    bad = forged(store, ms[2], signing_key, edit)
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        with pytest.raises(BadDelta):
            w.apply([bad], getter(store))
        gc.collect()
        left = sum(isinstance(o, (_Item, _Group, _GroupUnit)) for o in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if enabled:
            gc.enable()
    assert left == 0


def test_groups_brought_forward_in_a_directory_of_several_shard_files(tmp_path, signing_key,
                                                                      monkeypatch):
    """A region's directories split over several files (a model past SHARD_BYTES; here the
    shard size is cut to ~40 KB so 600 experts make many files): the fill's columns break runs
    at file boundaries, a group crossing one is written member by member, and every version
    is bit-exact. A one-file directory never takes these paths."""
    import functools

    from chain import safetensors_io, weights

    monkeypatch.setattr(weights, "layout",
                        functools.partial(safetensors_io.layout, shard_bytes=40_000))
    states = [experts(600, 15, 0)]
    for v in (1, 2, 3):
        states.append(step(states[-1], v))
    store, ms = chain_of(tmp_path / "g", signing_key, states)
    expanded = _member_expansions(monkeypatch)
    cur = apply_each(tmp_path / "w", store, ms, (2, 3))
    assert len(list(cur.path.glob("*.safetensors"))) > 5
    assert expanded, "no group crossed a file boundary"
    from safetensors.torch import load_file

    got = {}
    for f in cur.path.glob("*.safetensors"):
        got.update(load_file(f))
    assert same(got, states[3])


def test_batches_coded_while_the_one_before_is_written_make_the_same_artifact(
        tmp_path, signing_key, monkeypatch):
    """The writer codes each batch on the codec's worker thread while it writes the batch
    before and walks to the next (`chain.writer.PIPELINE`): the same records, blocks, digests
    and reported changes as one batch at a time, over batches large enough that the worker
    takes part (two segments each), for a steady delta (its table the parent's with each
    digest moved at its row) and one adding a tensor, with digests moved or hashed: groups,
    tensors coded alone, a full record and tensors that do not change."""
    monkeypatch.setattr("chain.writer.BATCH_ELEMENTS", 1 << 21)
    first = experts(3000, 64, 21)
    states = [first, step(first, 22), step(step(first, 22), 23)]
    states[2]["layers.0.new"] = torch.randn(300).bfloat16()  # a full record
    got = {}
    for pipelined in (True, False):
        monkeypatch.setattr("chain.writer.PIPELINE", pipelined)
        store = ChainStore(tmp_path / str(pipelined), signing_key.public_key())
        parent, _ = write_artifact(store.blocks, signing_key, run="r", version=0,
                                   kind="snapshot", new=StateDictSource(first))
        for v in (1, 2):
            for trust in (True, False):
                reported: list = []
                m, _ = write_artifact(
                    store.blocks, signing_key, run="r", version=v, kind="delta",
                    new=StateDictSource(states[v]), parent=StateDictSource(states[v - 1]),
                    parent_manifest=parent, trust_parent=trust,
                    on_changes=lambda name, c, out=reported: out.append(
                        (name, None if c is None else (c.pos.tolist(), c.digest))))
                got[pipelined, v, trust] = (
                    m.tensors.digest_map(), records(store, m), reported,
                    b"".join(store.blocks.get(b.id, b.size) for b in m.blocks))
            parent = m
    assert sum(h.op == "group" for h in got[True, 1, True][1]) >= 4
    for v in (1, 2):
        src = StateDictSource(states[v])
        assert got[True, v, True][0] == {n: tensor_digest(*src.meta(n), src.bits(n))
                                         for n in states[v]}
        for trust in (True, False):
            assert got[True, v, trust] == got[False, v, trust]
        assert got[True, v, True][0] == got[True, v, False][0]


@pytest.mark.skipif(usable_cpus() < 2, reason="needs the codec's worker thread")
@pytest.mark.parametrize("where", ["reading", "writing"])
def test_an_error_in_a_later_batch_waits_for_the_batch_being_coded(tmp_path, signing_key,
                                                                  monkeypatch, where):
    """An error while a batch is being coded on the codec's worker, raised as the next batch
    is read (the source's `pieces`) or as the batch before is written (an `on_changes`
    callback, after the next batch's coding began): it reaches the caller only after every
    segment begun has ended, since the codec still reads the batches' tensors."""
    from chain.codec import api

    monkeypatch.setattr("chain.writer.BATCH_ELEMENTS", 1 << 21)
    first = experts(3000, 64, 31)
    second = step(first, 32)
    events: list[str] = []
    real = api._encode_segment

    def counted(*args, **kw):
        events.append("begin")
        try:
            if threading.current_thread() is not threading.main_thread():
                time.sleep(0.2)  # a slow segment: still coding when the walk fails
            return real(*args, **kw)
        finally:
            events.append("end")

    monkeypatch.setattr(api, "_encode_segment", counted)

    class Failing(StateDictSource):
        def pieces(self, names, sizes, itemsize):
            if where == "reading" and "begin" in events:  # a batch is coding, or has been
                raise OSError("the trainer's memory went away")
            return super().pieces(names, sizes, itemsize)

    def on_changes(name, changes):
        if where == "writing":
            raise OSError("the trainer's memory went away")

    store = ChainStore(tmp_path / "chain", signing_key.public_key())
    base, _ = write_artifact(store.blocks, signing_key, run="r", version=0, kind="snapshot",
                             new=StateDictSource(first))
    events.clear()
    with pytest.raises(OSError, match="memory went away"):
        write_artifact(store.blocks, signing_key, run="r", version=1, kind="delta",
                       new=Failing(second), parent=StateDictSource(first),
                       parent_manifest=base, trust_parent=True, on_changes=on_changes)
    assert events.count("begin") == events.count("end") > 0


def test_a_digest_miss_in_a_later_batch_stops_the_pipelined_pass_with_earlier_ones_journaled(
        tmp_path, signing_key, monkeypatch):
    """Batches of ~2,000 elements, so the fill checks each batch while the codec's workers
    decode the one after it. A signed manifest whose digest for a grouped tensor past the
    middle of the table is wrong: the apply stops naming that tensor, with exactly the
    tensors before it journaled (every earlier batch, and the group's members before it) and
    nothing after it, though the next batch was decoding when the check failed. The retry
    with the true manifest resumes from that journal and ends bit-exact."""
    monkeypatch.setattr("chain.fill.BATCH", 1 << 11)
    states, store, ms, w = _at_v2_of_three(tmp_path, signing_key)
    names = ms[3].tensors.names()
    late = [h for h in records(store, ms[3])
            if h.op == "group" and h.count > 2 and names.index(h.name) > len(names) // 2]
    assert late, "the test needs a group record in the table's second half"
    member = names[names.index(late[0].name) + 1]
    journaled = _refused(w, store, _with_wrong_digest(ms[3], member, signing_key), member)
    assert sorted(journaled) == names[:names.index(member)]
    cur = w.apply([ms[3]], getter(store))
    assert cur.version == 3 and w.verify().version == 3
    from safetensors.torch import load_file

    assert same(load_file(cur.path / "model.safetensors"), states[3])


def test_a_stream_cut_short_mid_apply_leaves_every_batch_read_before_it_checked(
        tmp_path, signing_key, monkeypatch):
    """The delta's stream ends 20 bytes short, inside its last record: the apply stops with
    "stream truncated", but every batch read whole before that was still decoded, written,
    checked and journaled, as one batch at a time had them (the pipelined pass reads a batch
    while the one before is still decoding), and the retry resumes bit-exact."""
    monkeypatch.setattr("chain.fill.BATCH", 1 << 11)
    states, store, ms, w = _at_v2_of_three(tmp_path, signing_key)
    get = getter(store)

    def short(b):
        data = get(b)
        return data[:-20]

    read, checked = [], []
    batches, check = fill_module._batches, Fill._check
    monkeypatch.setattr("chain.fill._batches",
                        lambda items: (read.append(b) or b for b in batches(items)))
    monkeypatch.setattr(Fill, "_check",
                        lambda self, batch: (checked.append(len(batch)), check(self, batch)))
    with pytest.raises(BadDelta, match="stream truncated"):
        w.apply([ms[3]], short)
    assert len(read) > 2 and sum(1 for n in checked if n) == len(read)
    (staging,) = w.staging()
    names = ms[3].tensors.names()
    journaled = (staging / "JOURNAL").read_text().split()
    assert sorted(journaled) == names[:len(journaled)]
    cur = w.apply([ms[3]], get)
    assert cur.version == 3 and w.verify().version == 3
    from safetensors.torch import load_file

    assert same(load_file(cur.path / "model.safetensors"), states[3])
