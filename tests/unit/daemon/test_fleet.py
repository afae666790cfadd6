"""FleetBoard (daemon/fleet.py): reports stored newest-first per node, ages instead of foreign
clocks, a node reporting only for itself, bounded boards and reports, lag in versions and
seconds, live versions for retention, and forwarding that never loops back."""

import json

import pytest

from daemon.fleet import MAX_HOPS, BadReport, FleetBoard, NodeReport, parse_report

T0 = 1_800_000_000.0


def rep(node: str, region: str = "r1", version: int | None = 3, age_s: float = 0.0,
        url: str | None = None, hops: int = 0, held_s: float | None = 5.0,
        role: str = "region", **kw) -> NodeReport:
    return NodeReport(node=node, region=region, role=role, version=version,
                      url=url or f"http://10.0.0.{abs(hash(node)) % 200 + 1}:8700",
                      age_s=age_s, hops=hops, held_s=held_s, **kw)


def body(*reports: NodeReport) -> bytes:
    return json.dumps({"reports": [r.model_dump(mode="json") for r in reports]}).encode()


def test_a_reporters_own_entry_and_what_it_forwards_are_stored() -> None:
    board = FleetBoard("trainer")
    a, b = rep("a", version=4), rep("b", region="r2", version=2, age_s=7.0, hops=1)
    got = board.accept("a", a.url, [a, b], T0)
    assert (got.stored, got.refused) == (2, [])
    assert board.entries["a"].via is None and board.entries["b"].via == "a"
    assert board.entries["b"].seen == T0 - 7.0
    assert board.entries["a"].since == T0 - 5.0


def test_a_report_without_the_reporters_own_fresh_entry_is_refused_whole() -> None:
    board = FleetBoard("trainer")
    a, b = rep("a"), rep("b")
    for reports in ([b], [a.model_copy(update={"url": "http://10.9.9.9:1"}), b],
                    [a.model_copy(update={"hops": 1}), b]):
        with pytest.raises(BadReport, match="for a itself"):
            board.accept("a", a.url, reports, T0)
    assert board.entries == {}


def test_a_node_name_stays_bound_to_the_url_it_was_first_reported_at() -> None:
    board = FleetBoard("trainer")
    real = rep("victim", url="http://10.0.0.1:8700", version=9)
    board.accept("victim", real.url, [real], T0)
    liar = rep("liar", url="http://10.0.0.2:8700")
    fake = rep("victim", url="http://10.0.0.3:8700", version=0, hops=1)
    got = board.accept("liar", liar.url, [liar, fake], T0 + 1)
    assert got.stored == 1 and got.refused[0]["node"] == "victim"
    assert "reports only for itself" in got.refused[0]["error"]
    assert board.entries["victim"].report.version == 9
    assert board.refused == 1 and board.last_refusal.startswith("victim")


def test_an_older_report_never_replaces_a_newer_one() -> None:
    board = FleetBoard("trainer")
    b_new = rep("b", version=5, age_s=1.0, hops=1)
    b_old = rep("b", version=4, age_s=20.0, hops=2)
    board.accept("a", rep("a").url, [rep("a"), b_new], T0)
    board.accept("c", rep("c").url, [rep("c"), b_old], T0 + 2)
    assert board.entries["b"].report.version == 5 and board.entries["b"].via == "a"


def test_entries_about_this_node_or_older_than_forget_s_are_refused() -> None:
    board = FleetBoard("trainer", forget_s=60.0)
    a = rep("a")
    got = board.accept("a", a.url, [a, rep("trainer", hops=1), rep("b", age_s=61.0, hops=1)],
                       T0)
    assert got.stored == 1 and {r["node"] for r in got.refused} == {"trainer", "b"}


def test_the_board_holds_at_most_max_nodes_and_forgets_silent_nodes() -> None:
    board = FleetBoard("trainer", max_nodes=2, forget_s=60.0)
    for i, name in enumerate(("a", "b")):
        board.accept(name, rep(name).url, [rep(name)], T0 + i)
    got = board.accept("c", rep("c").url, [rep("c")], T0 + 2)
    assert got.stored == 0 and "max_nodes=2" in got.refused[0]["error"]
    got = board.accept("c", rep("c").url, [rep("c")], T0 + 60.5)  # "a" is forgotten by now
    assert got.stored == 1 and set(board.entries) == {"b", "c"}


def test_live_versions_lists_the_versions_of_nodes_heard_from_within_the_window() -> None:
    board = FleetBoard("trainer")
    board.accept("a", rep("a").url, [rep("a", version=7), rep("b", version=None, age_s=3, hops=1),
                                     rep("c", version=2, age_s=40, hops=1)], T0)
    assert sorted(board.live_versions(T0 + 1, 30.0), key=str) == [7, None]
    assert sorted(board.live_versions(T0 + 1, 60.0), key=str) == [2, 7, None]
    assert board.live_versions(T0 + 200, 30.0) == []


def test_forwardable_ages_entries_adds_a_hop_and_never_sends_one_back() -> None:
    board = FleetBoard("r1")
    board.accept("a", rep("a").url, [rep("a"), rep("b", age_s=2.0, hops=1)], T0)
    fwd = {r["node"]: NodeReport.model_validate(r) for r in board.forwardable(T0 + 3, to="up")}
    assert fwd["a"].age_s == pytest.approx(3.0) and fwd["a"].hops == 1
    assert fwd["b"].age_s == pytest.approx(5.0) and fwd["b"].hops == 2
    assert board.forwardable(T0 + 3, to="a") == []  # both came via or from a
    deep = rep("d", hops=MAX_HOPS)
    board.accept("d", deep.url, [deep.model_copy(update={"hops": 0})], T0)
    board.entries["d"].report = deep
    assert "d" not in {r["node"] for r in board.forwardable(T0, to="up")}


def test_lag_counts_versions_and_seconds_since_the_first_missing_version_was_head() -> None:
    board = FleetBoard("trainer")
    for v, t in ((3, T0), (4, T0 + 10), (5, T0 + 20)):
        board.note_head(v, t)
    board.accept("a", rep("a").url, [rep("a", version=3), rep("b", version=5, hops=1),
                                     rep("c", version=None, hops=1)], T0 + 25)
    view = board.view(head=5, now=T0 + 30)
    nodes = {n["node"]: n for n in view["regions"]["r1"]["nodes"]}
    assert (nodes["a"]["lag_versions"], nodes["a"]["lag_s"]) == (2, 20.0)
    assert (nodes["b"]["lag_versions"], nodes["b"]["lag_s"]) == (0, 0.0)
    assert (nodes["c"]["lag_versions"], nodes["c"]["lag_s"]) == (6, 30.0)
    reg = view["regions"]["r1"]
    assert (reg["node_count"], reg["at_head"], reg["min_version"], reg["max_lag_versions"]) \
        == (3, 1, 3, 6)


def test_the_view_groups_by_region_sums_link_bytes_and_marks_stale_nodes() -> None:
    board = FleetBoard("trainer")
    links = {"cross": {"bytes_in": 100, "bytes_out": 1}, "intra": {"bytes_in": 5,
                                                                   "bytes_out": 50}}
    a = NodeReport.model_validate(rep("a", region="r1").model_dump() | {"links": links,
                                                                        "trajectories_waiting": 4})
    b = rep("b", region="r2", age_s=50.0, hops=1)
    board.accept("a", a.url, [a, b], T0)
    me = rep("trainer", region="home", role="trainer", version=3)
    view = board.view(head=3, now=T0, me=me, stale_s=30.0)
    assert set(view["regions"]) == {"r1", "r2", "home"} and view["nodes"] == 3
    r1 = view["regions"]["r1"]
    assert r1["links"]["cross"] == {"bytes_in": 100, "bytes_out": 1}
    assert r1["trajectories_waiting"] == 4
    assert view["regions"]["r2"]["stale"] == 1 and view["regions"]["r2"]["at_head"] == 0
    assert view["regions"]["home"]["nodes"][0]["self"] is True
    summary = board.summary(view)
    assert "nodes" not in summary["regions"]["r1"] and summary["regions"]["r1"]["node_count"] == 1


@pytest.mark.parametrize("doc, field", [
    ({"reports": []}, "reports"),
    ({"reports": [{"node": "a b", "region": "r", "role": "region", "url": "http://h:1"}]},
     "reports.0.node"),
    ({"reports": [{"node": "a", "region": "r", "role": "boss", "url": "http://h:1"}]},
     "reports.0.role"),
    ({"reports": [{"node": "a", "region": "r", "role": "region", "url": "http://h:1/x"}]},
     "reports.0.url"),
    ({"reports": [{"node": "a", "region": "r", "role": "region", "url": "http://h:1",
                   "version": -1}]}, "reports.0.version"),
    ({"reports": [{"node": "a", "region": "r", "role": "region", "url": "http://h:1",
                   "version": True}]}, "reports.0.version"),
    ({"reports": [{"node": "a", "region": "r", "role": "region", "url": "http://h:1",
                   "age_s": 1e9}]}, "reports.0.age_s"),
    ({"reports": [{"node": "a", "region": "r", "role": "region", "url": "http://h:1",
                   "hops": 99}]}, "reports.0.hops"),
    ({"reports": [{"node": "a", "region": "r", "role": "region", "url": "http://h:1",
                   "links": {"cross": {"bytes_in": "9"}}}]}, "reports.0.links.cross.bytes_in"),
    ({"reports": [{"node": "a", "region": "r", "role": "region", "url": "http://h:1",
                   "extra": 1}]}, "reports.0.extra"),
])
def test_a_malformed_report_is_refused_naming_the_entry_and_field(doc: dict, field: str) -> None:
    with pytest.raises(BadReport, match=f"{field.replace('.', '[.]')}"):
        parse_report(json.dumps(doc).encode())


def test_a_report_that_is_not_json_or_too_large_is_refused() -> None:
    with pytest.raises(BadReport, match="refused"):
        parse_report(b"{not json")
    with pytest.raises(BadReport, match="over"):
        parse_report(b" " * (16 << 20 | 1))
    assert parse_report(body(rep("a"))).reports[0].node == "a"
