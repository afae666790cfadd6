"""kill -9 of a region daemon in the middle of a (rate-limited) download: after a restart it
continues from what it already held instead of fetching from zero, and converges on the
trainer's state digest."""

import time
from pathlib import Path

from tests.integration.harness import Cluster, tiny_model, wait_until

ART = "v00000000.snapshot"


def transfer(status: dict, artifact: str) -> dict | None:
    return next((t for t in status["versions"] if t["artifact"] == artifact), None)


def test_killed_region_resumes_its_download_and_converges(tmp_path: Path) -> None:
    with Cluster(tmp_path) as c:
        c.trainer()
        r1 = c.region("r1", limits={"download_bytes_per_s": 200_000})
        c.start_all()
        c.publish(0, tiny_model(0))  # 2 MiB snapshot: ~10 s at the region's limit
        total = c.daemons["trainer"].status()["versions"][0]["total_bytes"]

        def partly_done() -> bool:
            t = transfer(r1.status(), ART)
            return t is not None and 0.2 * total < t["done_bytes"] < 0.6 * total

        wait_until(partly_done, 30, "r1 to hold 20-60% of the snapshot")
        since = time.time()
        resume = r1.state_dir / "resume" / f"{ART}.resume"
        wait_until(lambda: resume.exists() and resume.stat().st_mtime > since, 5,
                   "resume data saved after that point")
        done_at_kill = transfer(r1.status(), ART)["done_bytes"]
        r1.kill9()
        assert done_at_kill < total

        r1.start()
        r1.wait_ready()

        def resumed() -> dict | None:
            info = r1.status()["detail"]["sync"]["transfers"].get(ART)
            return info if info and info.get("resumed_bytes") is not None else None

        info = wait_until(resumed, 30, "the restarted download to report what it resumed from")
        assert 0.2 * total <= info["resumed_bytes"] <= done_at_kill
        c.wait_all_at(0, 60)
        again = r1.status()["detail"]["sync"]["transfers"][ART]
        assert again["downloaded"] <= total - info["resumed_bytes"] + 128 * 1024
        assert r1.status()["state_digest"] == c.daemons["trainer"].status()["state_digest"]
