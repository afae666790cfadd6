"""One trainer daemon and four region daemons as real processes on loopback with real
libtorrent: five versions published, every region ends on the head with the trainer's state
digest, regions serve each other, and a late joiner that knows only one region bootstraps from
a snapshot plus the deltas after it."""

import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from chain.weights import WeightsDir
from tests.integration.harness import Cluster, step, tiny_model

REGIONS = ["r1", "r2", "r3", "r4"]
HEAD = 6


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root: Path = tmp_path_factory.mktemp("swarm")
    with Cluster(root) as c:
        # a thin trainer uplink, so regions fetch most pieces from each other
        c.trainer(limits={"upload_bytes_per_s": 1_500_000})
        hook_log = root / "engine.log"
        for name in REGIONS:
            c.region(name, engine={"type": "command", "argv": [
                "sh", "-c", f"echo {{version}} {{state_digest}} {{path}} >> {hook_log}.{name}"]}
                if name == "r1" else {"type": "none"})
        c.start_all()
        state = tiny_model(0)
        c.publish(0, state)
        c.wait_all_at(0, 60)
        for v in range(1, HEAD + 1):
            state = step(state, v)
            c.publish(v, state, snapshot=(v == 3))
        c.wait_all_at(HEAD, 90)
        yield c


def test_every_region_ends_on_the_head_with_the_trainers_state_digest(cluster: Cluster) -> None:
    trainer = cluster.daemons["trainer"].status()
    assert trainer["current_version"] == HEAD
    for name in REGIONS:
        d = cluster.daemons[name]
        st = d.status()
        assert st["current_version"] == HEAD and st["lag"] == 0
        assert st["state_digest"] == trainer["state_digest"]
        cur = WeightsDir(d.state_dir / "weights").verify()  # digests recomputed from the files
        assert cur.version == HEAD and cur.state_digest == trainer["state_digest"]
        weights = d.get("/v1/weights/current")
        assert weights["version"] == HEAD and Path(weights["path"]).is_dir()


def test_regions_upload_to_each_other_and_save_bytes(cluster: Cluster) -> None:
    statuses = {n: cluster.daemons[n].status() for n in REGIONS}
    region_up = sum(s["totals"]["bytes_up"] for s in statuses.values())
    region_down = sum(s["totals"]["bytes_down"] for s in statuses.values())
    assert region_up > 0, json.dumps(statuses["r1"]["totals"])
    trainer_up = cluster.daemons["trainer"].status()["totals"]["bytes_up"]
    assert trainer_up < region_down  # not every byte came from the trainer
    for s in statuses.values():
        # Every version once, in order, ending on the head; a region that fell behind while v3's
        # snapshot was published may take it instead of v1-v3's deltas (the planner's cheaper
        # path), so not necessarily all HEAD + 1 of them.
        applied = [(a["version"], a["artifact"]) for a in s["detail"]["sync"]["applied"]]
        versions = [v for v, _ in applied]
        assert versions == sorted(set(versions)) and versions[-1] == HEAD, applied
        for (prev, _), (v, artifact) in itertools.pairwise(applied):
            assert artifact.endswith(".snapshot") or v == prev + 1, applied
        assert s["totals"]["versions_applied"] == len(applied)
        assert s["totals"]["bytes_saved"] > 0
        assert s["verification"]["failures"] == 0


def test_regions_learned_each_other_beyond_the_bootstrap_list(cluster: Cluster) -> None:
    for name in REGIONS:
        nodes = {p["node"] for p in cluster.daemons[name].status()["peers"] if p["node"]}
        assert len(nodes & set(REGIONS)) >= 2, (name, nodes)


def test_late_joiner_via_one_region_takes_a_snapshot_plus_deltas(cluster: Cluster) -> None:
    late = cluster.region("late", bootstrap=[cluster.daemons["r2"].url])
    late.start()
    late.wait_ready()
    cluster.wait_all_at(HEAD, 60, names=["late"])
    st = late.status()
    applied = [a["artifact"] for a in st["detail"]["sync"]["applied"]]
    assert applied == ["v00000003.snapshot", "v00000004.delta", "v00000005.delta",
                       "v00000006.delta"]
    assert st["state_digest"] == cluster.daemons["trainer"].status()["state_digest"]


def test_engine_command_hook_is_told_the_head_with_its_digest(cluster: Cluster) -> None:
    st = cluster.daemons["r1"].status()
    assert st["engine"]["type"] == "command" and st["engine"]["failures"] == 0
    assert st["engine"]["last_version"] == HEAD
    lines = (cluster.root / "engine.log.r1").read_text().split("\n")
    version, digest, path = lines[-2].split()
    assert int(version) == HEAD and digest == st["state_digest"] and Path(path).is_dir()
    versions = [int(line.split()[0]) for line in lines if line]
    assert versions == sorted(versions) and 1 <= len(versions) <= HEAD + 1
