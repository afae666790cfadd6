"""Views of a fleet larger than a peer book (daemon/peering/peers.py, anchors): every node of a
region must agree on who fetches for it (RegionPeering.fetch_role), which it computes from its
own book. With books of `max_peers` and a fleet many times that, a full book of proven peers
used to take no newcomer, so views froze with whoever came first and most nodes believed they
fetched for their region. Real PeerBooks, RegionPeerings and index listings/learning; only the
HTTP between them is a function call, and a hello's proof is taken as given."""

import contextlib

import pytest

from bench.fleet_views import Fleet
from daemon.peering.peers import (
    ANCHOR_DEAD_AFTER,
    ANCHORS_PER_REGION,
    MAX_ANCHORS,
    MAX_TRAINER_ANCHORS,
    MAX_UNPROVEN_ANCHORS,
    BookFull,
    PeerBook,
)
from daemon.peering.regions import DEAD_AFTER, RegionPeering, rank


def first(fleet: Fleet, region: str, skip: tuple[str, ...] = ()) -> str:
    names = [n for n, _, r, role in fleet.who.values() if r == region and role == "region"
             and n not in skip]
    return min(names, key=lambda n: rank(region, n))


def test_every_region_agrees_on_one_fetcher_in_a_fleet_25x_the_book() -> None:
    """300 nodes in 10 regions, books of 12: after a dozen index reads per node, each region
    has exactly one fetcher (its first-ranked member) and the fleet one (r0's); books stay
    within max_peers plus the anchors. The same fleet on the code before anchors (index
    replies a random sample, a full book taking no newcomer): 243 of the 300 nodes believed
    they fetched, 5 of them for the fleet."""
    regions, max_peers = 10, 12
    fleet = Fleet(regions, 30, max_peers, seed=3)
    for _ in range(12):
        fleet.round()
    fetchers = fleet.fetchers()
    assert fetchers == {f"r{i}": [first(fleet, f"r{i}")] for i in range(regions)}
    roles = [b.peering.fetch_role(b) for b in fleet.books.values() if b.role != "trainer"]
    assert roles.count("fleet") == 1
    fleet_book = next(b for b in fleet.books.values() if b.node == first(fleet, "r0"))
    assert fleet_book.peering.fetch_role(fleet_book) == "fleet"
    fleet_book.peering.endpoints(fleet_book)  # what the swarm asks; status reads its book
    shown = fleet_book.peering.status()
    assert (shown["fetch_role"], shown["hears_trainer_via"]) == ("fleet", None)
    assert shown["anchors"] == len(fleet_book.anchors()) > ANCHORS_PER_REGION
    bound = max_peers + ANCHORS_PER_REGION * regions + 1
    assert max(len(b.peers) for b in fleet.books.values()) <= bound

    # r3's first member dies: every view that counted it sees it fail; r3's next member takes
    # over in every view (it is already each r3 book's second anchor)
    dead = first(fleet, "r3")
    for b in fleet.books.values():
        for p in b.peers.values():
            if p.node == dead:
                p.failures = DEAD_AFTER
    fleet.books = {u: b for u, b in fleet.books.items() if b.node != dead}
    for _ in range(2):
        fleet.round()
    assert fleet.fetchers()["r3"] == [first(fleet, "r3", skip=(dead,))]


def book(max_peers: int = 3) -> PeerBook:
    b = PeerBook("http://10.0.0.1:8700", ("10.0.0.1", 6881), "me", [], max_peers)
    b.set_region("a", "region", RegionPeering("aware", 1))
    return b


def names_by_rank(region: str, count: int) -> list[str]:
    return sorted((f"{region}{i}" for i in range(count)), key=lambda n: rank(region, n))


def _learn(b: PeerBook, region: str, name: str, i: int, proven: bool = True,
           role: str = "region"):
    ip = f"10.{ord(region[0]) % 250}.{i // 250}.{i % 250 + 2}"
    p = b.learn(f"http://{ip}:8700", (ip, 6881), name, region=region, role=role)
    if proven:
        b.proved(p)
    return p


def test_a_full_book_takes_a_better_ranked_member_as_anchor_once_it_proves() -> None:
    b = book(max_peers=2)
    ranked = names_by_rank("b", 7)
    for i in (2, 3, 4, 5):  # b's two best known are anchors, beyond the two ordinary places
        _learn(b, "b", ranked[i], i)
    assert {b.peers[u].node for u in b.anchors()} == {ranked[2], ranked[3]}
    assert len(b.peers) == 4
    # an unproven newcomer that ranks after both anchors stands below every proven ordinary
    # peer: refused
    with pytest.raises(BookFull):
        _learn(b, "b", ranked[6], 6, proven=False)
    # b's first-ranked member is taken although the book is full, as a candidate beside the
    # trusted anchors: while its hello runs it displaces nobody
    best = _learn(b, "b", ranked[0], 0, proven=False)
    assert {b.peers[u].node for u in b.anchors()} == {ranked[0], ranked[2], ranked[3]}
    assert len(b.peers) == 5
    # once it proves, it is an anchor in its own right: the anchor it displaced is ordinary,
    # and the ordinary peer in the worst standing goes
    b.proved(best)
    anchors = b.anchors()
    assert {b.peers[u].node for u in anchors} == {ranked[0], ranked[2]}
    assert len(b.peers) - len(anchors) == 2
    assert len(b.peers) == 4


def test_names_that_rank_first_cost_no_proven_peer_its_place_while_unproven() -> None:
    """Anyone can choose node names that rank before a region's members (rank is a hash of
    the name). Announced in an index reply, never proven, they must not push the region's
    proven anchors out of the book."""
    b = book(max_peers=4)
    for region in "bcdefg":
        for i, name in enumerate(names_by_rank(region, 4)[1:]):
            with contextlib.suppress(BookFull):  # the ordinary places fill
                _learn(b, region, name, i)
    proven = {u for u, p in b.peers.items() if p.proven}
    anchors = b.anchors()
    for region in "bcdefg":  # names found to rank before everyone in each region
        fakes = [n for n in (f"x{region}{k}" for k in range(400))
                 if rank(region, n) < rank(region, names_by_rank(region, 4)[0])][:8]
        for i, name in enumerate(fakes):
            with contextlib.suppress(BookFull):
                _learn(b, region, name, 100 + i, proven=False)
    assert proven <= set(b.peers), "a proven peer was evicted for an unproven name"
    assert anchors <= b.anchors()
    assert len(b.peers) <= 4 + 2 * 6 + MAX_UNPROVEN_ANCHORS


def test_made_up_regions_that_sort_first_leave_a_real_regions_newcomer_a_candidate_place(
        ) -> None:
    """Names of made-up regions that sort before every real one ("0...") fill the unproven
    candidate places; a real region's better-ranked newcomer must still get one (candidates of
    regions with a trusted member come first), or views could not move to it until the fakes'
    hellos failed."""
    b = book(max_peers=4)
    ranked = names_by_rank("b", 3)
    for i, name in enumerate(ranked[1:]):
        _learn(b, "b", name, i)
    for i in range(MAX_UNPROVEN_ANCHORS + 8):
        with contextlib.suppress(BookFull):
            b.learn(f"http://10.9.{i}.9:8700", None, f"f{i}", region=f"0fake{i:03d}",
                    role="region")
    newcomer = _learn(b, "b", ranked[0], 40, proven=False)
    assert newcomer.url in b.anchors()
    assert sum(not b.peers[u].trusted for u in b.anchors()) <= MAX_UNPROVEN_ANCHORS


def test_made_up_trainers_are_bounded_and_leave_the_regions_anchors_alone() -> None:
    b = book(max_peers=8)
    real = _learn(b, "t", "trainer", 0, role="trainer")
    regions = [_learn(b, "b", name, i) for i, name in enumerate(names_by_rank("b", 2))]
    for i in range(40 * 64):
        with contextlib.suppress(BookFull):
            _learn(b, f"t{i}", f"fake{i}", 10 + i, proven=False, role="trainer")
    anchors = b.anchors()
    assert len(b.peers) <= 8 + MAX_ANCHORS
    # the trusted trainers' places, and as many unproven candidates beside them
    assert sum(b.peers[u].role == "trainer" for u in anchors) <= 2 * MAX_TRAINER_ANCHORS
    assert real.url in anchors and all(p.url in anchors for p in regions)


def test_a_failing_anchor_loses_its_place_and_goes_at_the_next_trim() -> None:
    b = book(max_peers=2)
    trainer = _learn(b, "t", "trainer", 0, role="trainer")
    ranked = names_by_rank("b", 4)
    members = [_learn(b, "b", name, i) for i, name in enumerate(ranked)]
    assert {members[0].url, members[1].url, trainer.url} == b.anchors()
    for p in (members[0], trainer):
        for _ in range(ANCHOR_DEAD_AFTER):
            b.failed(p, "connection refused")
    anchors = b.anchors()
    assert members[0].url not in anchors and trainer.url not in anchors
    assert members[2].url in anchors  # the next by rank takes the place
    b.proved(_learn(b, "c", "c0", 9, proven=False))  # any change trims the book
    # back to max_peers ordinary peers: a failing one went, the healthy member stayed
    assert len(b.peers) - len(b.anchors()) == 2
    assert members[3].url in b.peers
    assert members[0].url not in b.peers or trainer.url not in b.peers


def test_a_book_never_holds_more_than_max_peers_plus_its_anchors() -> None:
    b = book(max_peers=4)
    for i in range(3 * MAX_ANCHORS):  # proven members of ever new regions
        with contextlib.suppress(BookFull):
            _learn(b, f"r{i}", f"n{i}", i)
        assert len(b.peers) <= 4 + MAX_ANCHORS
    assert len(b.anchors()) == MAX_ANCHORS


def test_made_up_regions_cannot_grow_a_book_past_its_anchor_bound() -> None:
    """Announcements (never proven) of members of ever new regions: the book takes no more of
    them than its unproven anchor places."""
    b = book(max_peers=4)
    for i in range(4 * MAX_UNPROVEN_ANCHORS):
        with contextlib.suppress(BookFull):
            b.learn(f"http://10.{i // 250 + 1}.{i % 250}.9:8700", None, f"n{i}",
                    region=f"fake{i}", role="region")
    assert len(b.peers) <= 4 + MAX_UNPROVEN_ANCHORS
    assert len(b.anchors()) <= MAX_UNPROVEN_ANCHORS
    # and they cost no proven peer its place
    kept = b.learn("http://10.200.0.1:8700", ("10.200.0.1", 6881), "ok", region="a",
                   role="region")
    b.proved(kept)
    for i in range(64):
        with contextlib.suppress(BookFull):
            b.learn(f"http://10.201.{i}.9:8700", None, f"m{i}", region=f"more{i}",
                    role="region")
    assert kept.url in b.peers


def test_an_index_lists_the_askers_region_first_then_the_trainers_then_one_per_region() -> None:
    b = book(max_peers=16)
    t = b.learn("http://10.9.0.1:8700", ("10.9.0.1", 6881), "trainer", region="t",
                role="trainer")
    b.proved(t)
    for region in ("b", "c", "d"):
        for i, name in enumerate(names_by_rank(region, 3)):
            ip = f"10.{ord(region)}.0.{i + 2}"
            p = b.learn(f"http://{ip}:8700", (ip, 6881), name, region=region, role="region")
            b.proved(p)
    listed = b.listing("c", limit=64)
    assert {e["node"] for e in listed[:2]} == set(names_by_rank("c", 3)[:2])
    assert listed[2]["node"] == "trainer"
    assert {e["region"] for e in listed[3:5]} == {"b", "d"}
    assert len(b.listing("c", limit=3)) == 3
    # unproven peers are never listed
    b.learn("http://10.77.0.2:8700", ("10.77.0.2", 6881), "b00", region="b", role="region")
    assert all(e["node"] != "b00" for e in b.listing("b"))
