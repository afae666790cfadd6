"""A region whose copy of an artifact is corrupted on disk serves bad pieces: the fetching region
bans it, never applies corrupt data, and completes the download from the trainer. Also checks
that SIGHUP reloads rate limits (the trainer is slowed down after start)."""

import os
import signal
from pathlib import Path

from tests.integration.harness import Cluster, tiny_model, wait_until

ART = "v00000000.snapshot"


def test_corrupt_peer_is_banned_and_download_completes_verified(tmp_path: Path) -> None:
    with Cluster(tmp_path) as c:
        trainer = c.trainer()
        bad = c.region("bad")
        c.start_all()
        c.publish(0, tiny_model(0, tensors=2))  # 1 MiB
        c.wait_all_at(0, 60)

        files = [p for p in (bad.state_dir / "swarm" / ART).rglob("*") if p.is_file()]
        assert files
        for p in files:
            with open(p, "r+b") as f:
                f.write(os.urandom(p.stat().st_size))

        trainer.config["limits"] = {"upload_bytes_per_s": 100_000}
        trainer.write_config()
        trainer.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "SIGHUP: reloaded" in trainer.log(), 10,
                   "the trainer to reload its config")
        assert "config not reloaded" not in trainer.log()
        limits = trainer.status()["detail"]["rate_limits"]
        assert limits["upload_rate_limit"] == 100_000, limits

        good = c.region("good", bootstrap=[bad.url, trainer.url])
        good.start()
        good.wait_ready()
        c.wait_all_at(0, 90, names=["good"])

        st = good.status()
        assert st["state_digest"] == trainer.status()["state_digest"]
        assert [(b["endpoint"], b["artifact"]) for b in st["bans"]] == [
            (f"{bad.host}:{bad.bt_port}", ART)]
        assert st["verification"]["failures_by_kind"].get("piece", 0) >= 1
        assert st["verification"]["failures_by_kind"].get("tensor", 0) == 0
        assert [a["artifact"] for a in st["detail"]["sync"]["applied"]] == [ART]
