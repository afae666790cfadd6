"""The trajectory spool: durable before acknowledged, deduplicated, forgotten only when the
upstream acknowledged it or refused it as invalid (then kept in the rejected store), bounded,
and exactly-once across a write that fails half-way and a restart."""

import json
from pathlib import Path

import pytest

from daemon.trajectories.spool import BadTrajectory, Spool, SpoolFull, parse_batch
from tests.support import run_child_appends
from tests.trajectories import DROP, batch, ids, ndjson, trajectory

ROOT = Path(__file__).resolve().parents[4]


def items(n: int, pad: int = 0) -> tuple[list[str], list[tuple[str, bytes]]]:
    trajs = batch(n, pad=pad)
    return ids(trajs), parse_batch(ndjson(trajs))


def test_appended_trajectories_survive_reopen_in_order(tmp_path: Path) -> None:
    s = Spool(tmp_path, 1 << 20)
    sent, lines = items(10)
    held, fresh = s.append(lines)
    assert held == sent and fresh == 10
    s.close()
    again = Spool(tmp_path, 1 << 20)
    assert [tid for tid, _ in again.take(100, 1 << 20)] == sent
    assert again.bytes == s.bytes == sum(len(line) + 1 for _, line in lines)


def test_duplicates_are_held_but_stored_once(tmp_path: Path) -> None:
    s = Spool(tmp_path, 1 << 20)
    sent, lines = items(8)
    s.append(lines[:5])
    held, fresh = s.append(lines[3:])
    assert held == sent[3:] and fresh == 3
    assert s.depth() == 8


def test_only_acknowledged_ids_leave_even_across_reopen(tmp_path: Path) -> None:
    s = Spool(tmp_path, 1 << 20)
    sent, lines = items(6)
    s.append(lines)
    assert s.ack([sent[1], sent[4], "0" * 32]) == 2
    s.close()
    again = Spool(tmp_path, 1 << 20)
    assert [t for t, _ in again.take(100, 1 << 20)] == [sent[i] for i in (0, 2, 3, 5)]


def test_rejected_trajectories_leave_the_stream_and_are_kept_across_reopen(
        tmp_path: Path) -> None:
    s = Spool(tmp_path, 1 << 20)
    sent, lines = items(4)
    s.append(lines)
    assert s.reject([sent[2]], 400, "line 1: field reward: bad") == 1
    assert s.rejected == 1 and s.depth() == 3
    s.close()
    again = Spool(tmp_path, 1 << 20)
    assert [t for t, _ in again.take(100, 1 << 20)] == [sent[0], sent[1], sent[3]]
    assert again.rejected == 1 and again.bytes == sum(len(x) + 1 for i, (_, x) in
                                                      enumerate(lines) if i != 2)
    [kept] = again.rejected_items()
    assert (kept["id"], kept["status"], kept["line"]) == (sent[2], 400, lines[2][1])
    assert "field reward" in kept["reason"]


def test_full_spool_refuses_without_writing(tmp_path: Path) -> None:
    s = Spool(tmp_path, 1 << 16)
    first, lines = items(10, pad=1000)
    s.append(lines)
    before = s.bytes
    with pytest.raises(SpoolFull, match="retry later"):
        s.append(items(45, pad=1000)[1])
    assert s.bytes == before and s.depth() == 10
    s.ack(first)
    s.append(items(10, pad=1000)[1])


def test_batch_larger_than_the_whole_spool_is_refused_as_bad_not_retried(tmp_path: Path) -> None:
    s = Spool(tmp_path, 1 << 16)
    with pytest.raises(BadTrajectory, match="can never fit"):
        s.append(items(100, pad=1000)[1])
    assert s.depth() == 0 and s.bytes == 0


def test_take_respects_item_and_byte_limits(tmp_path: Path) -> None:
    s = Spool(tmp_path, 1 << 20)
    _, lines = items(10, pad=100)
    s.append(lines)
    assert len(s.take(4, 1 << 20)) == 4
    # Lines differ by a byte or two (a float's repr in `created`): size the limit to exactly
    # the first three, so the fourth is the one that does not fit.
    three = sum(len(line) + 1 for _, line in lines[:3])
    assert len(s.take(100, three)) == 3
    assert len(s.take(100, three - 1)) == 2
    assert len(s.take(100, 1)) == 1


NESTED = b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b"}"


@pytest.mark.parametrize("line, message", [
    (ndjson([trajectory(id="not-hex-" + "a" * 24)]), "field id"),
    (ndjson([trajectory(id="A" * 32)]), "field id"),
    (ndjson([trajectory(reward=DROP)]), "field reward: Field required"),
    (ndjson([trajectory(logprobs=[-0.5, float("-inf"), -0.1])]),
     "field logprobs.1: Input should be a finite number"),
    (ndjson([trajectory(reward=float("nan"))]), "field reward: Input should be a finite number"),
    (ndjson([trajectory(version=-1)]), "field version"),
    (ndjson([trajectory(version=True)]), "field version"),
    (ndjson([trajectory(reward="high")]), "field reward"),
    (ndjson([trajectory(logprobs=[-0.5])]), "one log-prob per completion token"),
    (NESTED, "not valid JSON"),
    (b"[" * 100_000, "not valid JSON"),
    (b"[1, 2]", "Input should be an object"),
])
def test_bad_trajectory_refuses_the_batch_naming_line_index_and_field(line: bytes,
                                                                      message: str) -> None:
    body = ndjson(batch(2)) + b"\n" + line
    with pytest.raises(BadTrajectory, match="line 4 \\(trajectory 2\\)") as e:
        parse_batch(body)
    assert message in str(e.value)


def test_blank_lines_are_ignored() -> None:
    t = trajectory()
    assert [tid for tid, _ in parse_batch(b"\n" + ndjson([t]) + b"\n\n")] == [t["id"]]


def test_batches_spooled_by_an_older_deltaswarm_are_imported_once(tmp_path: Path) -> None:
    trajs = batch(4)
    lines = [json.dumps(t).encode() for t in trajs]
    (tmp_path / "seg-000000000001.ndjson").write_bytes(b"\n".join(lines[:3]) + b"\n")
    (tmp_path / "seg-000000000002.ndjson").write_bytes(lines[3] + b"\n" + lines[0][:30])
    (tmp_path / "acked.log").write_bytes(trajs[1]["id"].encode() + b"\n")
    s = Spool(tmp_path, 1 << 20)
    assert [t for t, _ in s.take(100, 1 << 20)] == [trajs[i]["id"] for i in (0, 2, 3)]
    assert not list(tmp_path.glob("seg-*")) and not (tmp_path / "acked.log").exists()
    s.close()
    assert Spool(tmp_path, 1 << 20).depth() == 3


CHILD = """
import json, os, resource, signal, sys
from pathlib import Path
from daemon.trajectories.spool import Spool, parse_batch
from chain.sqlstore import StoreWriteError

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write is an error, not a kill
root, bodies = Path(sys.argv[1]), json.loads(sys.argv[2])
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
spool = Spool(root, 1 << 30)
for body, limited in bodies:
    if limited:
        biggest = max(p.stat().st_size for p in root.iterdir() if p.is_file())
        resource.setrlimit(resource.RLIMIT_FSIZE, (biggest + 300, hard))
    try:
        spool.append(parse_batch(body.encode()))
        print("ok", flush=True)
    except StoreWriteError as e:  # the designed refusal; anything else fails the test
        print("failed", type(e).__name__, e, flush=True)
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
os._exit(0)  # as after kill -9: nothing closed or flushed on the way out
"""


def test_an_append_failing_half_way_leaves_nothing_and_the_next_survives_restart(
        tmp_path: Path) -> None:
    """Issue 10 item 7: B's write hits the file-size limit half-way (a real child process under
    RLIMIT_FSIZE), C is then appended fine; after the restart C is there, B is not (it was
    refused, so its sender resends it), and a resend of B is stored once."""
    a, b, c = batch(3), batch(40, pad=2000), batch(3)
    plan = [(ndjson(a).decode(), False), (ndjson(b).decode(), True), (ndjson(c).decode(), False)]
    lines = run_child_appends(CHILD, tmp_path, plan)
    assert lines[0] == "ok" and lines[2] == "ok", lines
    assert lines[1].startswith("failed StoreWriteError"), lines

    s = Spool(tmp_path, 1 << 30)
    assert [t for t, _ in s.take(1000, 1 << 30)] == ids(a) + ids(c)
    assert s.append(parse_batch(ndjson(b)))[1] == 40
    s.close()
    again = Spool(tmp_path, 1 << 30)
    assert [t for t, _ in again.take(1000, 1 << 30)] == ids(a) + ids(c) + ids(b)


def test_a_batch_for_another_run_is_refused_whole_and_nothing_is_spooled(tmp_path: Path) -> None:
    from daemon.app import spool_batch

    spool = Spool(tmp_path / "spool", 1 << 20)
    mixed = batch(3, run="run-a") + batch(1, run="run-b")
    with pytest.raises(BadTrajectory, match=r"for run 'run-b'.*takes run 'run-a'"):
        spool_batch(spool, ndjson(mixed), "run-a")
    assert spool.depth() == 0
    held, fresh = spool_batch(spool, ndjson(mixed[:3] + batch(1)), "run-a")
    assert fresh == 4 and held == ids(mixed[:3]) + held[3:]
    assert spool_batch(spool, ndjson(batch(1, run="run-b")), None)[1] == 1  # run not known yet
    spool.close()
