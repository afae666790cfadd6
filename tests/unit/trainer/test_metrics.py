"""The metrics log round-trips step dicts, and the summary line names what matters."""

from pathlib import Path

from trainer.metrics import MetricsLog, format_step, read_metrics


def test_metrics_log_appends_one_row_per_step(tmp_path: Path) -> None:
    steps = [{"version": 1, "reward_mean": 0.25, "staleness_hist": {0: 3, 2: 1}},
             {"version": 2, "reward_mean": 0.5, "staleness_hist": {}}]
    with MetricsLog(tmp_path / "m.jsonl") as log:
        for s in steps:
            log.write(s)
    with MetricsLog(tmp_path / "m.jsonl") as log:
        log.write({"version": 3})
    rows = read_metrics(tmp_path / "m.jsonl")
    assert [r["version"] for r in rows] == [1, 2, 3]
    assert rows[0]["staleness_hist"] == {"0": 3, "2": 1} and rows[1]["reward_mean"] == 0.5
    assert all(r["time"] > 0 for r in rows)


def test_summary_line_shows_version_staleness_and_reward() -> None:
    line = format_step({"version": 7, "kept": 10, "received": 12, "dropped_stale": 2,
                        "dropped_future": 0, "staleness_hist": {0: 8, 1: 2},
                        "reward_mean": 0.4123, "bf16_changed_frac": 0.0123, "stepped": True})
    assert line.startswith("v7 kept 10/12 stale 2 future 0 lag {0: 8, 1: 2}")
    assert "reward 0.412" in line and "bf16 1.23%" in line
    assert "no step" in format_step({"version": 7, "stepped": False})
