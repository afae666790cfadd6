"""chain/refusals.py: refused checkpoints recorded in the chain dir for the trainer daemon's
status; one entry per directory (the latest reason), bounded, and a damaged file reads empty."""

from chain import refusals


def test_the_latest_refusal_per_directory_is_kept_and_the_list_is_bounded(tmp_path):
    refusals.record(tmp_path, {"dir": "/c/step_1", "step": 1, "reason": "a", "at": 1.0})
    refusals.record(tmp_path, {"dir": "/c/step_1", "step": 1, "reason": "b", "at": 2.0})
    assert [r["reason"] for r in refusals.read(tmp_path)] == ["b"]
    for i in range(refusals.MAX_KEPT + 5):
        refusals.record(tmp_path, {"dir": f"/c/s{i}", "step": i, "reason": "r", "at": 3.0})
    got = refusals.read(tmp_path)
    assert len(got) == refusals.MAX_KEPT and got[-1]["step"] == refusals.MAX_KEPT + 4


def test_a_missing_or_damaged_file_reads_as_no_refusals(tmp_path):
    assert refusals.read(tmp_path) == []
    (tmp_path / refusals.REFUSED_FILE).write_text("{not json")
    assert refusals.read(tmp_path) == []
    (tmp_path / refusals.REFUSED_FILE).write_text('{"a": 1}')
    assert refusals.read(tmp_path) == []
