"""A holder that restarts on the same endpoint is dialled again (the chaos test's trainer kill),
with real daemons on loopback: the trainer alone holds a new delta, its uplink is choked so the
regions' torrents are mid-fetch, it is killed -9 and comes back on the same ip:port a few seconds
later. The regions' torrents dialled it while it was down; libtorrent stops dialling a peer after
a few refused connects, so without a fresh peer list per attempt they stayed at the old version
forever, logging stalls."""

import signal
import time

from tests.integration.harness import Cluster, Daemon, step, tiny_model
from tests.support import wait_until

FAST = {"progress_timeout_s": 2, "unoffered_timeout_s": 2}


def _uplink(trainer: Daemon, rate: int) -> None:
    """Set the trainer's upload cap through its config and SIGHUP; wait until it reloaded."""
    before = trainer.log(10**7).count("SIGHUP: reloaded")
    trainer.config["limits"] = {"upload_bytes_per_s": rate}
    trainer.write_config()
    trainer.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: trainer.log(10**7).count("SIGHUP: reloaded") > before, 20,
               "the trainer to reload")


def _fetching(region: Daemon, artifact: str) -> bool:
    return any(v["artifact"] == artifact and v["done_bytes"] < v["total_bytes"]
               for v in region.status()["versions"])


def test_regions_fetch_a_delta_held_only_by_a_trainer_killed_and_restarted_mid_transfer(
        tmp_path):
    with Cluster(tmp_path) as c:
        t = c.trainer()
        regions = [c.region("r1", sync=FAST), c.region("r2", sync=FAST)]
        c.start_all()
        state = tiny_model()
        c.publish(0, state, snapshot=True)
        state = step(state, 1)
        c.publish(1, state)
        c.wait_all_at(1, 60)

        _uplink(t, 1)  # v2 exists only on the trainer, and nothing of it leaves
        state = step(state, 2)
        c.publish(2, state)
        wait_until(lambda: all(_fetching(r, "v00000002.delta") for r in regions), 20,
                   "the regions to start fetching v2")
        t.kill9()
        t.config["limits"] = {"upload_bytes_per_s": 0}
        t.write_config()
        # down long enough for every region's torrent to dial it, and be refused, a few times
        stalls = {r.name: r.log(10**7).count("Stalled: v00000002.delta") for r in regions}
        wait_until(lambda: all(r.log(10**7).count("Stalled: v00000002.delta")
                               >= stalls[r.name] + 3 for r in regions), 30,
                   "each region to stall on v2 three times while the trainer is down")

        t.start()
        t.wait_ready()
        back = time.monotonic()
        c.wait_all_at(2, 30)
        for r in regions:
            applied = [a["artifact"] for a in r.status()["detail"]["sync"]["applied"]]
            assert applied[-1] == "v00000002.delta", applied
        print(f"regions at v2 {time.monotonic() - back:.1f}s after the trainer came back")
