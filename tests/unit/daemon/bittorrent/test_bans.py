"""daemon.bittorrent.bans: one ban per (endpoint, artifact), kept across a restart, gone after
expiry."""

import json
import time
from pathlib import Path

from daemon.bittorrent.bans import BanList

A, B = "v00000001.delta", "v00000002.delta"


def test_bans_survive_a_restart_and_expire(tmp_path: Path) -> None:
    path, t = tmp_path / "bans.json", time.time()
    bans = BanList(path, expiry_s=100)
    bans.add("127.0.0.5:6881", A, "bad piece", now=t)
    bans.add("127.0.0.6:6881", B, "bad piece", now=t - 200)  # already over
    again = BanList(path, expiry_s=100)
    assert [(r.endpoint, r.artifact, r.since, r.expires) for r in again.active(now=t + 50)] == [
        ("127.0.0.5:6881", A, t, t + 100)]
    assert again.endpoints(A, now=t + 50) == {("127.0.0.5", 6881)}
    assert again.endpoints(B, now=t + 50) == set()
    assert again.prune(now=t + 100) == {A}
    assert again.active(now=t + 100) == [] and json.loads(path.read_text()) == []


def test_a_ban_names_one_endpoint_on_one_artifact(tmp_path: Path) -> None:
    bans = BanList(tmp_path / "bans.json", expiry_s=100)
    bans.add("127.0.0.5:6881", A, "bad piece", now=1000.0)
    assert bans.endpoints(A, now=1001.0) == {("127.0.0.5", 6881)}
    assert ("127.0.0.5", 6882) not in bans.endpoints(A, now=1001.0)
    bans.add("127.0.0.5:6881", A, "again", now=1050.0)  # a repeat extends, keeps `since`
    [rec] = bans.active(now=1051.0)
    assert (rec.since, rec.expires, rec.reason) == (1000.0, 1150.0, "again")
    bans.forget_artifact(A)
    assert bans.active(now=1051.0) == []


def test_an_unreadable_ban_file_starts_empty(tmp_path: Path) -> None:
    path = tmp_path / "bans.json"
    path.write_text("{not json")
    assert BanList(path, expiry_s=100).active() == []
