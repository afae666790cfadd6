"""Whom a region node hears the trainer through (daemon/versions/sync.py `Syncer.upstream`,
RegionPeering.fetchers) and how seldom it still asks the trainer itself (`glance_s`): a region's
member through its region's fetcher, a region's fetcher through the fleet's, the fleet's fetcher
nobody; so only the fleet's fetcher long-polls the trainer, and the others' glances at it are
paced by the fleet's size as the trainer counts it (a book holds at most `max_peers`)."""

from daemon.config import SyncConfig
from daemon.versions.sync import GLANCE_MAX_S, TRAINER_INDEX_READERS, TRAINER_INDEX_S, Syncer
from tests.unit.daemon.peering.test_regions import MEMBERS, book_for, fleet, gateway


def syncer(node: str, region: str, **settings) -> tuple[Syncer, dict]:
    book = book_for(node, region)
    fleet(book, MEMBERS)
    urls = {p.node: p.url for p in book.peers.values()}
    return Syncer(store=None, weights=None, book=book, client=None, artifacts=None, board=None,
                  notify=None, keeper=None, settings=SyncConfig(**settings)), urls


def test_members_hear_their_fetcher_fetchers_hear_the_fleets_and_it_the_trainer() -> None:
    fleet_fetcher, b_fetcher = gateway("a", MEMBERS["a"]), gateway("b", MEMBERS["b"])
    b_member = next(n for n in MEMBERS["b"] if n != b_fetcher)
    member, urls = syncer(b_member, "b")
    assert member.upstream() == urls[b_fetcher] and member.watched() == [urls[b_fetcher]]
    fetcher, urls = syncer(b_fetcher, "b")
    assert fetcher.upstream() == urls[fleet_fetcher]
    first, _ = syncer(fleet_fetcher, "a")
    assert first.upstream() is None
    assert first.watched() == [urls["trainer"]], "the fleet's fetcher always polls the trainer"
    for s, polls_trainer in ((member, False), (fetcher, False), (first, True)):
        trainer = next(p for p in s.book.peers.values() if p.node == "trainer")
        assert s.hears_elsewhere(trainer) is not polls_trainer
    off, _ = syncer(b_member, "b", region_wait_s=0)  # every node asks the trainer itself
    assert off.upstream() is None and off.watched() == [urls["trainer"]]


def test_reports_go_to_the_fetcher_and_from_fetchers_up_and_out_of_their_region() -> None:
    """A fetcher reports to its bootstrap peers outside its region (a chain of regions stays a
    chain), else to the trainer: not to a bootstrap peer in its own region, which reports to
    the fetcher and would get the region's entries back (a loop never reaching the trainer)."""
    b_fetcher = gateway("b", MEMBERS["b"])
    member, urls = syncer(next(n for n in MEMBERS["b"] if n != b_fetcher), "b")
    assert member.report_targets() == [urls[b_fetcher]]
    fetcher, _ = syncer(b_fetcher, "b")  # every peer is a bootstrap peer in this book
    outside = sorted(u for n, u in urls.items() if n not in MEMBERS["b"])
    assert fetcher.report_targets() == outside
    for p in fetcher.book.peers.values():  # its bootstrap list names its own region only
        p.bootstrap, p.proven = p.node in MEMBERS["b"], True  # the others proven since
    assert fetcher.report_targets() == [urls["trainer"]]
    blind, _ = syncer(b_fetcher, "b", region_wait_s=0)
    assert blind.report_targets() == [], "the bootstrap list, as before fetch roles"


def test_a_banned_upstream_is_not_heard_through() -> None:
    b_fetcher = gateway("b", MEMBERS["b"])
    name = next(n for n in MEMBERS["b"] if n != b_fetcher)
    member, urls = syncer(name, "b")
    member.book.peers[urls[b_fetcher]].banned_until = 10**12
    # the next member by rank fetches for the region now (or this node, hearing the fleet's)
    rest = [n for n in MEMBERS["b"] if n != b_fetcher]
    nxt = gateway("b", rest)
    want = urls[gateway("a", MEMBERS["a"])] if nxt == name else urls[nxt]
    assert member.upstream() == want


def test_glances_at_the_trainer_are_paced_by_the_fleet_the_trainer_counts() -> None:
    s, urls = syncer("b1", "b")
    known = len(s.book.peers)
    assert s.glance_s() == TRAINER_INDEX_S * max(1.0, known / TRAINER_INDEX_READERS)
    trainer = s.book.peers[urls["trainer"]]
    trainer.fleet_nodes = 100
    assert s.glance_s() == TRAINER_INDEX_S * 100 / TRAINER_INDEX_READERS
    trainer.fleet_nodes = 10_000  # at most GLANCE_MAX_S apart: 17 glances/s at the trainer
    assert s.glance_s() == GLANCE_MAX_S
    trainer.fleet_nodes = None
    s.book.peers[urls["a1"]].fleet_nodes = 10**6  # only the trainer's own count is taken
    assert s.glance_s() == TRAINER_INDEX_S * max(1.0, known / TRAINER_INDEX_READERS)


def test_the_count_relayed_by_the_upstream_paces_glances_from_the_first_reply() -> None:
    """A node that has not asked the trainer yet paces its glances by the trainer's count as its
    upstream relays it (`trainer_nodes` in head replies): without it every node of a restarted
    fleet glanced within the first TRAINER_INDEX_S. Another peer's relayed count is not
    believed, and the node relays the count it believes (app.head_doc)."""
    b_fetcher = gateway("b", MEMBERS["b"])
    s, urls = syncer(next(n for n in MEMBERS["b"] if n != b_fetcher), "b")
    known = len(s.book.peers)
    assert s.trainer_fleet() is None
    other = next(u for n, u in urls.items() if n not in (b_fetcher, "trainer"))
    s.book.peers[other].trainer_nodes = 10**6  # not the peer it hears the trainer through
    assert s.trainer_fleet() is None
    assert s.glance_s() == TRAINER_INDEX_S * max(1.0, known / TRAINER_INDEX_READERS)
    s.book.peers[urls[b_fetcher]].trainer_nodes = 100
    assert s.trainer_fleet() == 100
    assert s.glance_s() == TRAINER_INDEX_S * 100 / TRAINER_INDEX_READERS
    s.book.peers[urls["trainer"]].fleet_nodes = 400  # its own ask of the trainer counts too
    assert s.trainer_fleet() == 400 and s.glance_s() == GLANCE_MAX_S
