"""Write leases (issue 20, finding 1): retention in another process spares the blocks of a version
being written and of manifests it has not loaded; a killed writer's lease stops counting, a
paused one's does not; a version whose blocks vanished anyway is never signed into the chain."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from chain import keys
from chain.lease import LEASE_DIR, LostBlocks, leases
from chain.policy import Retention
from chain.sources import ArraySource
from chain.store import ChainStore
from chain.writer import write_artifact
from tests.support import wait_until

REPO = Path(__file__).resolve().parents[3]
N = 40_000


def _state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {f"t{i}": ("bfloat16", [N], rng.integers(0, 1 << 14, N).astype(np.uint16))
            for i in range(3)}


def _write(store: ChainStore, key, version: int, new: dict, parent: dict | None):
    if parent is None:
        return write_artifact(store.blocks, key, run="r", version=version, kind="snapshot",
                              new=ArraySource(new), block_size=1 << 16)[0]
    head = store.get(version - 1, "delta") or store.get(version - 1, "snapshot")
    return write_artifact(store.blocks, key, run="r", version=version, kind="delta",
                          new=ArraySource(new), parent=ArraySource(parent),
                          parent_manifest=head, block_size=1 << 16)[0]


def _gc_elsewhere(chain: Path) -> list[str]:
    """Retention as the trainer daemon runs it: another process, its own store of the dir."""
    code = ("import json, sys\nfrom chain.policy import Retention\n"
            "from chain.store import ChainStore\n"
            "s = ChainStore(sys.argv[1])\n"
            "print(json.dumps(s.gc(Retention(versions=1))))\n")
    r = subprocess.run([sys.executable, "-c", code, str(chain)], cwd=REPO, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture
def chain(tmp_path):
    key = keys.generate(tmp_path / "k")
    store = ChainStore(tmp_path / "chain", key.public_key())
    s0 = _state(0)
    store.add(_write(store, key, 0, s0, None))
    return store, key, s0


def test_retention_in_another_process_spares_the_version_being_written(chain):
    store, key, s0 = chain
    s1 = {k: (d, sh, b + 1) for k, (d, sh, b) in s0.items()}
    with store.writing(1):
        m1 = _write(store, key, 1, s1, s0)  # blocks written, not signed yet
        assert [w.version for w in leases(store.root)] == [1]
        assert _gc_elsewhere(store.root) == []
        assert store.missing_blocks(m1) == []
        store.add(m1)
    assert not list((store.root / LEASE_DIR).glob("v*.json"))
    assert store.head() == 1 and store.has_blocks(m1)


def test_retention_spares_blocks_of_manifests_it_has_not_loaded(chain):
    store, key, s0 = chain
    daemon = ChainStore(store.root)  # loaded at v0, like a daemon not told of v1 yet
    s1 = {k: (d, sh, b + 1) for k, (d, sh, b) in s0.items()}
    with store.writing(1):
        m1 = store.add(_write(store, key, 1, s1, s0))
    daemon.gc(Retention(versions=1))
    assert store.has_blocks(m1)


def test_a_block_reused_from_an_old_version_is_claimed_again(chain):
    """A new version made of a block only a dropped version named: the re-put refreshes it,
    so retention treats it as written under the lease."""
    store, _, _ = chain
    old = store.blocks.put(b"an old tokenizer")
    past = time.time() - 3600
    os.utime(store.blocks.path(old), (past, past))
    with store.writing(1):
        assert store.blocks.put(b"an old tokenizer") == old
        assert _gc_elsewhere(store.root) == []
        assert store.blocks.has(old)


def test_a_version_whose_blocks_vanished_is_not_signed_and_the_next_try_works(chain):
    store, key, s0 = chain
    s1 = {k: (d, sh, b + 1) for k, (d, sh, b) in s0.items()}
    with store.writing(1):
        m1 = _write(store, key, 1, s1, s0)
        store.blocks.delete(m1.blocks[0].id)  # something that ignores leases
        with pytest.raises(LostBlocks, match="Nothing was signed; the head is still v0"):
            store.add(m1)
    assert store.head() == 0 and not (store.manifest_dir / f"{m1.artifact}.json").exists()
    with store.writing(1):
        store.add(_write(store, key, 1, s1, s0))
    assert store.head() == 1


HOLDER = """
import sys, time
from chain.store import ChainStore
s = ChainStore(sys.argv[1])
lease = s.writing(1, ttl_s=float(sys.argv[2])).acquire()
s.blocks.put(b"half of v1")
print("held", flush=True)
time.sleep(600)
"""


def _holder(chain: Path, ttl: float) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(chain), str(ttl)], cwd=REPO,
                         stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert p.stdout.readline().strip() == "held"
    except BaseException:
        p.kill()
        p.wait()
        p.stdout.close()
        raise
    return p


def test_a_paused_writer_keeps_its_blocks_past_the_ttl_and_a_killed_one_loses_them(chain):
    store, _, _ = chain
    bid = store.blocks.put(b"half of v1")  # the holder's block (same content, same id)
    p = _holder(store.root, 0.5)
    try:
        os.kill(p.pid, signal.SIGSTOP)  # no renewals now; the process still exists
        time.sleep(1.5)
        store.gc(Retention(versions=1))
        assert store.blocks.has(bid) and len(leases(store.root)) == 1
        os.kill(p.pid, signal.SIGCONT)
    finally:
        p.kill()
        p.wait()
        p.stdout.close()
    wait_until(lambda: not store.gc(Retention(versions=1)) and not leases(store.root), 10,
               "the dead writer's lease to be swept")
    assert not store.blocks.has(bid)
