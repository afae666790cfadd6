"""FleetBoard (daemon/fleet/board.py): reports stored newest-first per node, ages instead of foreign
clocks, a node reporting only for itself, entries signed by their origin (a relay forwards, it
cannot forge), bounded boards and reports with a per-reporter quota and stalest-first eviction,
lag in versions and seconds, live versions for retention, and forwarding that never loops
back."""

import json
from functools import cache

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from daemon.fleet.board import MAX_HOPS, BadReport, FleetBoard, NodeReport, parse_report
from daemon.peering.identity import Identities, NodeKey, check_entry

T0 = 1_800_000_000.0


@cache
def key_of(node: str) -> NodeKey:
    return NodeKey(Ed25519PrivateKey.generate(), node)


def rep(node: str, region: str = "r1", version: int | None = 3, age_s: float = 0.0,
        url: str | None = None, hops: int = 0, held_s: float | None = 5.0,
        role: str = "region", key: NodeKey | None = None, ts: float | None = None,
        **kw) -> NodeReport:
    """`node`'s entry signed by its key (or `key`), at T0 - age_s unless `ts` is given."""
    r = NodeReport(node=node, region=region, role=role, version=version,
                   url=url or f"http://10.0.0.{abs(hash(node)) % 200 + 1}:8700",
                   age_s=age_s, hops=hops, held_s=held_s, **kw)
    signed = (key or key_of(node)).sign_entry(r.model_dump(mode="json"),
                                              T0 - age_s if ts is None else ts)
    return NodeReport.model_validate(signed)


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


def test_a_relay_forwards_an_entry_but_cannot_forge_one_for_a_pinned_node() -> None:
    board, ids = FleetBoard("trainer"), Identities(key_of("trainer"))
    real = rep("victim", url="http://10.0.0.1:8700", version=9)
    board.accept("victim", real.url, [real], T0, identities=ids)
    liar = rep("liar", url="http://10.0.0.2:8700")
    fake = rep("victim", url="http://10.0.0.1:8700", version=4242, region="mallory-land",
               hops=1, key=key_of("liar"), ts=T0 + 1)
    got = board.accept("liar", liar.url, [liar, fake], T0 + 1, identities=ids)
    assert got.stored == 1 and got.refused[0]["node"] == "victim"
    assert "cannot forge" in got.refused[0]["error"]
    assert board.entries["victim"].report.version == 9
    assert board.refused == 1 and board.last_refusal.startswith("victim")
    board.entries.clear()  # even with the victim's entry gone, its name stays pinned
    got = board.accept("liar", liar.url, [liar, fake], T0 + 2, identities=ids)
    assert "victim" not in board.entries and ids.refused_total >= 1
    assert ids.refused[-1]["node"] == "victim"
    # the real entry, relayed by the liar, is taken: relays forward
    relayed = rep("victim", url="http://10.0.0.1:8700", version=10, hops=1, ts=T0 + 2)
    got = board.accept("liar", liar.url, [liar, relayed], T0 + 3, identities=ids)
    assert got.stored == 2 and board.entries["victim"].report.version == 10


def test_an_altered_or_unsigned_entry_fails_its_origin_check() -> None:
    good = rep("a", version=3).model_dump(mode="json")
    assert check_entry(good, T0, 120.0) is None
    assert check_entry(good | {"age_s": 9.0, "hops": 3}, T0, 120.0) is None  # relays change
    assert "does not verify" in check_entry(good | {"version": 4}, T0, 120.0)
    assert "unsigned" in check_entry(good | {"sig": None}, T0, 120.0)
    assert "too old" in check_entry(good, T0 + 1000, 120.0)
    board = FleetBoard("trainer")
    a, b = rep("a"), rep("b", hops=1)
    got = board.accept("a", a.url, [a, b.model_copy(update={"sig": None})], T0)
    assert got.stored == 1 and "unsigned" in got.refused[0]["error"]
    with pytest.raises(BadReport, match="own entry"):
        board.accept("a", a.url, [a], T0, checks=["the origin's signature does not verify"])


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


def test_a_full_board_evicts_the_stalest_entry_not_the_newcomer() -> None:
    board = FleetBoard("trainer", max_nodes=2, forget_s=60.0)
    for i, name in enumerate(("a", "b")):
        board.accept(name, rep(name).url, [rep(name, ts=T0 + i)], T0 + i)
    got = board.accept("c", rep("c").url, [rep("c", ts=T0 + 2)], T0 + 2)
    assert got.stored == 1 and set(board.entries) == {"b", "c"} and board.evicted == 1
    stale = rep("d", age_s=30.0, ts=T0 - 28)  # older than everything held: not stored
    got = board.accept("b", rep("b").url, [rep("b", ts=T0 + 3), stale.model_copy(
        update={"hops": 1})], T0 + 3)
    assert "max_nodes=2" in got.refused[0]["error"] and set(board.entries) == {"b", "c"}


def test_a_reporter_may_forward_at_most_its_quota_of_entries() -> None:
    board = FleetBoard("trainer", max_nodes=100, max_per_reporter=3)
    flood = [rep(f"fake{i}", hops=1) for i in range(10)]
    got = board.accept("m", rep("m").url, [rep("m"), *flood], T0)
    assert got.stored == 4 and len(got.refused) == 7
    assert "max_per_reporter=3" in got.refused[0]["error"] and board.per_via == {"m": 3}
    real = rep("real")
    assert board.accept("real", real.url, [real], T0 + 1).stored == 1  # a real node gets in
    board.prune(T0 + 500)
    assert board.entries == {} and board.per_via == {}


def test_entries_that_cannot_be_stored_never_evict_anyone_from_a_full_board() -> None:
    """Eviction makes room only for entries that will be stored: forged ones (a failed origin
    check) and those over the reporter's quota evicted real nodes and were then refused."""
    board = FleetBoard("trainer", max_nodes=3, max_per_reporter=1, forget_s=60.0)
    for i, name in enumerate(("a", "b")):
        board.accept(name, rep(name).url, [rep(name, ts=T0 + i)], T0 + i)
    forged = [rep(f"fake{i}", hops=1, ts=T0 + 5) for i in range(4)]
    report = [rep("m", ts=T0 + 5), *forged]
    checks = [None, "bad signature", "bad signature", None, None]
    got = board.accept("m", rep("m").url, report, T0 + 5, checks=checks)
    # m and one forwarded entry (its quota) fit only by evicting the stalest one, "a"
    assert got.stored == 2 and board.evicted == 1, got
    assert set(board.entries) == {"b", "m", "fake2"}


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
