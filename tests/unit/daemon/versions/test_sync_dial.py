"""What a region node's swarm dials for one artifact (daemon/versions/sync.py `Syncer._dial_for`):
the
region peering's choice, widened to the artifact's listed holders once its download stalled, so
a non-gateway whose region holds none of it is not left waiting forever."""

from daemon.config import SyncConfig
from daemon.versions.sync import Syncer
from tests.unit.daemon.peering.test_regions import MEMBERS, book_for, fleet, gateway

ART = "v00000022.delta"


def test_a_stalled_artifact_is_fetched_from_its_holders_across_regions_too():
    node = next(n for n in MEMBERS["b"] if n != gateway("b", MEMBERS["b"]))
    book = book_for(node, "b")
    bts = fleet(book, MEMBERS)
    sync = Syncer(store=None, weights=None, book=book, client=None, artifacts=None,
                  board=None, notify=None, keeper=None, settings=SyncConfig())
    trainer = next(p for p in book.peers.values() if p.node == "trainer")
    sync.holders.record(trainer.url, 22, [ART])
    before = sync._dial_for(ART)
    assert bts["trainer"] not in before, "a non-gateway dials only its region at first"
    sync.stalled.add(ART)
    after = sync._dial_for(ART)
    assert after == before | {bts["trainer"]}
    assert sync._dial_for("v00000023.delta") == before, "only the stalled artifact widens"
    trainer.banned_until = 10**12
    assert bts["trainer"] not in sync._dial_for(ART), "a banned holder is not dialled"
