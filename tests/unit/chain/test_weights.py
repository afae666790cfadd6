"""Reconstruction: bit-exact HF directories from snapshots and deltas, verification, and
convergence after a kill -9 at random points of an apply."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from chain.errors import BadBlock, DigestMismatch
from chain.manifest import TensorEntry
from chain.store import ChainStore
from chain.tensortable import TensorTable
from chain.weights import WeightsDir
from tests.conftest import make_state, perturb
from tests.unit.chain.test_store import build_chain


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    if set(a) != set(b):
        return False
    return all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a
    )


def getter(store: ChainStore):
    return lambda b: store.blocks.get(b.id, b.size)


def test_snapshot_plus_deltas_reconstruct_bit_exactly(tmp_path, signing_key):
    store = ChainStore(tmp_path / "chain", signing_key.public_key())
    states = build_chain(store, signing_key, 4)
    w = WeightsDir(tmp_path / "w")
    cur = w.apply(store.plan(None, 4), getter(store))
    assert cur.version == 4
    assert same(load_file(cur.path / "model.safetensors"), states[4])
    assert w.verify().state_digest == store.manifest("v00000004.delta").state_digest
    assert not w.staging()


def test_tensors_added_removed_and_reshaped_between_versions(tmp_path, signing_key):
    from chain.sources import StateDictSource
    from chain.writer import write_artifact

    store = ChainStore(tmp_path / "chain", signing_key.public_key())
    s0 = make_state()
    m0, _ = write_artifact(store.blocks, signing_key, run="r", version=0, kind="snapshot",
                           new=StateDictSource(s0))
    store.add(m0)
    s1 = dict(perturb(s0, 1))
    del s1["master.bias"]
    s1["added.weight"] = torch.randn(3, 5).bfloat16()
    s1["layers.0.norm.weight"] = s1["layers.0.norm.weight"].reshape(4, 8).clone()
    s1["step.count"] = s1["step.count"].to(torch.int32)
    m1, _ = write_artifact(store.blocks, signing_key, run="r", version=1, kind="delta",
                           new=StateDictSource(s1), parent=StateDictSource(s0),
                           parent_manifest=m0)
    store.add(m1)
    w = WeightsDir(tmp_path / "w")
    cur = w.apply(store.plan(None, 1), getter(store))
    assert same(load_file(cur.path / "model.safetensors"), s1)


def test_corrupt_block_never_becomes_current(tmp_path, signing_key):
    store = ChainStore(tmp_path / "chain", signing_key.public_key())
    build_chain(store, signing_key, 2)
    w = WeightsDir(tmp_path / "w")
    w.apply(store.plan(None, 1), getter(store))
    m2 = store.manifest("v00000002.delta")
    path = store.blocks.path(m2.stream_blocks[0].id)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(BadBlock):
        w.apply([m2], getter(store))
    assert w.current().version == 1
    w.verify()


def test_a_bad_delta_that_passes_block_checks_is_caught_by_the_digest(tmp_path, signing_key):
    store = ChainStore(tmp_path / "chain", signing_key.public_key())
    build_chain(store, signing_key, 2)
    w = WeightsDir(tmp_path / "w")
    w.apply(store.plan(None, 1), getter(store))
    m2 = store.manifest("v00000002.delta")
    wrong = TensorEntry.model_validate(m2.tensors[0].model_dump() | {"digest": "f" * 32})
    m2_bad = m2.model_copy(update={"tensors": TensorTable.of([wrong, *m2.tensors[1:]])})
    with pytest.raises(DigestMismatch, match=wrong.name):
        w.apply([m2_bad], getter(store))
    assert w.current().version == 1
    w.verify()


CRASH_SCRIPT = r"""
import sys
from pathlib import Path
from chain.store import ChainStore
from chain.weights import WeightsDir
store = ChainStore(Path(sys.argv[1]))
w = WeightsDir(Path(sys.argv[2]))
cur = w.current()
plan = store.plan(cur.version if cur else None, int(sys.argv[3]))
print("start", flush=True)
w.apply(plan, lambda b: store.blocks.get(b.id, b.size))
"""


@pytest.mark.slow
def test_kill_during_apply_restarts_into_a_verified_state_and_converges(tmp_path, signing_key):
    """Every trial starts at v2 with two directories, so v3..v5 are all brought forward in
    place; kills land anywhere in that work, and each trial checks it really cut an apply."""
    import shutil

    from chain.sources import StateDictSource
    from chain.writer import write_artifact

    store = ChainStore(tmp_path / "chain", signing_key.public_key())
    states = build_chain(store, signing_key, 3)
    big = {f"layer.{i}.weight": (torch.randn(256, 256) * 0.02).bfloat16() for i in range(24)}
    prev_m = store.manifest("v00000003.delta")
    prev = states[3]
    for v in (4, 5):
        nxt = {**perturb(prev, v), **{k: perturb(big, v * 10 + i, 0.01)[k]
                                        for i, k in enumerate(big)}}
        m, _ = write_artifact(store.blocks, signing_key, run="r1", version=v, kind="delta",
                              new=StateDictSource(nxt), parent=StateDictSource(prev),
                              parent_manifest=prev_m)
        store.add(m)
        prev, prev_m = nxt, m
    base = tmp_path / "base"
    WeightsDir(base).apply(store.plan(None, 2), getter(store))
    assert WeightsDir(base).versions() == [1, 2]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}

    def start(target: Path) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", CRASH_SCRIPT, str(tmp_path / "chain"),
                              str(target), "5"], env=env, stdout=subprocess.PIPE)
        assert p.stdout.readline() == b"start\n"
        return p

    def wait_for(p: subprocess.Popen, ready) -> bool:
        """True once ready() holds while p still runs; False if p ends first."""
        while p.poll() is None:
            if ready():
                return True
            time.sleep(0.0005)
        return False

    ref = tmp_path / "ref"
    shutil.copytree(base, ref, symlinks=True)
    p = start(ref)  # time one uninterrupted apply (after imports) to spread kills over it
    t0 = time.monotonic()
    assert p.wait() == 0
    p.stdout.close()
    duration = time.monotonic() - t0
    rng = torch.Generator().manual_seed(1)
    target = tmp_path / "w"
    cut = in_place = 0
    for trial in range(12):
        if trial % 2 == 0:  # a fresh start at v2, then a kill during the resumed apply
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(base, target, symlinks=True)
        p = start(target)
        try:
            if trial % 4 == 0:  # aimed: the first in-place bring-forward, which random kills
                running = wait_for(p, lambda: any(target.glob(".staging-*/ADVANCE.json")))
            else:  # can all miss (0 of 12 in one CI run)
                time.sleep(float(torch.rand(1, generator=rng)) * duration * 0.45)
                running = p.poll() is None
            if running:
                os.kill(p.pid, signal.SIGKILL)  # not yet reaped, so the pid is still its own
        finally:
            p.wait()
            p.stdout.close()
        w = WeightsDir(target)
        cur = w.current()
        if running and p.returncode == -signal.SIGKILL:
            cut += 1
            in_place += any((s / "ADVANCE.json").is_file() for s in w.staging())
        if cur is not None:
            w.verify()  # whatever version is current is complete and bit-exact
    w = WeightsDir(target)
    cur = w.apply(store.plan(w.current().version, 5), getter(store))
    assert cur.version == 5
    assert same(load_file(cur.path / "model.safetensors"), prev)
    assert cur.state_digest == WeightsDir(ref).current().state_digest
    assert not w.staging()
    # the six fresh starts are killed before 45 % of an uninterrupted apply; a resumed one
    # has less left to do and may finish first on a busy host (8 of 12 flaked once in ~26)
    assert cut >= 6, f"only {cut} of 12 kills landed inside an apply"
    assert in_place >= 1, "no kill landed inside an in-place bring-forward (3 were aimed at one)"


def test_a_kill_inside_commit_after_the_shard_list_went_rebuilds(tmp_path, signing_key):
    store = ChainStore(tmp_path / "chain", signing_key.public_key())
    states = build_chain(store, signing_key, 1)
    w = WeightsDir(tmp_path / "w")
    w.apply(store.plan(None, 0), getter(store))
    m1 = store.manifest("v00000001.delta")
    staging = tmp_path / "w" / f".staging-{m1.artifact}"
    staging.mkdir()
    (staging / "model.safetensors").write_bytes(b"left by a kill inside _commit")
    cur = w.apply([m1], getter(store))
    assert cur.version == 1
    assert same(load_file(cur.path / "model.safetensors"), states[1])
    assert not w.staging()
