"""Real daemons with models of real shape counts: thousands of tensors through publish, swarm
and apply, and a region bootstrapping from a manifest of 50,000 tensors and a torrent above
1 MB, then taking two deltas of all 50,000. Both need every reply a daemon reads from a peer to
arrive whole (issue 9: a reply of more than ~128 KiB used to be cut short, so a region refused
the manifest as bad JSON)."""

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from chain.weights import WeightsDir
from tests.integration.harness import TOKEN, Cluster, http, step, tiny_model, wait_until
from trainer.publisher import Publisher


@pytest.fixture
def fast_root(tmp_path: Path) -> Iterator[Path]:
    """State dirs on tmpfs when the host has a roomy one (a container's default 64 MB is not):
    the property is reply sizes, and ~10,000 block files fsync'd on a busy disk take minutes
    (on tmpfs an fsync costs nothing). The test peaks at about 100 MB there."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or shutil.disk_usage(shm).free < 1 << 30:
        yield tmp_path
        return
    root = Path(tempfile.mkdtemp(prefix="deltaswarm-scale-", dir=shm))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_model_of_thousands_of_tensors_goes_through_publish_swarm_and_apply(
        tmp_path: Path) -> None:
    with Cluster(tmp_path) as c:
        c.trainer()
        region = c.region("r1")
        c.start_all()
        state = tiny_model(0, tensors=2_500, rows=16, cols=64)
        c.publish(0, state)
        state = step(state, 1, density=0.05)  # about 50 of each tensor's 1,024 elements
        out = c.publish(1, state)
        assert out.delta is not None and len(out.delta.tensors) == 2_500
        assert out.changed_elements > 2_500 * 20
        assert len(out.delta.to_bytes()) > 256 * 1024  # more than one socket read holds
        c.wait_all_at(1, 40)
        trainer = c.daemons["trainer"].status()
        st = region.status()
        assert st["state_digest"] == trainer["state_digest"] == out.delta.state_digest
        assert [a["artifact"] for a in st["detail"]["sync"]["applied"]] == [
            "v00000000.snapshot", "v00000001.delta"]
        cur = WeightsDir(region.state_dir / "weights").verify()  # every tensor re-hashed
        assert cur.version == 1 and cur.state_digest == out.delta.state_digest


def test_a_region_bootstraps_from_a_manifest_of_50000_tensors_and_a_torrent_over_1mb(
        fast_root: Path) -> None:
    with Cluster(fast_root) as c:
        trainer = c.trainer()
        c.start_all()
        # 50,000 tensors (an MoE checkpoint's count, issue 21) in 300-byte blocks: ~16,000 of
        # them, each a file of its own in the torrent (~105 bytes there), so the torrent grows
        # past 1 MB
        pub = Publisher(chain_dir=trainer.state_dir / "chain", key_path=c.key_path, run=c.run,
                        daemon_url=trainer.url, token=TOKEN, block_size=300)
        state = tiny_model(0, tensors=50_000, rows=1, cols=32)
        out = pub.publish(0, state)
        m = out.snapshot
        assert out.notified and m is not None and len(m.tensors) == 50_000
        assert len(m.to_bytes()) > 2 << 20

        def torrent() -> bytes | None:
            code, body, _ = http(f"{trainer.url}/v1/chain/torrents/{m.artifact}")
            return body if code == 200 else None

        assert len(wait_until(torrent, 20, "the trainer's torrent of v0")) > 1 << 20
        region = c.region("r1")
        region.start()
        region.wait_ready()
        c.wait_all_at(0, 90, names=["r1"])
        assert region.status()["state_digest"] == m.state_digest
        cur = WeightsDir(region.state_dir / "weights").verify()
        assert cur.version == 0 and cur.state_digest == m.state_digest
        # then a delta of the 50,000 tensors through the swarm: decoded, verified, patched and
        # brought to disk tensor by tensor between real daemons
        state = step(state, 1, density=0.1)
        out = pub.publish(1, state)
        d = out.delta
        assert d is not None and len(d.tensors) == 50_000 and out.changed_elements > 50_000
        c.wait_all_at(1, 120, names=["r1"])
        assert region.status()["state_digest"] == d.state_digest
        cur = WeightsDir(region.state_dir / "weights").verify()
        assert cur.version == 1 and cur.state_digest == d.state_digest
        # and one more: the publisher's kept copy patched a group at a time, its views and
        # spans carried from v1 (no tensor replaced), the region's spare brought forward
        spans = dict(pub._spans)
        assert spans  # the groups found back to back in the kept copy
        state = step(state, 2, density=0.1)
        d = pub.publish(2, state).delta
        assert d is not None and all(pub._spans[k] is v for k, v in spans.items())
        c.wait_all_at(2, 120, names=["r1"])
        cur = WeightsDir(region.state_dir / "weights").verify()
        assert cur.version == 2 and cur.state_digest == d.state_digest
