"""Plans that follow what exists (issue 11, findings 1 and 5), with real daemons on loopback:
regions whose next delta went with its only holder replan to a later snapshot instead of
waiting forever, and a late joiner that first hears a stale head plans once, toward the real
head."""

import json
import re
import shutil
import signal

from chain.policy import SnapshotPolicy
from tests.integration.harness import Cluster, Hostile, step, tiny_model
from tests.support import wait_until

FAST = {"progress_timeout_s": 4, "unoffered_timeout_s": 3}


def _limit(daemon, rate: int) -> None:
    """Set the region's download cap through SIGHUP, and wait until it is applied."""
    before = daemon.log(10**7).count("SIGHUP: reloaded")
    daemon.config["limits"] = {"download_bytes_per_s": rate}
    daemon.write_config()
    daemon.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: daemon.log(10**7).count("SIGHUP: reloaded") > before, 20,
               f"{daemon.name} to reload")


def test_regions_replan_to_a_later_snapshot_when_the_only_holder_of_their_next_delta_dies(
        tmp_path):
    with Cluster(tmp_path) as c:
        t = c.trainer()
        regions = [c.region("r1", sync=FAST), c.region("r2", sync=FAST)]
        c.start_all()
        state = tiny_model()
        c.publish(0, state, snapshot=True)
        for v in range(1, 4):
            state = step(state, v)
            c.publish(v, state)
        c.wait_all_at(3, 60)

        # v4 (a large delta) reaches the regions' manifests, but its bytes cannot arrive in time
        for r in regions:
            _limit(r, 1)
        state = step(state, 4, density=0.5)
        c.publish(4, state)
        wait_until(lambda: all(r.status()["head_version"] == 4 for r in regions), 30,
                   "the regions to take v4's manifest")
        t.kill9()
        for r in regions:
            _limit(r, 0)

        # the publisher goes on while its daemon is down; then the last copy of v4 goes
        pub = c.publisher()
        for v in range(5, 8):
            state = step(state, v)
            pub.snapshots = SnapshotPolicy(every=1 if v == 6 else 1000)
            assert not pub.publish(v, state).notified
        (t.state_dir / "chain" / "manifests" / "v00000004.delta.json").unlink()

        # while stuck, retention still runs after each failed step
        r1 = regions[0]
        first = wait_until(lambda: r1.status()["retention"]["at"], 20, "r1 to run retention")
        wait_until(lambda: r1.status()["retention"]["at"] > first and r1.current() == 3, 20,
                   "retention to run again while r1 is stuck at v3")

        t.start()
        t.wait_ready()
        c.wait_all_at(7, 45)
        for r in regions:
            st = r.status()
            applied = [a["artifact"] for a in st["detail"]["sync"]["applied"]]
            assert "v00000006.snapshot" in applied and "v00000004.delta" not in applied, applied
            assert st["sync"]["replans"] >= 1, st["sync"]


def _stale_copy(trainer, into, head: int) -> None:
    """An honest copy of the trainer's chain as it stood at `head`, served statically."""
    chain, torrents = trainer.state_dir / "chain" / "manifests", trainer.state_dir / "torrents"
    (into / "manifests").mkdir(parents=True)
    (into / "torrents").mkdir()
    names = [p.stem for p in sorted(chain.glob("v*.json"))]
    for name in names:
        shutil.copy(chain / f"{name}.json", into / "manifests")
        shutil.copy(torrents / f"{name}.torrent", into / "torrents")
    index = trainer.get("/v1/chain/index")
    (into / "index.json").write_text(json.dumps({
        "artifacts": names, "head": head,
        "peers": [{"url": trainer.url, "bt": index["bt"], "node": "trainer"}]}))
    (into / "head.json").write_text(json.dumps({"version": head, "node": "stale"}))


def test_a_late_joiner_that_first_hears_a_stale_head_plans_once_toward_the_real_head(
        tmp_path):
    with Cluster(tmp_path) as c:
        t = c.trainer()
        c.start_all()
        state = tiny_model()
        c.publish(0, state, snapshot=True)
        for v in range(1, 4):
            state = step(state, v)
            c.publish(v, state)
        _stale_copy(t, tmp_path / "stale", 3)
        for v in range(4, 9):
            state = step(state, v)
            c.publish(v, state, snapshot=v == 6)
        stale = Hostile(tmp_path, "127.0.0.80", "chain", chain_dir=tmp_path / "stale")
        try:
            stale.wait_ready()
            late = c.region("late", bootstrap=[stale.url], sync={"head_wait_s": 10})
            late.start()
            late.wait_ready()
            c.wait_all_at(8, 60, names=["late"])
            log = late.log(10**7)
            why = "\n".join(line for line in log.splitlines()
                            if re.search(r"plan v|heads settled|failed|giving up", line))
            plans = re.findall(r"plan v(\S+) → v(\d+)", log)
            # one plan from nothing, toward the real head (a later plan may only resume it
            # after a transient failure, toward the same head)
            assert plans[0] == ("None", "8") and {t for _, t in plans} == {"8"}, why
            assert [p for p in plans if p[0] == "None"] == [("None", "8")], why
            applied = [a["artifact"] for a in late.status()["detail"]["sync"]["applied"]]
            assert applied == ["v00000006.snapshot", "v00000007.delta", "v00000008.delta"], why
        finally:
            stale.stop()
