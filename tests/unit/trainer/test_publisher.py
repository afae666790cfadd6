"""The publisher on a real chain directory (no daemon): versions, snapshot cadence, resume, and
no hashing of a delta version's tensors (digests moved by the changes) even when it also gets a
snapshot."""

import gc
import threading
import time
import weakref

import numpy as np
import pytest
import torch

import chain.codec.api
import chain.sources
import chain.writer
import trainer.publisher
from chain import codec, dtypes, keys
from chain.codec.api import usable_cpus
from chain.digest import tensor_digest
from chain.errors import ChainError
from chain.policy import Retention, SnapshotPolicy, record_decision
from chain.sources import StateDictSource, source_digest
from trainer.publisher import Publisher, _cpu_copy, _patched


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
            "b.bias": torch.randn(32, generator=g).to(torch.bfloat16)}


def _step(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: (v.float() + 0.05 * torch.randn(v.shape, generator=g)).to(torch.bfloat16)
            for k, v in state.items()}


@pytest.fixture
def publisher(tmp_path) -> Publisher:
    keys.generate(tmp_path / "trainer.key")
    return Publisher(tmp_path / "chain", tmp_path / "trainer.key", run="r",
                     snapshots=SnapshotPolicy(every=2, max_delta_ratio=100.0))


def test_versions_get_deltas_and_snapshots_on_the_policy_cadence(publisher):
    s0 = _state(0)
    s1 = _step(s0, 1)
    s2 = _step(s1, 2)
    p0, p1, p2 = (publisher.publish(v, s) for v, s in enumerate((s0, s1, s2)))
    assert (p0.delta, p0.snapshot is not None) == (None, True)
    assert (p1.delta is not None, p1.snapshot) == (True, None)
    assert p2.delta is not None and p2.snapshot is not None
    assert p2.delta.state_digest == p2.snapshot.state_digest == source_digest(StateDictSource(s2))
    assert p2.delta.tensors == p2.snapshot.tensors
    assert publisher.head == 2


def test_a_delta_version_hashes_no_tensor_and_its_digests_match_a_full_hash(publisher,
                                                                           monkeypatch):
    s0 = _state(0)
    publisher.publish(0, s0)
    hashed = []
    real = chain.writer.tensor_digests

    def counting(items, *a, **k):
        hashed.extend(tuple(shape) for _, shape, _ in items)
        return real(items, *a, **k)

    monkeypatch.setattr(chain.writer, "tensor_digests", counting)
    publisher.snapshots = SnapshotPolicy(every=1)
    s1 = _step(s0, 1)
    out = publisher.publish(1, s1)
    assert out.delta is not None and out.snapshot is not None
    assert hashed == []  # digests moved by the changes; the snapshot reuses the delta's
    full = {n: tensor_digest(*StateDictSource(s1).meta(n), StateDictSource(s1).bits(n))
            for n in s1}
    assert {t.name: t.digest for t in out.delta.tensors} == full


def test_the_kept_copy_follows_the_published_weights_without_sharing_them(publisher):
    s0 = _state(0)
    publisher.publish(0, s0)
    s1 = _step(s0, 1)
    publisher.publish(1, s1)
    assert all(torch.equal(publisher._last[k], s1[k]) for k in s1)
    s1["a.weight"].add_(1.0)  # the caller steps its own tensors in place
    assert not torch.equal(publisher._last["a.weight"], s1["a.weight"])
    s2 = _step(_step(s0, 1), 2)
    p2 = publisher.publish(2, s2)
    assert p2.delta.state_digest == source_digest(StateDictSource(s2))


def test_small_tensors_are_kept_back_to_back_so_their_group_reads_the_parent_in_place(
        publisher, monkeypatch):
    """The kept copy is one allocation in name order, so a group record's parent elements
    are one view of it (StateDictSource.span, from the addresses noted with the views), not a
    copy (the new weights, held apart, are copied into the writer's scratch buffer:
    test_a_batchs_groups_share_one_buffer)."""
    state = {f"e{i:02d}.w": torch.randn(4, 8).to(torch.bfloat16) for i in range(12)}
    publisher.publish(0, state)
    seen, copied = [], []
    real_span, real_copy = chain.sources.StateDictSource.span, chain.writer.end_to_end

    def span(self, names):
        out = real_span(self, names)
        seen.append((len(names), out is not None and np.shares_memory(
            out, dtypes.bits_view(publisher._last[names[0]]))))
        return out

    monkeypatch.setattr(chain.sources.StateDictSource, "span", span)
    monkeypatch.setattr(chain.writer, "end_to_end", lambda arrays: copied.append(arrays)
                        or real_copy(arrays))
    step = _step(state, 1)
    out = publisher.publish(1, step)
    # the group's parent, in place (asked by the writer, then by the patch: kept answers)
    assert seen == [(12, True)] * 2 and copied == []
    assert out.delta.state_digest == source_digest(StateDictSource(step))
    assert list(publisher._spans) == [tuple(sorted(state))]


def test_a_publisher_keeps_its_spans_until_a_version_replaces_a_tensor(publisher):
    """The groups' spans found over the kept copy are handed to the next version's source
    while every kept tensor is the same object; a version that reshapes one drops them (its
    tensor is copied apart, so the group no longer lies back to back and the next version
    finds none). Each version's digest is right."""
    state = {f"e{i:02d}.w": torch.randn(4, 8).to(torch.bfloat16) for i in range(12)}
    publisher.publish(0, state)
    step = _step(state, 1)
    publisher.publish(1, step)
    spans, metas = publisher._spans, publisher._metas
    assert len(spans) == 1
    assert metas is not None and metas[0] == sorted(state)
    step = _step(step, 2)
    out = publisher.publish(2, step)
    assert out.delta.state_digest == source_digest(StateDictSource(step))
    assert next(iter(publisher._spans.values())) is next(iter(spans.values()))  # carried
    assert publisher._metas is metas  # carried too: the kept copy's layouts did not change
    step = _step(step, 3)
    step["e05.w"] = step["e05.w"].reshape(8, 4)
    out = publisher.publish(3, step)
    assert out.delta.state_digest == source_digest(StateDictSource(step))
    assert publisher._spans == {} and publisher._metas is None
    step = _step(step, 4)
    out = publisher.publish(4, step)
    assert out.delta.state_digest == source_digest(StateDictSource(step))
    assert publisher._spans == {}  # the group crosses e05, held apart: copied, no span


def test_a_group_is_read_where_its_members_lie_unless_one_is_not_contiguous(
        publisher, monkeypatch):
    """A group whose members are all contiguous CPU tensors is coded from their addresses
    (`pieces`, codec.Pieces), never copied end to end (`cat`); a group holding a transposed
    view is copied. Both versions' digests are right (the apply side checks the payload's
    own hash too: a wrong address would not go unseen)."""
    cats = []
    real_cat = StateDictSource.cat
    monkeypatch.setattr(StateDictSource, "cat",
                        lambda self, names: cats.append(list(names)) or real_cat(self, names))
    state = {f"e{i:02d}.w": torch.randn(16, 8).to(torch.bfloat16) for i in range(12)}
    publisher.publish(0, state)
    step = _step(state, 1)
    out = publisher.publish(1, step)
    assert out.delta.state_digest == source_digest(StateDictSource(step))
    assert out.delta.stats["changed_tensors"] == 12 and cats == []
    step = _step(step, 2)
    step["e03.w"] = step["e03.w"].t().contiguous().t()  # same shape, not contiguous
    assert not step["e03.w"].is_contiguous()
    out = publisher.publish(2, step)
    assert out.delta.state_digest == source_digest(StateDictSource(step))
    assert cats == [sorted(state)]


def test_a_tensor_renamed_keeps_the_count_and_the_kept_copy_follows(publisher):
    """A version that renames a tensor (as many tensors, one name new): the new name is a
    full record, the kept copy holds the new names, and the next delta is right."""
    state = _state(0)
    publisher.publish(0, state)
    step = _step(state, 1)
    step["c.bias"] = step.pop("b.bias")
    out = publisher.publish(1, step)
    assert out.delta.state_digest == source_digest(StateDictSource(step))
    assert sorted(publisher._last) == sorted(step) and publisher._metas is None
    nxt = _step(step, 2)
    out = publisher.publish(2, nxt)
    assert out.delta.state_digest == source_digest(StateDictSource(nxt))


def test_metas_handed_over_are_given_without_walking_the_views():
    """`metas` given to an owned source answer `metas` for the same names as they are (the
    holder vouches for them); other names are looked up; a source not owned takes none."""
    kept = _cpu_copy({f"t{i}": torch.randn(8).to(torch.bfloat16) for i in range(3)})
    marker = [("bfloat16", [8])] * 3
    names = ["t0", "t1", "t2"]
    assert StateDictSource(kept, {}, owned=True, metas=(names, marker)).metas(
        list(names)) is marker
    assert StateDictSource(kept, {}, owned=True, metas=(names, marker)).metas(
        ["t0", "t1"]) == [("bfloat16", [8])] * 2
    assert StateDictSource(kept, {}, metas=(names, marker)).metas(names) is not marker


def test_a_span_answer_handed_over_is_given_without_walking_the_views():
    """`spans` given to an owned source answer `span` as they are (the holder vouches for
    them); a source that is not owned takes none."""
    kept = _cpu_copy({f"t{i}": torch.randn(8).to(torch.bfloat16) for i in range(3)})
    marker = np.zeros(24, np.uint16)
    names = ["t0", "t1", "t2"]
    assert StateDictSource(kept, {}, owned=True, spans={tuple(names): marker}).span(
        names) is marker
    assert StateDictSource(kept, {}, spans={tuple(names): marker}).span(names) is None


def test_metas_answer_what_meta_answers_for_owned_and_given_states():
    """`metas` (the writer's walk asks it once for all tensors) equals `meta` asked a tensor
    at a time: for a trainer's state, for an owned kept copy with and without views, and for
    a tensor replaced in the kept copy since it was viewed; an unsupported dtype is named."""
    state = {"a": torch.randn(3, 4).to(torch.bfloat16), "b": torch.zeros(5, dtype=torch.int32),
             "c": torch.randn(2, 2, 2)}
    names = sorted(state)
    given = StateDictSource(state)
    assert given.metas(names) == [given.meta(n) for n in names] == [
        ("bfloat16", [3, 4]), ("int32", [5]), ("float32", [2, 2, 2])]
    kept = _cpu_copy(state)
    owned = StateDictSource(kept, {}, owned=True)
    assert owned.metas(names) == [owned.meta(n) for n in names]
    for n in names:
        owned.bits(n)
    kept["c"] = torch.zeros(7, dtype=torch.float16)  # replaced since it was viewed
    assert owned.metas(names) == [owned.meta(n) for n in names]
    assert owned.metas(["c"]) == [("float16", [7])]
    with pytest.raises(ChainError, match="complex64"):
        StateDictSource({"z": torch.zeros(2, dtype=torch.complex64)}).metas(["z"])


def test_a_mapping_that_makes_tensors_on_access_is_asked_one_at_a_time():
    """A state that is not a plain dict may make a tensor only when asked (a trainer handing
    tensors over as they are ready): `metas` reads none before it is iterated and each as
    it is reached, so the writer's walk writes the blocks before a tensor first."""
    state = {f"t{i}": torch.randn(4).to(torch.bfloat16) for i in range(3)}
    asked: list[str] = []

    class Lazy(dict):
        def __getitem__(self, name):
            asked.append(name)
            return super().__getitem__(name)

    answers = iter(StateDictSource(Lazy(state)).metas(["t0", "t1", "t2"]))
    assert asked == []
    assert next(answers) == ("bfloat16", [4]) and asked == ["t0"]
    assert list(answers) == [("bfloat16", [4])] * 2 and asked == ["t0", "t1", "t2"]


def test_the_kept_copys_span_is_none_where_tensors_do_not_lie_back_to_back():
    """Where the tensors do not lie back to back (8-byte boundaries between odd-sized bf16
    ones), or the state is not owned, no span: the writer copies them end to end instead. A
    tensor not viewed yet is viewed by the span itself (the first delta after a snapshot)."""
    kept = _cpu_copy({f"t{i}": torch.randn(4 * (i + 1)).to(torch.bfloat16) for i in range(4)}
                     | {"u": torch.randn(5).to(torch.bfloat16),
                        "v": torch.randn(4).to(torch.bfloat16)})
    src = StateDictSource(kept, {}, owned=True)
    names = ["t0", "t1", "t2", "t3"]
    whole = src.span(names)  # no views yet: made now
    assert set(src.views) == set(names)
    arrays = [src.bits(n) for n in [*names, "u", "v"]]
    assert np.array_equal(whole, np.concatenate(arrays[:4])) and not whole.flags.writeable
    assert src.span(["t0", "t2"]) is None and src.span(["u", "v"]) is None
    assert StateDictSource(kept, {}).span(names) is None


@pytest.mark.skipif(usable_cpus() < 2, reason="the scatters run over two threads only "
                    "where two CPUs are usable")
@pytest.mark.parametrize("apart_first", [False, True], ids=["apart-last", "apart-first"])
def test_the_kept_copy_is_patched_by_scatters_over_its_allocation_and_apart_elsewhere(
        apart_first, monkeypatch):
    """`_patched` writes the changes of tensors in the kept allocation as scatters over it
    (one a record, spread over the codec's threads; bf16 and f32 here, at their own
    addresses) and those of a tensor held apart (replaced earlier) through its own view: the
    result is the new state, bit for bit, and the apart tensor's memory is written, not
    copied. The shared allocation is found whichever tensor comes first: the scatters over
    it are counted, with where they write."""
    gen = torch.Generator().manual_seed(3)
    state = {f"b{i}": torch.randn(3 + i, generator=gen).to(torch.bfloat16) for i in range(6)}
    state |= {f"f{i}": torch.randn(2, 3 + i, generator=gen) for i in range(3)}
    kept = _cpu_copy(state)
    apart = {"apart": torch.randn(9, generator=gen).to(torch.bfloat16)}  # its own allocation
    kept = apart | kept if apart_first else kept | apart
    src = StateDictSource(kept, {}, owned=True)
    new = {k: v.clone() for k, v in kept.items()}
    changes = {}
    for k in sorted(new):
        bits = src.bits(k)
        pos = np.unique(torch.randint(0, bits.size, (3,), generator=gen).numpy())
        flat = new[k].view(-1)
        flat[pos] = flat[pos] * 2 + 1
        changes[k] = codec.Changes(pos.astype(np.int64), dtypes.bits_view(new[k])[pos].copy())
    apart = kept["apart"].data_ptr()
    shared = kept["b0"].untyped_storage()
    lo, hi = shared.data_ptr(), shared.data_ptr() + shared.nbytes()
    scattered = []  # each scatter over the shared allocation: its element type, its record's
    # changes; run over the codec's threads even for work this small (`_PARALLEL_MIN`)
    threads_seen = set()
    monkeypatch.setattr("chain.codec.api._PARALLEL_MIN", 1)
    real = chain.codec.api._scatter

    def counted(target, pos, val):
        at = target.__array_interface__["data"][0]
        assert lo <= at and at + target.nbytes <= hi  # a view of the shared allocation
        scattered.append((target.dtype.itemsize, pos.size))
        threads_seen.add(threading.current_thread().name)
        time.sleep(0.01)  # slow enough that each thread finds jobs left to take
        real(target, pos, val)

    monkeypatch.setattr(chain.codec.api, "_scatter", counted)
    out = _patched(kept, src, new, changes)
    # the 6 bf16 and 3 f32 kept tensors, each once, not "apart"
    assert sorted(size for size, _ in scattered) == [2] * 6 + [4] * 3
    assert sum(n for _, n in scattered) == sum(changes[k].pos.size for k in changes
                                               if k != "apart")
    assert all(torch.equal(out[k].view(-1).view(torch.uint8), new[k].view(-1).view(torch.uint8))
               for k in new)
    assert out["apart"].data_ptr() == apart and out["b0"] is kept["b0"]
    assert len(threads_seen) >= 2, threads_seen


def test_a_group_record_patches_the_kept_copy_in_one_run_or_member_by_member():
    """A group's changes (positions in its members' elements end to end, the writer's
    on_group) are written as one run where its members lie back to back in the kept copy,
    and member by member where one is held apart (replaced earlier): either way the result
    is the new state bit for bit, in the kept copy's own memory."""
    gen = torch.Generator().manual_seed(5)
    state = {f"g{i}": torch.randn(4 * (i + 1), generator=gen).to(torch.bfloat16)
             for i in range(5)}
    kept = _cpu_copy(state)
    kept["g2"] = kept["g2"].clone()  # held apart: g1..g3 no longer lie back to back
    src = StateDictSource(kept, {}, owned=True)
    new = {k: v.clone() for k, v in kept.items()}
    for t in new.values():
        t.view(-1)[1::3] += 1
    groups = []
    for names in (["g0", "g1"], ["g2", "g3", "g4"]):
        offsets = np.cumsum([0] + [kept[n].numel() for n in names]).astype(np.int64)
        old = np.concatenate([dtypes.bits_view(kept[n]) for n in names])
        val = np.concatenate([dtypes.bits_view(new[n]) for n in names])
        pos = np.flatnonzero(old != val).astype(np.int64)
        groups.append((names, offsets, codec.Changes(pos, val[pos])))
    assert src.span(["g0", "g1"]) is not None and src.span(["g2", "g3", "g4"]) is None
    ptrs = {k: t.data_ptr() for k, t in kept.items()}
    out = _patched(kept, src, new, {}, groups)
    for k in new:
        assert torch.equal(out[k].view(torch.int16), new[k].view(torch.int16)), k
        assert out[k].data_ptr() == ptrs[k]


def test_a_batchs_groups_share_one_buffer():
    """A batch's groups of new elements: views where back to back, else copies laid in one
    buffer (8-byte boundaries), kept for the next batch."""
    scratch = chain.writer._Scratch()
    flat = np.arange(64, dtype=np.uint16)
    apart = [np.arange(5, dtype=np.uint16), np.arange(7, dtype=np.uint16) + 100]
    wide = [np.arange(3, dtype=np.float32), np.ones(2, np.float32)]
    got = scratch.end_to_end([apart, [flat[:16], flat[16:64]], wide])
    assert [g.dtype for g in got] == [np.uint16, np.uint16, np.float32]
    assert np.array_equal(got[0], np.concatenate(apart))
    assert np.array_equal(got[1], flat) and not got[1].flags.writeable  # a view
    assert np.array_equal(got[2], np.concatenate(wide))
    buf = scratch.buf
    assert np.shares_memory(got[0], buf) and np.shares_memory(got[2], buf)
    assert got[2].__array_interface__["data"][0] - buf.__array_interface__["data"][0] == 24
    again = scratch.end_to_end([[apart[1], apart[0]]])
    assert scratch.buf is buf and np.array_equal(again[0], np.r_[apart[1], apart[0]])


def test_the_kept_copy_starts_each_tensor_on_an_8_byte_boundary():
    """Back to back in name order, a tensor whose bytes end off the boundary padded (the
    kernels read 64-bit words), and equal to what it copies."""
    state = {"a": torch.randn(3).to(torch.bfloat16), "b": torch.randn(5),
             "c": torch.randn(2, 2).to(torch.bfloat16), "d": torch.randn(1, dtype=torch.cdouble)}
    kept = trainer.publisher._cpu_copy(state)
    # d, 16-byte elements, from a multiple of 16
    assert [kept[k].data_ptr() - kept["a"].data_ptr() for k in "abcd"] == [0, 8, 32, 48]
    assert all(torch.equal(kept[k], state[k]) and kept[k].shape == state[k].shape
               for k in state)


def test_end_to_end_copies_arrays_that_are_not_back_to_back():
    flat = np.arange(40, dtype=np.uint16)
    view = chain.writer.end_to_end([flat[0:8], flat[8:20], flat[20:40]])
    assert not view.flags.owndata and not view.flags.writeable
    assert np.array_equal(view, flat)
    gap = chain.writer.end_to_end([flat[0:8], flat[12:20]])
    assert gap.flags.owndata and np.array_equal(gap, np.r_[flat[0:8], flat[12:20]])
    retyped = chain.writer.end_to_end([flat[0:8], flat[8:16].view(np.int16)])
    assert retyped.flags.owndata


def test_resume_accepts_the_head_weights_only(publisher, tmp_path):
    s0 = _state(0)
    publisher.publish(0, s0)
    again = Publisher(tmp_path / "chain", tmp_path / "trainer.key", run="r")
    with pytest.raises(ChainError, match="call resume"):
        again.publish(1, _step(s0, 1))
    with pytest.raises(ChainError, match="not v0 as published"):
        again.resume(_step(s0, 9))
    assert again.resume(s0) == 0
    assert again.publish(1, _step(s0, 1)).delta is not None


def test_versions_must_follow_the_head(publisher):
    publisher.publish(0, _state(0))
    with pytest.raises(ChainError, match="does not follow the head"):
        publisher.publish(2, _state(1))


def test_digests_are_reused_only_from_a_manifest_of_the_same_weights(publisher):
    s0 = _state(0)
    p0 = publisher.publish(0, s0)
    with pytest.raises(ValueError, match="describes v0 with 2 tensors, but this is v1"):
        chain.writer.write_artifact(publisher.store.blocks, publisher.key, run="r", version=1,
                                    kind="snapshot", new=StateDictSource(_step(s0, 1)),
                                    same_tensors_as=p0.snapshot)


def _sparse(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """About 1 % of the elements move one bf16 step: deltas much smaller than a snapshot."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in state.items():
        bits = v.view(torch.int16).clone()
        bits[torch.rand(bits.shape, generator=g) < 0.01] += 1
        out[k] = bits.view(torch.bfloat16)
    return out


def _linked(tmp_path) -> Publisher:
    """A publisher linked to a daemon that is down (nothing listens on the port)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    keys.generate(tmp_path / "trainer.key")
    return Publisher(tmp_path / "chain", tmp_path / "trainer.key", run="r",
                     daemon_url=f"http://127.0.0.1:{port}", token="t" * 12,
                     snapshots=SnapshotPolicy(every=3, max_delta_ratio=100.0),
                     retention=Retention(versions=2))


def _publish_versions(pub: Publisher, n: int) -> None:
    state = _state(0)
    for v in range(n):
        pub.publish(v, state)
        state = _sparse(state, v + 1)


def test_a_publisher_whose_daemon_is_down_keeps_what_the_daemon_decided_to_keep(tmp_path):
    """Issue 11 finding 4: the publisher's own window dropped v8 while the trainer's daemon was
    down, and regions at v7 sat waiting for it. Now it follows the daemon's recorded decision:
    regions live at v1 keep deltas v2.. on disk."""
    pub = _linked(tmp_path)
    record_decision(tmp_path / "chain", Retention(versions=2, behind_budget_bytes=1 << 20), [1])
    _publish_versions(pub, 8)
    held = set(pub.store.artifacts())
    assert {f"v{v:08d}.delta" for v in range(2, 8)} <= held
    assert "v00000000.snapshot" not in held  # what nobody needs still goes


def test_a_publisher_whose_daemon_never_decided_deletes_nothing(tmp_path):
    pub = _linked(tmp_path)
    _publish_versions(pub, 6)
    assert pub.store.artifacts() == sorted(
        ["v00000000.snapshot", "v00000003.snapshot", *(f"v{v:08d}.delta" for v in range(1, 6))])


def test_a_tensor_dropped_from_the_state_is_not_kept_alive_by_its_bit_view(publisher):
    """The publisher keeps bit views of its kept copy across versions; a view of a tensor
    the next state dropped would hold that tensor alive (a whole second copy after a model is
    retyped) until the publish after. Its bytes are also let go, though the kept copy holds
    its tensors in one allocation."""
    big = torch.zeros(1 << 20, dtype=torch.bfloat16)
    publisher.publish(0, {"big": big, "small": torch.zeros(8, dtype=torch.bfloat16)})
    nxt = big.clone()
    nxt[5] = 1
    publisher.publish(1, {"big": nxt, "small": torch.ones(8, dtype=torch.bfloat16)})
    kept = weakref.ref(publisher._last["big"])
    publisher.publish(2, {"small": torch.full((8,), 2, dtype=torch.bfloat16)})
    gc.collect()
    assert kept() is None
    # nor by the one allocation the kept copy shared with it: the rest is copied out of it
    assert publisher._last["small"].untyped_storage().nbytes() == 16


@pytest.mark.parametrize("swap", ["set_", "data", "t_", "as_strided_"])
def test_a_kept_bit_view_is_not_reused_once_its_tensor_views_other_memory(swap):
    """StateDictSource reuses a bit view for the very tensor object it was made from; `set_`
    and `.data =` keep the object but change what it views, so the old view would read the
    wrong memory (`resize_` is refused while a view holds the storage)."""
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    src = StateDictSource({"w": t}, {})
    src.bits("w")
    if swap == "set_":
        t.set_(torch.ones(8, dtype=torch.bfloat16))
    elif swap == "data":
        t.data = torch.ones(2, 3, dtype=torch.bfloat16)
    elif swap == "t_":  # same memory, transposed in place: the elements read in another order
        t.t_()
    else:  # same memory, a window of it
        t.as_strided_((2, 2), (3, 1), 1)
    again = StateDictSource({"w": t}, src.views)
    bits = again.bits("w")
    want = t.contiguous().view(torch.int16).numpy().reshape(-1).view(bits.dtype)
    assert bits.size == t.numel()
    assert (bits == want).all()


def test_no_bit_view_is_kept_of_a_tensor_that_bits_view_copies():
    """A tensor that is not contiguous is read through a copy; keeping that copy as if it were
    a view of the tensor would serve the old values after the caller writes in place."""
    t = torch.zeros(4, 4, dtype=torch.bfloat16).t()
    src = StateDictSource({"w": t}, {})
    src.bits("w")
    t[0, 1] = 3.0
    bits = StateDictSource({"w": t}, src.views).bits("w")
    assert (bits == t.contiguous().view(torch.int16).numpy().reshape(-1).view(bits.dtype)).all()


@pytest.mark.parametrize(("direct", "mode"), [(-1, 1), (1000, 3)])
def test_direct_positions_reach_the_delta_payloads_and_a_region_applies_them(tmp_path, direct,
                                                                              mode):
    """direct_positions_pct (trainer configs) -> Publisher -> each delta record's codec mode
    (1 CODED: ranks, the default; 3 CODED_POS, here every segment direct); a region's journaled
    apply of either is bit-exact."""
    from chain.codec import payload_stats
    from chain.store import ChainStore
    from chain.stream import BlockReader
    from chain.weights import WeightsDir

    keys.generate(tmp_path / "k")
    pub = Publisher(tmp_path / "chain", tmp_path / "k", run="r", direct_positions=direct,
                    snapshots=SnapshotPolicy(every=10**6, max_delta_ratio=1e9))
    states = [_state(0)]
    states.append(_step(states[0], 1))
    delta = [pub.publish(v, s) for v, s in enumerate(states)][1].delta
    store = ChainStore(tmp_path / "chain")
    get = lambda b: store.blocks.get(b.id, b.size)  # noqa: E731
    reader = BlockReader.of_blocks(delta.blocks, get)
    stats = []
    while (h := reader.next_header()) is not None:
        payload = reader.read(h.n)
        assert payload[1] & 0xF == mode
        stats.append(payload_stats(payload))
    assert stats and all(s["direct_segments"] == (s["segments"] if mode == 3 else 0)
                         for s in stats)
    cur = WeightsDir(tmp_path / "w").apply(store.plan(None, 1), get)
    assert cur.state_digest == source_digest(StateDictSource(states[1]))
