"""Bringing the older weights directory forward in place: the current directory is never
written, damaged or missing bookkeeping falls back to copying from current, an interrupted
bring-forward resumes bit-exactly, and the checks at start drop a current version that no
longer matches its digests."""

import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from chain.errors import ChainError
from chain.sources import StateDictSource
from chain.store import ChainStore
from chain.versiondir import BadVersionDir, read_changes, write_changes
from chain.weights import WeightsDir
from chain.writer import write_artifact
from tests.conftest import make_state, perturb
from tests.unit.chain.test_store import build_chain
from tests.unit.chain.test_weights import getter, same

SHARD = "model.safetensors"


@pytest.fixture(autouse=True, params=["whole", "parts"])
def write_parts(request, monkeypatch) -> None:
    """Every case twice: each tensor written by one job, and in parts of 64 elements (what a
    tensor over chain.fill.PART gets), whose digest moves must add up to the same."""
    if request.param == "parts":
        monkeypatch.setattr("chain.fill.PART", 64)


def _fingerprint(d: Path) -> dict[str, tuple[int, int, bytes]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(d.iterdir())}


def test_a_delta_rewrites_the_older_directory_and_never_touches_current(tmp_path, signing_key):
    store = ChainStore(tmp_path / "chain", signing_key.public_key())
    states = build_chain(store, signing_key, 3)
    w = WeightsDir(tmp_path / "w")
    w.apply(store.plan(None, 1), getter(store))
    assert w.versions() == [0, 1]
    spare_inode = (w.path(0) / SHARD).stat().st_ino
    before = _fingerprint(w.path(1))
    cur = w.apply([store.manifest("v00000002.delta")], getter(store))
    assert w.versions() == [1, 2] and cur.version == 2
    assert (cur.path / SHARD).stat().st_ino == spare_inode  # same file, patched in place
    assert _fingerprint(w.path(1)) == before  # the version an engine may be reading
    assert same(load_file(cur.path / SHARD), states[2])
    changes = read_changes(cur.path, 2)
    assert changes is not None and sum(p.size for p in changes.values() if p is not None) > 0
    cur = w.apply([store.manifest("v00000003.delta")], getter(store))
    assert same(load_file(cur.path / SHARD), states[3])
    assert w.verify() == cur


def test_a_spare_damaged_where_it_is_patched_is_rebuilt_from_current(tmp_path, signing_key):
    store = ChainStore(tmp_path / "chain", signing_key.public_key())
    states = build_chain(store, signing_key, 2)
    w = WeightsDir(tmp_path / "w")
    w.apply(store.plan(None, 1), getter(store))
    name, pos = next((n, p) for n, p in read_changes(w.path(1), 1).items()
                     if p is not None and p.size)
    from chain.safetensors_io import WritableFiles

    spare = WritableFiles(w.path(0), [SHARD])
    spare.bits(name)[pos[0]] ^= 0x5A5A
    spare.flush()
    del spare
    cur = w.apply([store.manifest("v00000002.delta")], getter(store))
    assert same(load_file(cur.path / SHARD), states[2])


@pytest.mark.parametrize("damage", ["changes_missing", "changes_garbled", "spare_version",
                                    "positions_past_the_tensor"])
def test_missing_or_damaged_bookkeeping_falls_back_to_copying_from_current(tmp_path,
                                                                            signing_key, damage):
    store = ChainStore(tmp_path / "chain", signing_key.public_key())
    states = build_chain(store, signing_key, 2)
    w = WeightsDir(tmp_path / "w")
    w.apply(store.plan(None, 1), getter(store))
    if damage == "changes_missing":
        (w.path(1) / "CHANGES").unlink()
    elif damage == "changes_garbled":
        raw = bytearray((w.path(1) / "CHANGES").read_bytes())
        raw[-3] ^= 0xFF
        (w.path(1) / "CHANGES").write_bytes(bytes(raw))
    elif damage == "positions_past_the_tensor":  # well formed, checksummed, but wrong
        changes = dict(read_changes(w.path(1), 1))
        sizes = {n: a.numel() for n, a in load_file(w.path(1) / SHARD).items()}
        for name, pos in changes.items():
            if pos is not None:  # the kernels check no bounds: these must not be written
                changes[name] = np.concatenate([pos, [sizes[name] + 3, 8 * sizes[name]]])
        write_changes(w.path(1), 1, changes)
    else:
        (w.path(0) / "VERSION.json").write_text("{")
    cur = w.apply([store.manifest("v00000002.delta")], getter(store))
    assert same(load_file(cur.path / SHARD), states[2])
    assert w.verify() == cur


def test_an_interrupted_bring_forward_resumes_bit_exactly(tmp_path, signing_key):
    store = ChainStore(tmp_path / "chain", signing_key.public_key())
    states = build_chain(store, signing_key, 2)
    w = WeightsDir(tmp_path / "w")
    w.apply(store.plan(None, 1), getter(store))
    m2 = store.manifest("v00000002.delta")

    stopped: list[tuple[int, int]] = []

    def stop(artifact: str, done: int, total: int) -> None:
        if done >= 2 and not stopped:  # a group record's tensors report once, together
            stopped.append((done, total))
            raise KeyboardInterrupt  # stands in for a kill between two tensors

    with pytest.raises(KeyboardInterrupt):
        w.apply([m2], getter(store), stop)
    assert w.current().version == 1 and w.versions() == [1]
    (staging,) = w.staging()
    assert (staging / "ADVANCE.json").is_file()
    [(done, total)] = stopped
    assert done < total  # stopped part way
    assert (staging / "JOURNAL").read_text().count("\n") == done
    cur = w.apply([m2], getter(store))
    assert same(load_file(cur.path / SHARD), states[2]) and not w.staging()


def test_one_flipped_byte_in_a_shard_is_found_at_start_and_current_dropped(tmp_path,
                                                                           signing_key):
    store = ChainStore(tmp_path / "chain", signing_key.public_key())
    build_chain(store, signing_key, 2)
    w = WeightsDir(tmp_path / "w")
    w.apply(store.plan(None, 2), getter(store))
    assert w.check_at_start() == (w.current(), None)
    shard = w.current().path / SHARD
    raw = bytearray(shard.read_bytes())
    raw[-7] ^= 0x01
    shard.write_bytes(bytes(raw))
    cur, problem = w.check_at_start()
    assert cur is None and w.current() is None
    assert "failed verification" in problem and "tensors differ" in problem
    assert (tmp_path / "w" / ".bad-v00000002").is_dir()
    cur = w.apply(store.plan(None, 2), getter(store))  # back from the snapshot
    assert cur.version == 2 and w.verify() == cur


def test_a_truncated_version_file_is_a_clear_error_and_dropped_at_start(tmp_path, signing_key):
    store = ChainStore(tmp_path / "chain", signing_key.public_key())
    build_chain(store, signing_key, 1)
    w = WeightsDir(tmp_path / "w")
    w.apply(store.plan(None, 1), getter(store))
    info = w.current().path / "VERSION.json"
    info.write_bytes(info.read_bytes()[:40])
    with pytest.raises(BadVersionDir, match="truncated or not JSON"):
        w.current()
    cur, problem = w.check_at_start()
    assert cur is None and "truncated" in problem
    assert w.current() is None


def test_a_version_dir_from_an_older_build_is_refused_by_name(tmp_path, signing_key):
    store = ChainStore(tmp_path / "chain", signing_key.public_key())
    build_chain(store, signing_key, 0)
    w = WeightsDir(tmp_path / "w")
    cur = w.apply(store.plan(None, 0), getter(store))
    (cur.path / "VERSION.json").write_text('{"version": 0, "state_digest": "x", "tensors": {}}')
    with pytest.raises(ChainError, match=r"format None.*another deltaswarm version"):
        w.current()


def test_every_file_of_a_version_has_the_shards_mode(tmp_path, signing_key):
    store = ChainStore(tmp_path / "chain", signing_key.public_key())
    s0 = make_state()
    files = {"config.json": b'{"a": 1}', "tokenizer.json": b"{}"}
    old = os.umask(0o027)
    try:
        m0, _ = write_artifact(store.blocks, signing_key, run="r", version=0, kind="snapshot",
                               new=StateDictSource(s0), files=files)
        store.add(m0)
        s1, s2 = perturb(s0, 1), perturb(perturb(s0, 1), 2)
        m1, _ = write_artifact(store.blocks, signing_key, run="r", version=1, kind="delta",
                               new=StateDictSource(s1), parent=StateDictSource(s0),
                               parent_manifest=m0, files=files)
        store.add(m1)
        m2, _ = write_artifact(store.blocks, signing_key, run="r", version=2, kind="delta",
                               new=StateDictSource(s2), parent=StateDictSource(s1),
                               parent_manifest=m1, files={"config.json": b"{}"})
        store.add(m2)
        w = WeightsDir(tmp_path / "w")
        for m in (m0, m1, m2):  # fresh from a snapshot, fresh from a delta, in place
            cur = w.apply([m], getter(store))
            modes = {p.name: p.stat().st_mode & 0o777 for p in cur.path.iterdir()}
            assert set(modes.values()) == {0o640}, modes
    finally:
        os.umask(old)
    assert sorted(p.name for p in cur.path.iterdir()) == ["CHANGES", "VERSION.json",
                                                         "config.json", SHARD]
    assert (cur.path / "config.json").read_bytes() == b"{}"


def test_keep_below_two_still_keeps_a_spare(tmp_path, signing_key):
    store = ChainStore(tmp_path / "chain", signing_key.public_key())
    states = build_chain(store, signing_key, 3)
    w = WeightsDir(tmp_path / "w", keep=1)
    cur = w.apply(store.plan(None, 3), getter(store))
    assert w.versions() == [2, 3]
    assert same(load_file(cur.path / SHARD), states[3])
    assert np.all([p.name != ".staging" for p in (tmp_path / "w").iterdir()])


def test_a_kill_between_the_rename_and_the_link_only_moves_the_link(tmp_path, signing_key):
    from chain.atomic import symlink_atomic

    store = ChainStore(tmp_path / "chain", signing_key.public_key())
    states = build_chain(store, signing_key, 2)
    w = WeightsDir(tmp_path / "w")
    w.apply(store.plan(None, 2), getter(store))
    inode = (w.path(2) / SHARD).stat().st_ino
    symlink_atomic(w.path(1).name, tmp_path / "w" / "current")
    assert w.current().version == 1
    cur = w.apply([store.manifest("v00000002.delta")], getter(store))
    assert cur.version == 2 and (cur.path / SHARD).stat().st_ino == inode
    assert w.versions() == [1, 2] and same(load_file(cur.path / SHARD), states[2])
