"""The demo's pass/fail (demo/verdict.py): learning is judged on the greedy score of held-out
problems, not the sampled score (which rose in runs whose greedy score fell); a trajectory on a
held-out problem fails the run; the summary states the margin."""

import json
import sqlite3
from pathlib import Path

from demo.config import load_demo_config, with_overrides
from demo.heldout import Score
from demo.verdict import summary_rows, trained_on_heldout, verdict
from trainer.ingest import SCHEMA

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
HELDOUT = {"23+45=", "87-52="}


def _setup(tmp_path: Path, prompts: list[str]):
    cfg = with_overrides(load_demo_config(CONFIGS / "demo.yaml"), steps=4, regions=["a", "b"],
                         min_reward_gain=0.05)
    manifests = tmp_path / "trainer-daemon" / "chain" / "manifests"
    manifests.mkdir(parents=True)
    (manifests / "v00000004.delta.json").write_text(json.dumps({"state_digest": "d4"}))
    statuses = {r: {"current_version": 4, "state_digest": "d4"} for r in cfg.regions}
    db = tmp_path / "trainer" / "ingest"
    db.mkdir(parents=True)
    con = sqlite3.connect(db / "ingest.db")
    con.executescript(SCHEMA)
    con.executemany("INSERT INTO trajectories (id, record) VALUES (?, ?)",
                    [(str(i), json.dumps({"id": str(i), "prompt": p}))
                     for i, p in enumerate(prompts)])
    con.commit()
    con.close()
    return cfg, statuses


def _score(version: int, greedy: float, sampled: float) -> Score:
    return Score(version=version, greedy=greedy, sampled=sampled, solved=greedy / 2)


def test_the_greedy_held_out_score_decides_not_the_sampled_one(tmp_path):
    cfg, statuses = _setup(tmp_path, ["11+11=", "99-11="])
    rose = [_score(0, 0.40, 0.30), _score(4, 0.46, 0.25)]
    ok, reasons = verdict(cfg, [], statuses, tmp_path, rose, HELDOUT, 2)
    assert ok, reasons
    assert reasons[-1] == (True, "greedy reward on 2 held-out problems 0.400 → 0.460 (+0.060; "
                                 "solved 20 % → 23 %) from v0 to v4 (needs +0.050)")
    # the earlier demo's runs: sampled score up, greedy down; that is a failure now
    fell = [_score(0, 0.354, 0.232), _score(4, 0.30, 0.28)]
    ok, reasons = verdict(cfg, [], statuses, tmp_path, fell, HELDOUT, 2)
    assert not ok and reasons[-1][0] is False and "(-0.054;" in reasons[-1][1]
    short = [_score(0, 0.40, 0.3), _score(4, 0.44, 0.3)]
    assert not verdict(cfg, [], statuses, tmp_path, short, HELDOUT, 2)[0]
    ok, reasons = verdict(cfg, [], statuses, tmp_path, [_score(2, 0.4, 0.3)], HELDOUT, 2)
    assert not ok and reasons[-1] == (False, "held-out set not scored on v0 and v4")
    # the swarm checks still count: a region on another digest fails the run
    statuses["b"]["state_digest"] = "other"
    ok, reasons = verdict(cfg, [], statuses, tmp_path, rose, HELDOUT, 2)
    assert not ok and (False, "b is on v4 with a different's state digest") in reasons


def test_a_trajectory_on_a_held_out_problem_fails_the_run(tmp_path):
    cfg, statuses = _setup(tmp_path, ["11+11=", "87-52=", "99-11="])
    assert trained_on_heldout(tmp_path / "trainer" / "ingest" / "ingest.db", HELDOUT) == (1, 3)
    rose = [_score(0, 0.40, 0.30), _score(4, 0.50, 0.35)]
    ok, reasons = verdict(cfg, [], statuses, tmp_path, rose, HELDOUT, 2)
    assert not ok
    assert (False, "1 of 3 trajectories the trainer received were held-out problems") in reasons
    assert trained_on_heldout(tmp_path / "missing.db", HELDOUT) is None


def test_the_check_can_be_turned_off_and_the_summary_states_the_margin(tmp_path):
    cfg, statuses = _setup(tmp_path, ["11+11="])
    fell = [_score(0, 0.40, 0.30), _score(4, 0.30, 0.35)]
    assert verdict(with_overrides(cfg, min_reward_gain=-1), [], statuses, tmp_path, fell,
                   HELDOUT, 2)[0]
    (label, value), = summary_rows(cfg, [_score(0, 0.40, 0.3), _score(4, 0.47, 0.3)], 400, 878)
    assert "400 of the 878 held-out problems" in label and "v0 → v4" in label
    assert value == "0.400 → 0.470 (+0.070, needs +0.050); solved 20.0 % → 23.5 %"
    assert summary_rows(cfg, [_score(0, 0.4, 0.3)], 400, 878) == []
