"""A region whose current weights were damaged while it was stopped (one flipped byte in a
shard, a truncated VERSION.json) does not serve them after a restart: the start-up check sets
them aside, status says why, and the region rebuilds the head from the snapshot and deltas the
trainer still holds, then keeps applying later deltas. Damage done while it runs is found by
the scheduled weights check and handled the same way, without a restart."""

from collections.abc import Callable
from pathlib import Path

import pytest

from chain.weights import WeightsDir
from tests.integration.harness import Cluster, Daemon, http, step, tiny_model, wait_until


def flip_last_shard_byte(d: Path) -> None:
    """One bit of the last tensor's last element (the file's last byte is tensor data)."""
    shard = sorted(d.glob("*.safetensors"))[-1]
    with open(shard, "r+b") as f:
        f.seek(-1, 2)
        b = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([b[0] ^ 0x01]))


def delete_shards(d: Path) -> None:
    for shard in d.glob("*.safetensors"):
        shard.unlink()


def truncate_version_json(d: Path) -> None:
    info = d / "VERSION.json"
    info.write_bytes(info.read_bytes()[:20])


def damaged_region_recovers(tmp_path: Path, damage: Callable[[Path], None], expect: str) -> None:
    with Cluster(tmp_path) as c:
        trainer = c.trainer()
        r1 = c.region("r1")
        c.start_all()
        states = [tiny_model(0)]
        c.publish(0, states[0], snapshot=True)
        for v in (1, 2):
            states.append(step(states[-1], v))
            c.publish(v, states[v])
        c.wait_all_at(2, 60)
        head_digest = trainer.status()["state_digest"]
        assert r1.status()["state_digest"] == head_digest
        assert r1.status()["weights_problem"] is None

        assert r1.stop() == 0
        weights = WeightsDir(r1.state_dir / "weights")
        cur = weights.current()
        assert cur is not None and cur.version == 2
        damage(cur.path)

        r1.start()
        r1.wait_ready()
        st = r1.status()  # the check runs before the node serves: never the damaged copy
        assert st["weights_problem"] is not None and expect in st["weights_problem"], st
        assert (weights.root / ".bad-v00000002").is_dir()  # set aside, never current again

        c.wait_all_at(2, 60)
        assert r1.status()["state_digest"] == head_digest
        assert weights.verify().state_digest == head_digest  # the files, not just the label
        applied = [a["artifact"] for a in r1.status()["detail"]["sync"]["applied"]]
        assert applied[0] == "v00000000.snapshot", applied  # rebuilt from the snapshot

        states.append(step(states[-1], 3))
        c.publish(3, states[3])
        c.wait_all_at(3, 60)
        assert r1.status()["state_digest"] == trainer.status()["state_digest"]
        assert weights.verify().version == 3
        assert_running(r1)


def assert_running(d: Daemon) -> None:
    assert d.proc is not None and d.proc.poll() is None, d.log()
    wait_until(lambda: d.status()["current_version"] is not None, 5, "status to answer")


def test_flipped_byte_in_current_weights_is_set_aside_and_rebuilt(tmp_path: Path) -> None:
    damaged_region_recovers(tmp_path, flip_last_shard_byte, "tensors differ")


def test_truncated_version_json_is_reported_and_rebuilt(tmp_path: Path) -> None:
    damaged_region_recovers(tmp_path, truncate_version_json, "truncated")


@pytest.mark.parametrize(("damage", "expect"), [(flip_last_shard_byte, "layers.3.weight"),
                                               (delete_shards, "no .safetensors")],
                         ids=["flipped-byte", "shards-deleted"])
def test_damage_while_running_is_found_by_the_scheduled_check_and_rebuilt(
        tmp_path: Path, damage: Callable[[Path], None], expect: str) -> None:
    with Cluster(tmp_path) as c:
        trainer = c.trainer()
        r1 = c.region("r1", self_check={"interval_s": 2})
        c.start_all()
        states = [tiny_model(0)]
        c.publish(0, states[0], snapshot=True)
        for v in (1, 2):
            states.append(step(states[-1], v))
            c.publish(v, states[v])
        c.wait_all_at(2, 60)
        head_digest = trainer.status()["state_digest"]
        weights = WeightsDir(r1.state_dir / "weights")
        wait_until(lambda: (cur := weights.current()) is not None and cur.version == 2, 30,
                   "the disk to reach v2 (engine first brings it forward after serving)")
        runs = r1.status()["weights_check"]["runs"]  # passes may have run before v0 landed
        wait_until(lambda: r1.status()["weights_check"]["runs"] > runs, 30,
                   "a weights check over the held versions")
        clean = r1.status()
        assert clean["weights_check"]["damaged_found"] == 0 and clean["weights_problem"] is None
        assert clean["weights_check"]["bytes_checked"] > 0
        pid = r1.proc.pid

        damage(weights.current().path)
        wait_until(lambda: r1.status()["weights_check"]["damaged_found"] >= 1, 60,
                   "the scheduled check to find the flipped byte")
        st = r1.status()
        assert "scheduled check" in st["weights_problem"], st["weights_problem"]
        assert expect in st["weights_problem"], st["weights_problem"]
        [found] = st["weights_check"]["found"]
        assert found["version"] == 2 and found["count"] == 1 and "set aside" in found["action"]
        assert (weights.root / ".bad-v00000002").is_dir()

        def rebuilt() -> bool:
            cur = weights.current()
            return cur is not None and cur.version == 2 and weights.verify() == cur
        wait_until(rebuilt, 60, "the region to rebuild v2 from the snapshot")
        assert weights.verify().state_digest == head_digest  # the files, not just the label
        applied = [a["artifact"] for a in r1.status()["detail"]["sync"]["applied"]]
        assert applied[-3:] == ["v00000000.snapshot", "v00000001.delta", "v00000002.delta"], \
            applied
        assert r1.proc.pid == pid and r1.proc.poll() is None  # no restart
        metrics = http(f"{r1.url}/metrics", token=None)[1].decode()
        assert "deltaswarm_weights_check_damaged_versions_total 1.0" in metrics
        assert "deltaswarm_weights_problem 1.0" in metrics

        states.append(step(states[-1], 3))
        c.publish(3, states[3])
        c.wait_all_at(3, 60)
        assert r1.status()["state_digest"] == trainer.status()["state_digest"]
        wait_until(lambda: weights.verify().version == 3, 30, "the disk to reach v3")


def test_damaged_disk_under_pending_patches_is_rebuilt_and_the_patches_follow(tmp_path: Path
                                                                              ) -> None:
    """Engine first with a disk held back (it catches up only after 100 versions or an hour
    idle): v1 and v2 are patches over a disk at v0 when the check finds v0 damaged. The
    patches decoded over it go with it; the region rebuilds v0 from the snapshot and decodes
    v1 and v2 again over the clean copy, then follows v3."""
    with Cluster(tmp_path) as c:
        c.trainer()
        r1 = c.region("r1", self_check={"interval_s": 2},
                      sync={"disk_batch_versions": 100, "disk_idle_s": 3600})
        c.start_all()
        states = [tiny_model(0)]
        c.publish(0, states[0], snapshot=True)
        c.wait_all_at(0, 60)

        def pending() -> list[int]:
            return r1.status()["detail"]["sync"]["engine_first"]["pending"]

        for v in (1, 2):
            states.append(step(states[-1], v))
            c.publish(v, states[v])
        wait_until(lambda: pending() == [1, 2], 60, "v1 and v2 patched over the disk at v0")
        weights = WeightsDir(r1.state_dir / "weights")
        assert weights.current().version == 0  # held back

        flip_last_shard_byte(weights.current().path)
        wait_until(lambda: r1.status()["weights_check"]["damaged_found"] >= 1, 60,
                   "the scheduled check to find the flipped byte under the patches")
        assert (weights.root / ".bad-v00000000").is_dir()
        wait_until(lambda: pending() == [1, 2] and r1.current() == 0, 60,
                   "v0 rebuilt and v1, v2 decoded again over it")
        assert weights.verify().version == 0
        applied = [a["artifact"] for a in r1.status()["detail"]["sync"]["applied"]]
        assert applied[-3:] == ["v00000000.snapshot", "v00000001.delta", "v00000002.delta"], \
            applied

        states.append(step(states[-1], 3))
        c.publish(3, states[3])
        wait_until(lambda: pending() == [1, 2, 3], 60, "v3 patched over the rebuilt disk")
        assert_running(r1)
