"""Retention that knows who is behind (issue 11, finding 4): within a byte budget it keeps the
deltas a live node needs to reach the head from its own version; past the budget that node falls
back to a snapshot and the decision says so; the window and a late joiner's path are always
kept."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chain.errors import ChainError
from chain.manifest import artifact_name
from chain.planner import paths
from chain.policy import Retention, record_decision, recorded_decision
from tests.unit.chain.test_planner import Art, chain


def delta_names(lo: int, hi: int) -> set[str]:
    return {artifact_name(v, "delta") for v in range(lo, hi + 1)}


def test_retention_keeps_the_deltas_a_live_node_behind_still_needs():
    ms = chain(24, {0, 16})
    r = Retention(versions=4, behind_budget_bytes=10_000)
    assert "v00000008.delta" not in r.keep(ms)  # no one behind: the window only
    d = r.decide(ms, live=[7, 24, None])
    assert delta_names(8, 24) <= d.keep
    assert d.kept_for == (7,) and d.fell_back == ()
    assert d.used_bytes == 250 * len(delta_names(8, 16)) <= d.budget_bytes
    assert "v00000000.snapshot" not in d.keep and "v00000016.snapshot" in d.keep


def test_retention_past_its_budget_falls_back_to_a_snapshot_and_says_for_whom():
    ms = chain(24, {0, 16})
    d = Retention(versions=4, behind_budget_bytes=1000).decide(ms, live=[7, 14])
    assert d.kept_for == (14,) and d.fell_back == (7,)
    assert "v00000008.delta" not in d.keep and delta_names(15, 24) <= d.keep
    assert d.as_status()["fell_back"] == [7]


def test_retention_keeps_no_deltas_for_a_node_a_snapshot_serves_cheaper():
    ms = chain(24, {0, 16}, delta_bytes=5000, snap_bytes=10_000)
    d = Retention(versions=4, behind_budget_bytes=1 << 30).decide(ms, live=[3])
    assert d.kept_for == () and d.fell_back == () and d.used_bytes == 0
    assert d.keep == Retention(versions=4).window(ms)


def test_a_recorded_decision_round_trips_and_a_bad_one_is_named(tmp_path):
    record_decision(tmp_path, Retention(versions=3, behind_budget_bytes=77), [5, None])
    r, live = recorded_decision(tmp_path)
    assert (r.versions, r.behind_budget_bytes, live) == (3, 77, [5, None])
    (tmp_path / "retention.json").write_text('{"versions": "x"}')
    with pytest.raises(ChainError, match=r"retention\.json.*not a retention record"):
        recorded_decision(tmp_path)


@st.composite
def cases(draw):
    head = draw(st.integers(1, 40))
    snaps = draw(st.sets(st.integers(0, head), min_size=1, max_size=4)) | {0}
    arts = [Art(v, "delta", draw(st.integers(1, 2000))) for v in range(1, head + 1)]
    arts += [Art(v, "snapshot", draw(st.integers(1, 30_000))) for v in snaps]
    live = draw(st.lists(st.one_of(st.none(), st.integers(0, head)), max_size=6))
    r = Retention(versions=draw(st.integers(1, 10)),
                  behind_budget_bytes=draw(st.integers(0, 40_000)))
    return {a.name: a for a in arts}, head, live, r


@settings(max_examples=300, deadline=None)
@given(cases())
def test_retention_decision_holds_its_promises(case):
    ms, head, live, r = case
    d = r.decide(ms, live)
    kept = {n: ms[n] for n in d.keep}
    assert r.window(ms) <= d.keep
    assert d.used_bytes <= r.behind_budget_bytes
    assert d.used_bytes == sum(ms[n].payload_bytes for n in d.extra)
    assert paths(kept, None, head), "a late joiner can always reach the head"
    for h in d.kept_for:
        assert delta_names(h + 1, head) <= d.keep
    for h in {v for v in live if v is not None}:
        assert paths(kept, h, head) or h == head  # every live node can still reach the head
    assert not set(d.kept_for) & set(d.fell_back)
    if not live:
        assert d.keep == r.window(ms) and not d.extra
