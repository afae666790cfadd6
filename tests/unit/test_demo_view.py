"""The demo's verdict and summary: learning is judged on the held-out scores of v0 and the last
version (not on training batch rewards), and the summary puts the demo's density beside the
codec bench's realistic case."""

import json
from pathlib import Path

from rich.console import Console

from demo.config import load_demo_config, with_overrides
from demo.heldout import Score
from demo.view import render_summary, stale_share, verdict

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _setup(tmp_path):
    cfg = with_overrides(load_demo_config(CONFIGS / "demo.yaml"), steps=4, regions=["a", "b"],
                         min_reward_gain=0.02)
    manifests = tmp_path / "trainer-daemon" / "chain" / "manifests"
    manifests.mkdir(parents=True)
    (manifests / "v00000004.delta.json").write_text(json.dumps({"state_digest": "d4"}))
    statuses = {r: {"current_version": 4, "state_digest": "d4"} for r in cfg.regions}
    return cfg, statuses


def _score(version: int, sampled: float) -> Score:
    return Score(version=version, greedy=0.3, sampled=sampled, solved=0.1)


def test_verdict_needs_the_held_out_gain_between_v0_and_the_last_version(tmp_path):
    cfg, statuses = _setup(tmp_path)
    # batch rewards rising steeply do not count: only the held-out scores do
    metrics = [{"event": "step", "version": v, "reward_mean": 0.1 * v} for v in (1, 2, 3, 4)]
    ok, _ = verdict(cfg, metrics, statuses, tmp_path, [_score(0, 0.20), _score(4, 0.23)])
    assert ok
    ok, reasons = verdict(cfg, metrics, statuses, tmp_path, [_score(0, 0.20), _score(4, 0.21)])
    assert not ok and "held-out reward 0.200 → 0.210" in reasons[-1][1]
    ok, reasons = verdict(cfg, metrics, statuses, tmp_path, [_score(2, 0.20), _score(4, 0.30)])
    assert not ok and reasons[-1][1] == "held-out set not scored on v0"
    off = with_overrides(cfg, min_reward_gain=-1)
    assert verdict(off, metrics, statuses, tmp_path, [])[0]


def test_summary_states_density_beside_the_codec_bench_and_the_stale_share(tmp_path):
    cfg, statuses = _setup(tmp_path)
    # 5 kB of tensors + 15 kB of carried files: the ratio is on tensors (160x), not on the
    # whole artifact (40x), and the files are stated beside it (issue 22)
    step = {"event": "step", "reward_mean": 0.2, "delta_bytes": 20_000,
            "delta_tensor_bytes": 5_000, "delta_file_bytes": 15_000, "dense_bytes": 800_000,
            "changed_elements": 3, "elements": 100, "received": 384, "dropped_stale": 0}
    metrics = [{**step, "version": v} for v in (1, 2, 3)]
    metrics.append({**step, "version": 4, "dropped_stale": 96})
    assert stale_share(metrics) == (96, 4 * 384)
    console = Console(width=200, record=True)
    console.print(render_summary(cfg, metrics, statuses, {}, [_score(0, 0.2), _score(4, 0.25)]))
    text = console.export_text()
    assert "3.0 % changed, 160x smaller" in text and "40x" not in text
    assert "4.9 KiB, 4.9 KiB / 781.2 KiB" in text  # delta tensors (median, max) / full
    assert "carried files" in text and "14.6 KiB (unchanged" in text
    assert "codec bench, realistic RL (lr 1e-6): 1.2-1.6 % changed, 150-195x smaller" in text
    assert "96 of 1536 (6.2 %)" in text and "0.200 → 0.250 (+0.050)" in text
