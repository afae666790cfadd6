"""The shared trajectory model and the Retry-After rule: bounds are enforced, canonical lines
round-trip, and no Retry-After value can spin a sender or park it for ever."""

import email.utils
import time

import pytest

from chain.trajectory import BadTrajectory, parse_ndjson, retry_after_s
from tests.trajectories import batch, ndjson, trajectory


def test_sizes_are_bounded() -> None:
    with pytest.raises(BadTrajectory, match="field group: String should have at most 256"):
        parse_ndjson(ndjson([trajectory(group="g" * 257)]))
    with pytest.raises(BadTrajectory, match="field prompt_ids: List should have at least 1"):
        parse_ndjson(ndjson([trajectory(prompt_ids=[])]))
    with pytest.raises(BadTrajectory, match="more than 3 trajectories"):
        parse_ndjson(ndjson(batch(4)), max_items=3)


def test_canonical_lines_drop_unknown_fields_and_keep_the_values() -> None:
    t = trajectory(extra={"a": [1, 2]})
    [(tid, line)] = parse_ndjson(ndjson([t]), canonical=True)
    assert tid == t["id"] and b"extra" not in line
    [(_, again)] = parse_ndjson(line)
    assert again == line


def http_date(offset: float) -> str:
    return email.utils.formatdate(time.time() + offset, usegmt=True)


@pytest.mark.parametrize("value, expected", [
    (None, 2.0), ("3", 3.0), ("0.5", 1.0), ("0", 1.0), ("-1", 2.0), ("nan", 2.0),
    ("inf", 2.0), ("1e400", 2.0), ("1e9", 30.0), ("soon", 2.0), ("", 2.0),
    ("Wed, 21 Oct 2015 07:28:00 GMT", 2.0), ("Fri, 01 Jan 9999 00:00:00 GMT", 30.0),
])
def test_retry_after_is_parsed_within_floor_and_ceiling(value: str | None,
                                                        expected: float) -> None:
    assert retry_after_s(value, default=2.0, floor=1.0, ceiling=30.0) == expected


def test_retry_after_http_date_in_the_near_future_is_honoured() -> None:
    assert 8.0 <= retry_after_s(http_date(10), default=2.0, floor=1.0, ceiling=30.0) <= 10.0


def test_a_trajectory_of_another_run_is_refused_and_unstamped_ones_pass() -> None:
    mine, other, plain = trajectory(run="run-a"), trajectory(run="run-b"), trajectory()
    body = ndjson([mine, plain, other])
    with pytest.raises(BadTrajectory, match=r"line 3 \(trajectory 2\): it is for run 'run-b', "
                       r"and this endpoint takes run 'run-a'") as e:
        parse_ndjson(body, run="run-a")
    assert e.value.index == 2
    assert [i for i, _ in parse_ndjson(body)] == [mine["id"], plain["id"], other["id"]]
    lines = dict(parse_ndjson(ndjson([mine, plain]), canonical=True, run="run-a"))
    assert b'"run":"run-a"' in lines[mine["id"]]
    assert b'"run"' not in lines[plain["id"]]  # unstamped records are stored as before
    with pytest.raises(BadTrajectory, match="run"):
        parse_ndjson(ndjson([trajectory(run="x" * 300)]))
