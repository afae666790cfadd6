"""The rank side of sharded publishing in one process: ranks holding arbitrary element ranges
(odd dtypes, empty tensors, misaligned cuts) produce versions a region rebuilds bit-identical to
the single-process Publisher's; change detection copies positions and values only; a restarted
rank reuses its persisted part only for the very same weights, and when it finds its changes
first (as a rank on a GPU does) it writes what the one-pass encoding of host slices writes."""

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import chain.codec.api
from chain import dtypes, keys, shards
from chain.codec.api import usable_cpus
from chain.manifest import Parent
from chain.policy import SnapshotPolicy
from chain.store import ChainStore
from chain.weights import WeightsDir
from tests.conftest import make_state, perturb
from trainer.changes import bits_of, find_changes
from trainer.publisher import Publisher
from trainer.rank_encoder import RankEncoder, Slice
from trainer.sharded import Shard, local_slices, owner


def _split(state: dict[str, torch.Tensor], world: int, seed: int = 1) -> list[list[Slice]]:
    rng = np.random.default_rng(seed)
    out: list[list[Slice]] = [[] for _ in range(world)]
    for name, t in state.items():
        flat = t.reshape(-1)
        b = [0, *sorted(rng.integers(0, flat.numel() + 1, world - 1).tolist()), flat.numel()]
        for r in range(world):
            out[r].append(Slice(name, dtypes.of_tensor(t).name, list(t.shape), b[r],
                                bits_of(flat[b[r]:b[r + 1]])))
    return out


def _publish(store, key, encs, version, state, snapshot):
    head = store.head()
    parent = None if head is None else (store.get(head, "delta") or store.get(head, "snapshot"))
    parts = [e.encode(version, s, parent_digest=parent and parent.state_digest,
                      snapshot=snapshot) for e, s in zip(encs, _split(state, len(encs)),
                                                         strict=True)]
    tensors = shards.tensor_entries(parts)
    out = []
    if parent is not None:
        out.append(shards.assemble(parts, run="r", version=version, kind="delta",
                                   tensors=tensors, parent=Parent(version=head,
                                   state_digest=parent.state_digest)).signed(key))
    if snapshot:
        out.append(shards.assemble(parts, run="r", version=version, kind="snapshot",
                                   tensors=tensors, parent=None).signed(key))
    for m in out:
        store.add(m)
    for e in encs:
        e.commit()
    return parts, out


def _codings(store: ChainStore, blocks) -> set[tuple[int, bool]]:
    """(codec mode, every segment coded directly) of each delta record in `blocks` whose
    changes are coded (not raw: a tensor changed throughout, as `step.count` is)."""
    from chain.codec import payload_stats
    from chain.stream import BlockReader

    reader = BlockReader.of_blocks(blocks, lambda b: store.blocks.get(b.id, b.size))
    out = set()
    while (h := reader.next_header()) is not None:
        payload = reader.read(h.n)
        if h.op == "delta" and (payload[1] & 0xF) != 2:
            st = payload_stats(payload)
            out.add((payload[1] & 0xF, st["direct_segments"] == st["segments"]))
    return out


@pytest.mark.parametrize("direct", [-1, 1000], ids=["ranks", "direct"])
def test_three_simulated_ranks_rebuild_bit_identical_to_the_single_process_publisher(tmp_path,
                                                                                    direct):
    key = keys.generate(tmp_path / "k")
    store = ChainStore(tmp_path / "chain", key.public_key())
    ref = Publisher(tmp_path / "ref", tmp_path / "k", run="r",
                    snapshots=SnapshotPolicy(every=2, max_delta_ratio=1e9))
    encs = [RankEncoder(store.blocks, tmp_path / "chain" / "parts", r, 4096, direct=direct)
            for r in range(3)]
    state, wd = make_state(0, scale=3), WeightsDir(tmp_path / "w")
    for v in range(5):
        parts, made = _publish(store, key, encs, v, state, snapshot=v % 2 == 0)
        want = ref.publish(v, state)
        assert [m.state_digest for m in made] == \
            [m.state_digest for m in (want.delta, want.snapshot) if m is not None]
        assert made[0].tensors == (want.delta or want.snapshot).tensors
        cur = wd.apply(made[:1], lambda b: store.blocks.get(b.id, b.size))
        assert cur.state_digest == made[0].state_digest
        if v:
            assert sum(s.changed for p in parts for s in p.slices) == want.changed_elements
            # direct_positions reaches every rank's records: mode 3, every segment direct
            assert _codings(store, made[0].blocks) == ({(3, True)} if direct >= 0
                                                       else {(1, False)})
        state = perturb(state, v)
    snap = WeightsDir(tmp_path / "from-snapshot")  # a late joiner: snapshot v4 only
    assert snap.apply(store.plan(None, 4), lambda b: store.blocks.get(b.id, b.size)
                      ).state_digest == store.get(4, "snapshot").state_digest


def test_change_detection_copies_positions_and_values_only():
    g = torch.Generator().manual_seed(0)
    old = torch.randn(5000, generator=g).bfloat16()
    new = old.clone()
    idx = torch.randperm(5000, generator=g)[:123]
    new.view(torch.int16)[idx] += 1
    want = np.flatnonzero(old.view(torch.int16).numpy() != new.view(torch.int16).numpy())
    for use_torch in (True, False):  # torch: the code that runs on a GPU
        f = find_changes(bits_of(old), bits_of(new), chunk=1000, use_torch=use_torch)
        assert f.pos.tolist() == want.tolist()
        assert f.val.dtype == np.uint16
        assert f.val.tolist() == new.view(torch.int16).numpy().view(np.uint16)[want].tolist()
        assert f.d2h_bytes == 123 * (4 + 2)


def test_a_restarted_rank_reuses_its_part_only_for_the_same_weights(tmp_path):
    key = keys.generate(tmp_path / "k")
    store = ChainStore(tmp_path / "chain", key.public_key())
    s0 = make_state(0)
    encs = [RankEncoder(store.blocks, tmp_path / "chain" / "parts", r, 4096) for r in range(2)]
    _publish(store, key, encs, 0, s0, snapshot=True)
    s1 = perturb(s0, 1)
    parent = store.get(0, "snapshot").state_digest
    before = encs[1].encode(1, _split(s1, 2)[1], parent_digest=parent, snapshot=False)
    assert not before.reused and before.delta_blocks  # then the group died before the gather

    def restarted() -> RankEncoder:
        e = RankEncoder(store.blocks, tmp_path / "chain" / "parts", 1, 4096)
        e.adopt(_split(s0, 2)[1])
        e.commit()
        return e

    again = restarted().encode(1, _split(s1, 2)[1], parent_digest=parent, snapshot=False)
    assert again.reused and again.delta_blocks == before.delta_blocks
    other = restarted().encode(1, _split(perturb(s0, 9), 2)[1], parent_digest=parent,
                               snapshot=False)
    assert not other.reused and other.slices != before.slices


def test_plain_tensors_are_owned_whole_and_shards_name_their_range():
    t = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    (whole, part) = local_slices({"a": t, "b": Shard(t[1:], (6, 4), 12)}, rank=0, world=2)
    assert (whole.name, whole.lo, whole.bits.numel(), whole.shape) == ("a", 0, 12, [3, 4])
    assert (part.lo, part.bits.numel(), part.shape) == (12, 8, [6, 4])
    assert {owner(n, 4) for n in ("x", "y", "z", "w", "v")} <= set(range(4))
    with pytest.raises(ValueError, match=r"outside its shape \[2, 4\]"):
        local_slices({"c": Shard(t, (2, 4), 0)}, rank=0, world=2)


def test_plain_tensors_do_not_import_dtensor():
    """A trainer without DTensors does not pay for importing them (~40 MB) when it publishes."""
    code = ("import sys, torch; from trainer.sharded import local_slices, Shard; "
            "t = torch.zeros(6); local_slices({'a': t, 'b': Shard(t, (12,), 6)}, 0, 2); "
            "print('torch.distributed.tensor' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[3], check=True)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("direct", [-1, 1000], ids=["ranks", "direct"])
def test_finding_changes_first_writes_what_the_one_pass_writes(tmp_path, direct):
    """Two ranks, slices of several codec segments cut mid-word: a rank restarted with
    different weights than it persisted finds its changes first and rebuilds segments from
    them (the GPU path); a fresh rank encodes in one pass. Same parts, same blocks."""
    key = keys.generate(tmp_path / "k")
    store = ChainStore(tmp_path / "chain", key.public_key())
    s0 = make_state(0, scale=700)  # embed.weight: 1.4M elements, split at a random element
    encs = [RankEncoder(store.blocks, tmp_path / "chain" / "parts", r, 1 << 16)
            for r in range(2)]
    _publish(store, key, encs, 0, s0, snapshot=True)
    parent = store.get(0, "snapshot").state_digest
    s1, other = perturb(s0, 1), perturb(s0, 2)
    qkv = _split(s1, 2)[1][1]  # 1049779 elements from 1100621: two segments, a word split
    assert (qkv.name, qkv.lo % 4, qkv.bits.numel() > 1 << 20) == ("layers.0.attn.qkv.weight",
                                                                   1, True)
    qkv.bits[(1 << 20) - 6:(1 << 20) + 6] += 1  # on both sides of that word
    encs[1].encode(1, _split(other, 2)[1], parent_digest=parent, snapshot=False)  # then died

    def fresh(parts_dir: str) -> RankEncoder:
        e = RankEncoder(store.blocks, tmp_path / parts_dir, 1, 1 << 16, direct=direct)
        e.adopt(_split(s0, 2)[1])
        e.commit()
        return e

    found_first = fresh("chain/parts").encode(1, _split(s1, 2)[1], parent_digest=parent,
                                              snapshot=False)
    one_pass = fresh("elsewhere").encode(1, _split(s1, 2)[1], parent_digest=parent,
                                         snapshot=False)
    assert not found_first.reused and found_first.d2h_bytes > 0 == one_pass.d2h_bytes
    assert found_first.slices == one_pass.slices
    assert sum(s.changed for s in one_pass.slices) > 10_000
    assert found_first.delta_blocks == one_pass.delta_blocks
    assert found_first.encoded_bytes == one_pass.encoded_bytes
    assert _codings(store, one_pass.delta_blocks) == ({(3, True)} if direct >= 0
                                                      else {(1, False)})


def test_ranks_sharing_a_host_split_its_cores_between_their_codec_threads(monkeypatch):
    from trainer.sharded import local_codec_threads

    monkeypatch.setattr("os.sched_getaffinity", lambda _: set(range(2)))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert local_codec_threads() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert local_codec_threads() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # more ranks than cores: still one each
    assert local_codec_threads() == 1
    monkeypatch.setattr("os.sched_getaffinity", lambda _: set(range(64)))
    assert local_codec_threads() == 2  # the codec's most


def test_an_engine_first_region_decodes_sharded_deltas_over_the_patches_its_disk_lacks(
        tmp_path):
    """Ranks' records cover parts of a tensor; a region decoding them engine-first (chain/
    decode.py) against its disk version overlaid with the patches verified since must reach
    every version's digests, and its disk catch-up from the merged patches the last one."""
    from chain.decode import decode_patch, merge
    from chain.safetensors_io import TensorFiles
    from chain.versiondir import read_info

    key = keys.generate(tmp_path / "k")
    store = ChainStore(tmp_path / "chain", key.public_key())
    encs = [RankEncoder(store.blocks, tmp_path / "chain" / "parts", r, 4096) for r in range(3)]
    state, states, made = make_state(0, scale=3), [], []
    for v in range(4):
        states.append(state)
        made.append(_publish(store, key, encs, v, state, snapshot=v == 0)[1][0])
        state = perturb(state, v)
    assert len(made[1].substreams) == 3  # a stream per rank, most tensors cut between them
    get = lambda b: store.blocks.get(b.id, b.size)  # noqa: E731
    wd = WeightsDir(tmp_path / "w")
    disk = wd.apply(made[:1], get)
    files, digests = TensorFiles(disk.path), read_info(disk.path).tensors
    patches = []
    for v in (1, 2, 3):
        p = decode_patch(made[v], files, 0, digests, patches, get)
        assert p.state_digest == made[v].state_digest
        for t in p.tensors:  # the patch turns the parent's tensor into this version's
            flat = dtypes.bits_view(states[v - 1][t.name].reshape(-1)).copy()
            flat[t.indices] = t.values
            assert np.array_equal(flat, dtypes.bits_view(states[v][t.name].reshape(-1))), t.name
        patches.append(p)
    cur = wd.apply_changes(made[3], 0, merge(patches), get)
    assert cur.state_digest == made[3].state_digest and wd.verify().version == 3


@pytest.mark.skipif(usable_cpus() < 2, reason="needs the codec's worker thread")
def test_a_ranks_held_copies_patched_over_the_codecs_threads_hold_each_version(tmp_path,
                                                                              monkeypatch):
    """`RankEncoder.commit` moves its held host copies by the version's changes over the
    codec's threads (work this small is made to take them): after each commit, every held
    copy is the version's bits, and the scatters ran on more than one thread."""
    import threading

    import trainer.rank_encoder as rank_encoder

    monkeypatch.setattr("chain.codec.api._PARALLEL_MIN", 1)
    threads_seen: set[str] = set()
    real = chain.codec.api._scatter

    def put(host, pos, val):
        threads_seen.add(threading.current_thread().name)
        time.sleep(0.01)  # slow enough that each thread finds jobs left to take
        real(host, pos, val)

    monkeypatch.setattr(chain.codec.api, "_scatter", put)
    key = keys.generate(tmp_path / "k")
    store = ChainStore(tmp_path / "chain", key.public_key())
    enc = RankEncoder(store.blocks, tmp_path / "chain" / "parts", 0, 4096, threads=2)
    state = make_state(0, scale=3)
    for v in range(4):
        _publish(store, key, [enc], v, state, snapshot=v == 0)
        for s in _split(state, 1)[0]:
            assert np.array_equal(enc.held[s.name].host, rank_encoder._host_view(s.bits)), \
                s.name
        state = perturb(state, v)
    assert len(threads_seen) >= 2, threads_seen
