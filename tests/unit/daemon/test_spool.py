"""The trajectory spool: durable before acknowledged, deduplicated, forgotten only when the
upstream acknowledged, bounded, and tolerant of a torn last line after kill -9."""

import json
from pathlib import Path

import pytest

from daemon.spool import BadTrajectory, Spool, SpoolFull, parse_batch


def traj(i: int, pad: int = 0) -> bytes:
    return json.dumps({"id": f"t{i:06d}", "version": 3, "reward": 1.0, "region": "r",
                       "completion": "x" * pad}).encode()


def batch(ids: range, pad: int = 0) -> list[tuple[str, bytes]]:
    return parse_batch(b"\n".join(traj(i, pad) for i in ids))


def test_appended_trajectories_survive_reopen_in_order(tmp_path: Path) -> None:
    s = Spool(tmp_path, 1 << 20)
    held, fresh = s.append(batch(range(10)))
    assert held == [f"t{i:06d}" for i in range(10)] and fresh == 10
    s.close()
    again = Spool(tmp_path, 1 << 20)
    assert [tid for tid, _ in again.take(100, 1 << 20)] == held
    assert again.bytes == s.bytes


def test_duplicates_are_held_but_stored_once(tmp_path: Path) -> None:
    s = Spool(tmp_path, 1 << 20)
    s.append(batch(range(5)))
    held, fresh = s.append(batch(range(3, 8)))
    assert held == [f"t{i:06d}" for i in range(3, 8)] and fresh == 3
    assert s.depth() == 8


def test_only_acknowledged_ids_leave_even_across_reopen(tmp_path: Path) -> None:
    s = Spool(tmp_path, 1 << 20)
    s.append(batch(range(6)))
    assert s.ack(["t000001", "t000004", "unknown"]) == 2
    s.close()
    again = Spool(tmp_path, 1 << 20)
    assert [t for t, _ in again.take(100, 1 << 20)] == ["t000000", "t000002", "t000003",
                                                       "t000005"]


def test_fully_acknowledged_segments_are_deleted(tmp_path: Path) -> None:
    s = Spool(tmp_path, 1 << 22, segment_bytes=2000)
    for k in range(5):
        s.append(batch(range(k * 20, k * 20 + 20), pad=50))
    segs = sorted(tmp_path.glob("seg-*.ndjson"))
    assert len(segs) >= 4
    s.ack([t for t, _ in s.take(1000, 1 << 22)])
    assert s.depth() == 0 and s.bytes == 0
    assert len(list(tmp_path.glob("seg-*.ndjson"))) <= 1


def test_full_spool_refuses_without_writing(tmp_path: Path) -> None:
    s = Spool(tmp_path, 1 << 16)
    s.append(batch(range(10), pad=1000))
    before = s.bytes
    with pytest.raises(SpoolFull, match="retry later"):
        s.append(batch(range(100, 155), pad=1000))
    assert s.bytes == before and s.depth() == 10
    s.ack([f"t{i:06d}" for i in range(10)])
    s.append(batch(range(100, 110), pad=1000))


def test_batch_larger_than_the_whole_spool_is_refused_as_bad_not_retried(tmp_path: Path) -> None:
    s = Spool(tmp_path, 1 << 16)
    with pytest.raises(BadTrajectory, match="can never fit"):
        s.append(batch(range(100), pad=1000))
    assert s.depth() == 0 and s.bytes == 0


def test_torn_last_line_is_dropped_on_reopen(tmp_path: Path) -> None:
    s = Spool(tmp_path, 1 << 20)
    s.append(batch(range(3)))
    s.close()
    seg = sorted(tmp_path.glob("seg-*.ndjson"))[-1]
    with open(seg, "ab") as f:
        f.write(traj(99)[:20])
    again = Spool(tmp_path, 1 << 20)
    assert again.depth() == 3
    assert seg.read_bytes().endswith(b"\n")


def test_take_respects_item_and_byte_limits(tmp_path: Path) -> None:
    s = Spool(tmp_path, 1 << 20)
    s.append(batch(range(10), pad=100))
    assert len(s.take(4, 1 << 20)) == 4
    one = len(traj(0, 100)) + 1
    assert len(s.take(100, 3 * one)) == 3
    assert len(s.take(100, 1)) == 1


@pytest.mark.parametrize("body, message", [
    (b'{"id": "a", "version": 1}\nnot json\n', "line 2: not valid JSON"),
    (b'[1, 2]', "line 1: a trajectory must be a JSON object"),
    (b'{"id": "a b", "version": 1}', "field id"),
    (b'{"id": "a", "version": -1}', "field version"),
    (b'{"id": "a", "version": true}', "field version"),
    (b'{"id": "a", "version": 1, "reward": "high"}', "field reward"),
])
def test_bad_lines_refuse_the_whole_batch_naming_the_line(body: bytes, message: str) -> None:
    with pytest.raises(BadTrajectory, match=message):
        parse_batch(body)


def test_blank_lines_are_ignored() -> None:
    assert [t for t, _ in parse_batch(b'\n{"id": "a", "version": 0}\n\n')] == ["a"]
