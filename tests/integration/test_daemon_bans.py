"""Bans that hit the guilty, and seeders that check themselves (issue 11, findings 2 and 3).

Real daemons on loopback, each on its own 127.0.0.x address: a region whose copy of v0 is
overwritten on disk while it seeds serves bad pieces; the region fetching from it bans that
endpoint on v0 only, keeps the ban across a restart, and still fetches v1 from the same peer;
the corrupted seeder, told of the ban, re-verifies v0, finds every block bad and refetches it.
"""

import os
from pathlib import Path

from chain.digest import block_id
from tests.integration.harness import Cluster, http, step, tiny_model, wait_until

ART = "v00000000.snapshot"


def _corrupt(state_dir: Path, artifact: str, whole: bool = True) -> list[Path]:
    files = sorted(p for p in (state_dir / "swarm" / artifact).rglob("*") if p.is_file())
    assert files
    for p in files if whole else files[:1]:
        with open(p, "r+b") as f:
            if whole:
                f.write(os.urandom(p.stat().st_size))
            else:
                f.seek(p.stat().st_size // 2)
                byte = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([byte[0] ^ 0x40]))
    return files


def _intact(files: list[Path]) -> bool:
    return all(p.is_file() and block_id(p.read_bytes()) == p.name for p in files)


def test_a_ban_names_one_endpoint_on_one_artifact_and_survives_restart(tmp_path: Path) -> None:
    with Cluster(tmp_path) as c:
        trainer = c.trainer(limits={"upload_bytes_per_s": 100_000})
        bad = c.region("bad")
        c.start_all()
        v0 = tiny_model(0, tensors=2)  # 1 MiB
        c.publish(0, v0)
        c.wait_all_at(0, 60)
        files = _corrupt(bad.state_dir, ART)

        good = c.region("good", bootstrap=[bad.url, trainer.url])
        good.start()
        good.wait_ready()
        c.wait_all_at(0, 90, names=["good"])
        bad_ep = f"{bad.host}:{bad.bt_port}"
        st = good.status()
        assert st["state_digest"] == trainer.status()["state_digest"]
        [ban] = st["bans"]
        assert (ban["endpoint"], ban["artifact"], ban["node"]) == (bad_ep, ART, "bad")
        assert ban["reason"] and ban["expires"] >= ban["since"] + 3000
        assert st["verification"]["failures_by_kind"].get("tensor", 0) == 0

        # The corrupted seeder was told, checked itself and refetched v0 from the trainer.
        wait_until(lambda: bad.status()["self_check"]["repaired"] >= len(files), 60,
                   "the corrupted seeder to repair v0")
        check = bad.status()["self_check"]
        assert check["corrupt_found"] == len(files) and check["last_trigger"] == "complaint"
        assert _intact(files)

        # v1 from the banned peer alone: the ban holds on v0 only.
        c.publish(1, step(v0, 1))
        c.wait_all_at(1, 60, names=["bad"])
        trainer.stop()
        c.wait_all_at(1, 60, names=["good"])
        assert [(b["endpoint"], b["artifact"]) for b in good.status()["bans"]] == [(bad_ep, ART)]
        assert bad.status()["bans"] == []

        good.stop()
        good.start()
        good.wait_ready()
        after = good.status()["bans"]
        assert [(b["endpoint"], b["artifact"], b["since"], b["expires"]) for b in after] == [
            (bad_ep, ART, ban["since"], ban["expires"])]


def test_a_seeder_finds_a_flipped_byte_and_repairs_it(tmp_path: Path) -> None:
    with Cluster(tmp_path) as c:
        c.trainer()
        seeder = c.region("seeder", self_check={"interval_s": 2})
        c.start_all()
        c.publish(0, tiny_model(0, tensors=2))
        c.wait_all_at(0, 60)
        wait_until(lambda: seeder.status()["warmup"]["state"] == "ready", 120,
                   "the codec warm-up to finish")
        before = seeder.status()["self_check"]
        assert before["corrupt_found"] == 0 and before["runs"] >= 1
        [flipped] = _corrupt(seeder.state_dir, ART, whole=False)[:1]
        store_copy = seeder.state_dir / "chain" / "blocks" / flipped.name[:2] / flipped.name
        wait_until(lambda: seeder.status()["self_check"]["repaired"] >= 1, 60,
                   "the seeder to find and repair the flipped block")
        st = seeder.status()
        assert st["self_check"]["corrupt_found"] == 1
        assert [(x["artifact"], x["block"], x["repaired"]) for x in st["self_check"]["corrupt"]
                ] == [(ART, flipped.name, True)]
        assert st["self_check"]["bytes_checked"] >= 1 << 20
        assert _intact([flipped]) and block_id(store_copy.read_bytes()) == flipped.name
        metrics = http(f"{seeder.url}/metrics", token=None)[1].decode()
        assert "deltaswarm_self_check_corrupt_blocks_total 1.0" in metrics
        assert "deltaswarm_self_check_repaired_blocks_total 1.0" in metrics
        assert "deltaswarm_warmup_ready 1.0" in metrics

        # Damage done while the node is down is found by the pass at start.
        seeder.stop()
        files = _corrupt(seeder.state_dir, ART, whole=False)
        seeder.config["self_check"] = {"interval_s": 3600}
        seeder.write_config()
        seeder.start()
        seeder.wait_ready()
        wait_until(lambda: seeder.status()["self_check"]["repaired"] >= 1, 60,
                   "the restarted seeder to repair what broke while it was down")
        st = seeder.status()["self_check"]
        assert st["corrupt_found"] == 1 and st["corrupt"][0]["block"] == files[0].name
        assert st["last_trigger"] == "start" and st["runs"] == 1
        assert _intact(files)
