"""Region-aware peering (daemon/peering/regions.py): regions travel in announcements, every daemon
elects
the same gateways, only gateways dial across regions, a trainer is a gateway only when alone, a
dead gateway is replaced, and blind mode dials everyone."""

import time

import pytest

from daemon.peering.peers import REGION_HEADER, BadPeer, PeerBook, parse_region
from daemon.peering.regions import DEAD_AFTER, RegionPeering, learn_index, link_bytes, rank


def book_for(node: str, region: str, role: str = "region", mode: str = "aware",
             gateways: int = 1) -> PeerBook:
    b = PeerBook(f"http://10.9.0.{hash(node) % 200 + 1}:8700", ("10.9.1.1", 6881), node, [], 64)
    b.set_region(region, role, RegionPeering(mode, gateways))
    return b


def fleet(book: PeerBook, members: dict[str, list[str]], trainer_region: str = "a") -> dict:
    """Teach `book` every node of `members` (region → names) plus a trainer; returns name → bt."""
    bts = {}
    for i, (region, names) in enumerate(sorted(members.items())):
        for j, name in enumerate(names):
            if name == book.node:
                continue
            bt = (f"10.{i + 1}.0.{j + 2}", 6881)
            p = book.learn(f"http://{bt[0]}:8700", bt, name, region=region, role="region")
            p.bootstrap = True
            bts[name] = bt
    p = book.learn("http://10.99.0.1:8700", ("10.99.0.1", 6881), "trainer",
                   region=trainer_region, role="trainer")
    p.bootstrap = True
    bts["trainer"] = ("10.99.0.1", 6881)
    return bts


MEMBERS = {"a": ["a1", "a2", "a3"], "b": ["b1", "b2", "b3"], "c": ["c1"]}


def gateway(region: str, names: list[str]) -> str:
    return min(names, key=lambda n: rank(region, n))


def test_region_header_round_trips_and_bad_values_are_refused() -> None:
    b = book_for("b1", "b")
    assert b.announce()[REGION_HEADER] == "b region"
    assert parse_region("eu-west trainer") == ("eu-west", "trainer")
    assert parse_region("eu-west") == ("eu-west", None)
    for bad in ("eu west x", "a/b", "eu boss", ""):
        with pytest.raises(BadPeer):
            parse_region(bad)
    other = book_for("a1", "a")
    p = other.learn_header(b.header(), b.announce()[REGION_HEADER])
    assert (p.region, p.role) == ("b", "region")
    assert p.as_dict()["region"] == "b"


def test_every_node_of_a_region_elects_the_same_gateway_and_only_it_dials_across() -> None:
    gb = gateway("b", MEMBERS["b"])
    views = {}
    for name in MEMBERS["b"]:
        b = book_for(name, "b")
        bts = fleet(b, MEMBERS)
        dial = set(b.swarm_endpoints())
        views[name] = b.peering.last["gateways"]
        local = {bts[n] for n in MEMBERS["b"] if n != name}
        assert local <= dial
        across = dial - local
        if name == gb:
            assert across == {bts[gateway("a", MEMBERS["a"])], bts["c1"]}
        else:
            assert across == set()
    assert len({str(v) for v in views.values()}) == 1


def test_trainer_is_dialled_by_its_own_region_and_is_gateway_only_when_alone() -> None:
    a1 = book_for("a1", "a")
    bts = fleet(a1, MEMBERS)
    assert bts["trainer"] in a1.swarm_endpoints()
    gb = book_for(gateway("b", MEMBERS["b"]), "b")
    bts = fleet(gb, MEMBERS)
    assert bts["trainer"] not in gb.swarm_endpoints()
    # region a loses every node but the trainer: the trainer stands in for it
    for p in gb.peers.values():
        if p.region == "a" and p.role == "region":
            for _ in range(DEAD_AFTER):
                gb.failed(p, "connection refused")
    assert bts["trainer"] in gb.swarm_endpoints()
    assert gb.peering.last["gateways"]["a"] == ["trainer"]


def test_a_dead_gateway_is_replaced_by_the_next_node_by_rank_but_not_after_one_slow_reply() -> None:
    order = sorted(MEMBERS["b"], key=lambda n: rank("b", n))
    second = book_for(order[1], "b")
    bts = fleet(second, MEMBERS)
    assert not second.peering.last.get("gateway") and not (
        set(second.swarm_endpoints()) - {bts[n] for n in MEMBERS["b"] if n != order[1]})
    first = next(p for p in second.peers.values() if p.node == order[0])
    second.failed(first, "one slow reply")
    second.swarm_endpoints()
    assert not second.peering.last["gateway"]
    second.failed(first, "connection refused")
    dial = set(second.swarm_endpoints())
    assert second.peering.last["gateway"]
    assert bts["c1"] in dial and bts[gateway("a", MEMBERS["a"])] in dial


def test_one_node_region_is_its_own_gateway_and_unknown_regions_are_dialled() -> None:
    c1 = book_for("c1", "c")
    bts = fleet(c1, MEMBERS)
    unknown = c1.learn("http://10.50.0.1:8700", ("10.50.0.1", 6881), "old-daemon")
    unknown.bootstrap = True
    dial = set(c1.swarm_endpoints())
    assert c1.peering.last["gateway"]
    assert {bts[gateway("a", MEMBERS["a"])], bts[gateway("b", MEMBERS["b"])],
            ("10.50.0.1", 6881)} <= dial
    assert bts["trainer"] not in dial


def test_two_gateways_per_region_and_blind_mode() -> None:
    order = sorted(MEMBERS["b"], key=lambda n: rank("b", n))
    b = book_for(order[1], "b", gateways=2)
    fleet(b, MEMBERS)
    b.swarm_endpoints()
    assert b.peering.last["gateway"] and len(b.peering.last["gateways"]["a"]) == 2
    blind = book_for("b3", "b", mode="blind")
    fleet(blind, MEMBERS)
    assert set(blind.swarm_endpoints()) == set(blind.bt_endpoints())
    with pytest.raises(ValueError):
        RegionPeering("sideways")


def test_index_teaches_peers_with_their_regions_and_skips_malformed_entries() -> None:
    b = book_for("b1", "b")
    src = b.learn("http://10.99.0.1:8700", ("10.99.0.1", 6881), "trainer")
    index = {"region": "a", "role": "trainer", "peers": [
        {"url": "http://10.1.0.2:8700", "bt": "10.1.0.2:6881", "node": "a1", "region": "a",
         "role": "region"},
        {"url": "http://10.1.0.3:8700", "bt": "10.1.0.3:6881", "node": "a2", "region": "a b"},
        {"url": "http://10.1.0.4:8700", "bt": "not-an-ip:1", "node": "a3", "region": "a"},
        "junk"]}
    assert learn_index(b, src, index) == 1
    assert (src.region, src.role) == ("a", "trainer")
    assert b.peers["http://10.1.0.2:8700"].region == "a"
    assert "http://10.1.0.3:8700" not in b.peers


def test_link_bytes_classes_connections_by_the_peers_region() -> None:
    b = book_for("b1", "b")
    bts = fleet(b, MEMBERS)
    ip = {name: bt[0] for name, bt in bts.items()}
    status = {"torrents": {"v00000001.delta": {"peer_list": [
        {"peer": f"{ip['b2']}:40123", "uploaded": 100, "downloaded": 7},
        {"peer": f"{ip['a1']}:6881", "uploaded": 5, "downloaded": 900},
        {"peer": "10.250.0.9:6881", "uploaded": 1, "downloaded": 2}]}}}
    assert link_bytes(b, status) == {"local": {"up": 100, "down": 7},
                                     "cross": {"up": 5, "down": 900},
                                     "unknown": {"up": 1, "down": 2}}


# --- gateways earn their role (issue 20, finding 4) -------------------------------------------

def fake_first(region: str, names: list[str]) -> str:
    """A name that ranks before every one of `names`, as an attacker would choose it."""
    best = min(rank(region, n) for n in names)
    return next(f"aaa-{i}" for i in range(100_000) if rank(region, f"aaa-{i}") < best)


def with_fake(book: PeerBook, region: str) -> tuple[str, tuple[str, int]]:
    fake = fake_first(region, MEMBERS[region])
    bt = ("10.66.0.1", 6881)
    p = book.learn("http://10.66.0.1:8700", bt, fake, region=region, role="region")
    p.proven = True
    return fake, bt


def test_a_first_ranking_name_that_never_served_is_outranked_by_a_member_that_did() -> None:
    me = sorted(MEMBERS["b"], key=lambda n: rank("b", n))[-1]
    b = book_for(me, "b")
    bts = fleet(b, MEMBERS)
    fake, _ = with_fake(b, "b")
    t0 = time.monotonic() - 60
    assert b.peering.elect(b, t0)["b"][0].node == fake  # nobody served yet: rank alone decides
    server = next(n for n in MEMBERS["b"] if n != me)
    b.peering.tick(b, [("v00000000.snapshot", f"{bts[server][0]}:{bts[server][1]}",
                        64 * 1024, 0)], wanting=False, now=t0 + 0.5)
    # settled: a better-ranked member takes over only after being best for deadline_s, so a
    # view that flips for a second (first-hand service arrives unevenly) moves nobody
    assert b.peering.elect(b, t0 + 1)["b"][0].node == fake
    assert b.peering.elect(b, t0 + 0.5 + b.peering.deadline_s - 0.1)["b"][0].node == fake
    assert b.peering.elect(b, t0 + 0.5 + b.peering.deadline_s)["b"][0].node == server
    assert not b.peering.last.get("gateway")
    b.swarm_endpoints()
    assert b.peering.last["gateways"]["b"] == [server]
    st = b.peering.status()
    assert st["gateways"]["b"] == [server] and not st["gateway"]
    cand = {c["node"]: c for c in st["candidates"]}
    assert cand[server]["served"] and not cand[fake]["served"]


def test_a_gateway_that_delivers_nothing_is_demoted_after_the_deadline() -> None:
    import time

    order = sorted(MEMBERS["b"], key=lambda n: rank("b", n))
    b = book_for(order[1], "b")
    b.peering.deadline_s = 3.0
    bts = fleet(b, MEMBERS)
    fake, _ = with_fake(b, "b")
    t0 = time.monotonic()
    b.peering.tick(b, [], wanting=False, now=t0)
    b.peering.tick(b, [], wanting=False, now=t0 + 10)
    assert not b.peering.demoted  # not downloading: no deadline runs
    b.peering.tick(b, [], wanting=True, now=t0 + 11)
    b.peering.tick(b, [], wanting=True, now=t0 + 13)
    assert not b.peering.demoted
    b.peering.tick(b, [], wanting=True, now=t0 + 14.1)
    assert list(b.peering.demoted) == ["http://10.66.0.1:8700"]
    d = b.peering.demoted["http://10.66.0.1:8700"]
    assert d["node"] == fake and "0 payload bytes" in d["reason"] and d["since"] > 0
    assert b.peering.elect(b, t0 + 14.2)["b"][0].node == order[0]
    st = b.peering.status()
    assert st["demotions"] == 1 and st["demoted"][0]["active"] and fake not in st["gateways"]["b"]
    # the next gateway gets a full deadline of its own, and bytes from anyone reset the clock
    b.peering.tick(b, [], wanting=True, now=t0 + 16)
    first = f"{bts[order[0]][0]}:{bts[order[0]][1]}"
    b.peering.tick(b, [("v00000001.delta", first, 100, 0)], wanting=True, now=t0 + 16.5)
    b.peering.tick(b, [("v00000001.delta", first, 100, 0)], wanting=True, now=t0 + 18.5)
    assert len(b.peering.demoted) == 1
    b.peering.tick(b, [("v00000001.delta", first, 100, 0)], wanting=True, now=t0 + 19.1)
    assert len(b.peering.demoted) == 2  # a trickle (100 bytes) does not hold the deadline off
    del b.peering.demoted[next(p.url for p in b.peers.values() if p.node == order[0])]
    b.peering.tick(b, [("v00000001.delta", first, 65636, 0)], wanting=True, now=t0 + 20)
    b.peering.tick(b, [("v00000001.delta", first, 65636, 0)], wanting=True, now=t0 + 22.5)
    assert len(b.peering.demoted) == 1
    b.peering.tick(b, [("v00000001.delta", first, 65636, 0)], wanting=True, now=t0 + 23.2)
    assert order[0] in {d["node"] for d in b.peering.demoted.values()}
    # this node is next: it dials across regions (not the demoted fake)
    assert b.peering.elect(b, t0 + 23.3)["b"][0].node == order[1]
    dial = set(b.swarm_endpoints())
    assert b.peering.last["gateway"] and bts["c1"] in dial


def test_the_region_a_peer_gives_in_its_own_index_wins_over_a_rewritten_book_entry() -> None:
    order = sorted(MEMBERS["b"], key=lambda n: rank("b", n))
    b = book_for(order[1], "b")
    fleet(b, MEMBERS)
    gw = next(p for p in b.peers.values() if p.node == order[0])
    learn_index(b, gw, {"region": "b", "role": "region"})
    b.learn_header(f"{gw.url} {gw.bt[0]}:{gw.bt[1]} {gw.node}", "mallory region")
    b.learn_header(f"{gw.url} {gw.bt[0]}:{gw.bt[1]} {gw.node}", "mallory region")
    assert gw.region == "mallory"  # the book took the header
    b.swarm_endpoints()
    assert not b.peering.last["gateway"] and b.peering.last["gateways"]["b"] == [order[0]]
    assert "mallory" not in b.peering.last["gateways"]


def test_bytes_from_an_endpoint_two_entries_claim_are_credited_to_neither() -> None:
    me = sorted(MEMBERS["b"], key=lambda n: rank("b", n))[-1]
    b = book_for(me, "b")
    bts = fleet(b, MEMBERS)
    server = next(n for n in MEMBERS["b"] if n != me)
    fake = fake_first("b", MEMBERS["b"])
    copy = b.learn("http://10.66.0.2:8700", bts[server], fake, region="b", role="region")
    copy.proven = True
    b.peering.tick(b, [("v00000000.snapshot", f"{bts[server][0]}:{bts[server][1]}",
                        64 * 1024, 0)], wanting=False)
    assert b.peering.service.delivered[copy.url] == 0
    assert not any(c["served"] for c in b.peering.status()["candidates"] if c["node"] == fake)


def test_sources_ask_claimants_of_this_region_first_and_the_trainer_last() -> None:
    b = book_for("b1", "b")
    fleet(b, MEMBERS)
    by_node = {p.node: p for p in b.peers.values()}
    for name in ("trainer", "a2", "b3", "c1"):
        by_node[name].head = 7
    by_node["b2"].head = 6  # behind: cannot serve v7
    first, rest = b.sources(7)
    assert first[0].node == "b3"
    assert {p.node for p in first} == {"b3", "a2", "c1"}
    assert "trainer" in {p.node for p in rest} and "b2" in {p.node for p in rest}
    assert not {p.node for p in first} & {p.node for p in rest}


def test_fetch_roles_agree_in_every_view_and_skip_the_dead() -> None:
    """One fetcher per region (first by rank), the fleet's in the trainer's region (a), every
    view the same; a dead fetcher's region moves to its next member."""
    roles = {}
    for region, names in MEMBERS.items():
        for me in names:
            b = book_for(me, region)
            fleet(b, MEMBERS, trainer_region="a")
            roles[me] = b.peering.fetch_role(b)
    firsts = {r: min(ns, key=lambda n: rank(r, n)) for r, ns in MEMBERS.items()}
    assert {n for n, r in roles.items() if r == "fleet"} == {firsts["a"]}
    assert {n for n, r in roles.items() if r == "region"} == {firsts["b"], firsts["c"]}
    assert all(r == "member" for n, r in roles.items() if n not in firsts.values())
    other = next(n for n in MEMBERS["b"] if n != firsts["b"])
    b = book_for(other, "b")
    fleet(b, MEMBERS)
    for p in b.peers.values():
        if p.node == firsts["b"]:
            p.failures = DEAD_AFTER
    ranked = sorted((n for n in MEMBERS["b"] if n != firsts["b"]), key=lambda n: rank("b", n))
    assert (b.peering.fetch_role(b) == "region") is (ranked[0] == other)
    blind = book_for("b1", "b", mode="blind")
    assert blind.peering.fetch_role(blind) is None
