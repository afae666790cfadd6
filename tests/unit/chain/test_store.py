"""The chain store: blocks verified on read, manifests checked against the held chain, planner
and retention."""

import pytest

from chain.blocks import BlockStore
from chain.errors import BadBlock, BadManifest, NoPath
from chain.policy import Retention, SnapshotPolicy
from chain.sources import StateDictSource
from chain.store import ChainStore
from chain.writer import write_artifact
from tests.conftest import make_state, perturb


def build_chain(store: ChainStore, key, versions: int, snapshot_every: int = 0, run: str = "r1",
                direct_positions: int = -1):
    states = [make_state()]
    m0, _ = write_artifact(store.blocks, key, run=run, version=0, kind="snapshot",
                           new=StateDictSource(states[0]))
    store.add(m0)
    parent = m0
    for v in range(1, versions + 1):
        states.append(perturb(states[-1], v))
        m, _ = write_artifact(store.blocks, key, run=run, version=v, kind="delta",
                              new=StateDictSource(states[-1]), parent=StateDictSource(states[-2]),
                              parent_manifest=parent, direct_positions=direct_positions)
        store.add(m)
        parent = m
        if snapshot_every and v % snapshot_every == 0:
            s, _ = write_artifact(store.blocks, key, run=run, version=v, kind="snapshot",
                                  new=StateDictSource(states[-1]))
            store.add(s)
    return states


def test_block_store_refuses_corrupt_and_missing_blocks(tmp_path):
    blocks = BlockStore(tmp_path)
    bid = blocks.put(b"hello world")
    assert blocks.get(bid) == b"hello world"
    blocks.path(bid).write_bytes(b"hello wOrld")
    with pytest.raises(BadBlock, match="corrupt"):
        blocks.get(bid)
    with pytest.raises(BadBlock, match="not in the store"):
        blocks.get("0" * 32)
    with pytest.raises(BadBlock, match="invalid block id"):
        blocks.get("../../etc/passwd")


def test_block_store_leaves_no_temp_files(tmp_path):
    blocks = BlockStore(tmp_path)
    for i in range(20):
        blocks.put(bytes([i]) * 1000)
    assert len(blocks.ids()) == 20
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


def test_store_reloads_from_disk(tmp_path, signing_key):
    store = ChainStore(tmp_path, signing_key.public_key())
    build_chain(store, signing_key, 3)
    again = ChainStore(tmp_path, signing_key.public_key())
    assert again.artifacts() == store.artifacts()
    assert again.head() == 3


def test_wrong_parent_and_forks_are_refused_without_changing_the_store(tmp_path, signing_key):
    store = ChainStore(tmp_path / "a", signing_key.public_key())
    build_chain(store, signing_key, 2)
    other = ChainStore(tmp_path / "b", signing_key.public_key())
    build_chain(other, signing_key, 3, run="r1")  # same run name, same states: compatible
    fork_store = ChainStore(tmp_path / "c", signing_key.public_key())
    states = [make_state(seed=7)]
    m0, _ = write_artifact(fork_store.blocks, signing_key, run="r1", version=0, kind="snapshot",
                           new=StateDictSource(states[0]))
    fork_store.add(m0)
    m1, _ = write_artifact(fork_store.blocks, signing_key, run="r1", version=1, kind="delta",
                           new=StateDictSource(perturb(states[0], 1)),
                           parent=StateDictSource(states[0]), parent_manifest=m0)
    fork_store.add(m1)
    m2, _ = write_artifact(fork_store.blocks, signing_key, run="r1", version=2, kind="delta",
                           new=StateDictSource(perturb(perturb(states[0], 1), 2)),
                           parent=StateDictSource(perturb(states[0], 1)), parent_manifest=m1)
    before = sorted(p.name for p in (tmp_path / "a" / "manifests").iterdir())
    with pytest.raises(BadManifest, match="conflicts"):
        store.add_manifest(m2.to_bytes())  # replayed/forked v2
    fork_v2 = perturb(perturb(states[0], 1), 2)
    m3_fork, _ = write_artifact(fork_store.blocks, signing_key, run="r1", version=3,
                                kind="delta", new=StateDictSource(perturb(fork_v2, 3)),
                                parent=StateDictSource(fork_v2), parent_manifest=m2)
    with pytest.raises(BadManifest, match="wrong parent"):
        store.add_manifest(m3_fork.to_bytes())  # v3 built on the fork's v2, not ours
    fresh = other.manifest("v00000003.delta")
    store.add_manifest(fresh.to_bytes())  # the honest v3 fits
    with pytest.raises(BadManifest, match="run"):
        foreign, _ = write_artifact(store.blocks, signing_key, run="other-run", version=9,
                                    kind="snapshot", new=StateDictSource(make_state()))
        store.add(foreign)
    after = sorted(p.name for p in (tmp_path / "a" / "manifests").iterdir())
    assert after == [*before, "v00000003.delta.json"]


def test_planner_takes_deltas_from_a_held_version(tmp_path, signing_key):
    store = ChainStore(tmp_path, signing_key.public_key())
    build_chain(store, signing_key, 5, snapshot_every=3)
    assert [m.artifact for m in store.plan(2, 5)] == [
        "v00000003.delta", "v00000004.delta", "v00000005.delta"]
    assert store.plan(5, 5) == []


def test_late_joiner_starts_from_the_cheapest_snapshot(tmp_path, signing_key):
    store = ChainStore(tmp_path, signing_key.public_key())
    build_chain(store, signing_key, 5, snapshot_every=3)
    assert [m.artifact for m in store.plan(None, 5)] == [
        "v00000003.snapshot", "v00000004.delta", "v00000005.delta"]


def test_planner_reports_when_no_path_exists(tmp_path, signing_key):
    store = ChainStore(tmp_path, signing_key.public_key())
    build_chain(store, signing_key, 3)
    (tmp_path / "manifests" / "v00000002.delta.json").unlink()
    store = ChainStore(tmp_path, signing_key.public_key())
    with pytest.raises(NoPath, match="no path from v1 to v3"):
        store.plan(1, 3)


def test_retention_keeps_a_bootstrap_path_and_gc_drops_the_rest(tmp_path, signing_key):
    store = ChainStore(tmp_path, signing_key.public_key())
    build_chain(store, signing_key, 8, snapshot_every=4)
    dropped = store.gc(Retention(versions=3))
    assert "v00000000.snapshot" in dropped and "v00000001.delta" in dropped
    assert {"v00000004.snapshot", "v00000005.delta", "v00000008.delta"} <= set(store.artifacts())
    assert store.plan(4, 7)[0].artifact == "v00000005.delta"
    live = {b.id for m in store.manifests().values() for b in m.blocks}
    assert store.blocks.ids() == live


def test_snapshot_policy_every_n_and_when_deltas_outweigh(tmp_path, signing_key):
    store = ChainStore(tmp_path, signing_key.public_key())
    build_chain(store, signing_key, 3)
    ms = store.manifests()
    assert SnapshotPolicy(every=3, max_delta_ratio=100).due(3, ms)
    assert not SnapshotPolicy(every=10, max_delta_ratio=100).due(3, ms)
    assert SnapshotPolicy(every=10, max_delta_ratio=0.01).due(3, ms)


def test_a_corrupt_manifest_on_disk_is_named_when_the_store_opens(tmp_path, signing_key):
    store = ChainStore(tmp_path / "chain", signing_key.public_key())
    build_chain(store, signing_key, 1)
    bad = tmp_path / "chain" / "manifests" / "v00000001.delta.json"
    bad.write_bytes(b'{"format": 1, "run": ')
    with pytest.raises(BadManifest, match=r"v00000001\.delta\.json.*delete the file"):
        ChainStore(tmp_path / "chain", signing_key.public_key())
