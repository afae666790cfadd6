"""`deltaswarm delta …` and `deltaswarm chain …` as a user runs them (real subprocesses)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from chain import keys
from chain.store import ChainStore
from tests.conftest import make_state, perturb
from tests.unit.chain.test_store import build_chain

REPO = Path(__file__).resolve().parents[3]


def ds(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "daemon.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200"})


def test_delta_encode_apply_round_trips_bit_exactly(tmp_path):
    old, new = make_state(), perturb(make_state(), 1, density=0.02)
    save_file(old, tmp_path / "old.safetensors")
    save_file(new, tmp_path / "new.safetensors")
    r = ds("delta", "encode", str(tmp_path / "old.safetensors"), str(tmp_path / "new.safetensors"),
           "-o", str(tmp_path / "v1.delta"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bits/change" in r.stdout
    r = ds("delta", "apply", str(tmp_path / "old.safetensors"), str(tmp_path / "v1.delta"),
           "-o", str(tmp_path / "out.safetensors"))
    assert r.returncode == 0, r.stdout + r.stderr
    got = load_file(tmp_path / "out.safetensors")
    assert set(got) == set(new)
    for k in new:
        assert torch.equal(got[k].reshape(-1).view(torch.uint8),
                           new[k].reshape(-1).view(torch.uint8))
    r = ds("delta", "stats", str(tmp_path / "v1.delta"), "--tensors")
    # the bf16 tensors (all small) travel as one group record, named by its first tensor
    assert r.returncode == 0 and "embed.weight +4" in r.stdout and "group" in r.stdout, r.stdout
    assert "7 tensors, 5 in 1 records" in r.stdout


def test_delta_apply_refuses_the_wrong_base_and_a_truncated_file(tmp_path):
    old, new = make_state(), perturb(make_state(), 1)
    save_file(old, tmp_path / "old.safetensors")
    save_file(new, tmp_path / "new.safetensors")
    ds("delta", "encode", str(tmp_path / "old.safetensors"), str(tmp_path / "new.safetensors"),
       "-o", str(tmp_path / "v1.delta"))
    r = ds("delta", "apply", str(tmp_path / "new.safetensors"), str(tmp_path / "v1.delta"),
           "-o", str(tmp_path / "out.safetensors"))
    assert r.returncode == 2 and "not the base this delta was made from" in r.stdout
    data = (tmp_path / "v1.delta").read_bytes()
    (tmp_path / "cut.delta").write_bytes(data[: len(data) - 40])
    r = ds("delta", "apply", str(tmp_path / "old.safetensors"), str(tmp_path / "cut.delta"),
           "-o", str(tmp_path / "out.safetensors"))
    assert r.returncode == 2 and "error" in r.stdout
    assert not (tmp_path / "out.safetensors").exists()


def test_chain_ls_show_verify(tmp_path, signing_key):
    store = ChainStore(tmp_path / "chain", signing_key.public_key())
    build_chain(store, signing_key, 3)
    pub = keys.public_hex(signing_key)
    r = ds("chain", "ls", str(tmp_path / "chain"))
    assert r.returncode == 0 and "v00000003.delta" in r.stdout and "head: v3" in r.stdout
    r = ds("chain", "show", str(tmp_path / "chain"), "v00000002.delta")
    assert json.loads(r.stdout)["version"] == 2
    r = ds("chain", "verify", str(tmp_path / "chain"), "--key", pub)
    assert r.returncode == 0 and "4 ok, 0 bad" in r.stdout
    m = store.manifest("v00000002.delta")
    path = store.blocks.path(m.blocks[0].id)
    path.write_bytes(path.read_bytes()[:-1] + b"!")
    other = keys.public_hex(keys.generate(tmp_path / "other.key"))
    r = ds("chain", "verify", str(tmp_path / "chain"), "--key", other)
    assert r.returncode == 1 and "4 bad" in r.stdout
    r = ds("chain", "verify", str(tmp_path / "chain"), "--key", pub)
    assert r.returncode == 1 and "v00000002.delta" in r.stdout and "3 ok, 1 bad" in r.stdout


def test_chain_verify_tells_corrupt_from_not_held(tmp_path, signing_key):
    """A region holds manifests of snapshots it never fetched: that is "not held" (exit 0, or
    3 with --require-all), never "bad"; a flipped byte in a held block is corrupt (exit 1)."""
    store = ChainStore(tmp_path / "chain", signing_key.public_key())
    build_chain(store, signing_key, 3)
    pub = keys.public_hex(signing_key)
    gone = store.manifest("v00000001.delta")
    for b in gone.blocks:
        store.blocks.delete(b.id)
    r = ds("chain", "verify", str(tmp_path / "chain"), "--key", pub)
    assert r.returncode == 0, r.stdout
    assert "not held v00000001.delta" in r.stdout and "3 ok, 0 bad, 1 not held" in r.stdout
    r = ds("chain", "verify", str(tmp_path / "chain"), "--key", pub, "--require-all")
    assert r.returncode == 3, r.stdout
    m = store.manifest("v00000002.delta")
    path = store.blocks.path(m.blocks[0].id)
    path.write_bytes(path.read_bytes()[:-1] + b"!")
    for extra in ((), ("--require-all",)):
        r = ds("chain", "verify", str(tmp_path / "chain"), "--key", pub, *extra)
        assert r.returncode == 1, r.stdout
        assert "BAD v00000002.delta" in r.stdout and "2 ok, 1 bad, 1 not held" in r.stdout
    r = ds("chain", "--help")
    assert "exit codes" in r.stdout and "--require-all" in r.stdout
