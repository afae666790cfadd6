"""The parts behind plans that follow what exists (issue 11): holder counts from peers' indexes,
giving up on what nobody offers, the head quorum before a first plan, the live-node table and
the retention keeper that outlives a daemon restart."""

import time
from types import SimpleNamespace

import daemon.peering.asking
import daemon.peering.holders
from chain.policy import Retention, recorded_decision
from chain.store import ChainStore
from daemon.config import SyncConfig
from daemon.peering.asking import HeadQuorum
from daemon.peering.holders import Holders
from daemon.peering.peers import PeerBook
from daemon.versions.live import MAX_NODES, LiveNodes
from daemon.versions.retain import Keeper
from tests.unit.chain.test_store import build_chain


class FakeClock:
    """A module's monotonic clock, advanced by the test: each timeout is checked on both sides
    of its bound with no real sleep (50-300 ms windows are at the mercy of a loaded host)."""

    def __init__(self, monkeypatch, module=daemon.peering.asking) -> None:
        self.now = 1000.0
        monkeypatch.setattr(module, "time", SimpleNamespace(monotonic=lambda: self.now,
                                                         time=time.time))


def test_holders_count_fresh_listings_of_usable_peers_and_a_local_copy(monkeypatch):
    clock = FakeClock(monkeypatch, daemon.peering.holders)
    h = Holders(SyncConfig(unoffered_timeout_s=0.2))
    h.record("http://a:1", 5, ["v00000005.delta", "v00000004.delta"])
    h.record("http://b:1", 5, ["v00000005.delta"])
    counts = h.counts(lambda url: url != "http://b:1", ["v00000003.delta"])
    assert counts == {"v00000005.delta": 1, "v00000004.delta": 1, "v00000003.delta": 1}
    clock.now += 0.19
    assert h.counts(lambda url: True, [])["v00000005.delta"] == 2
    clock.now += 0.02
    assert h.counts(lambda url: True, []) == {}, "a listing older than the timeout counts no more"


def test_an_artifact_nobody_lists_for_the_timeout_is_given_up_and_counted_as_unheld(
        monkeypatch):
    clock = FakeClock(monkeypatch, daemon.peering.holders)
    h = Holders(SyncConfig(unoffered_timeout_s=0.1, progress_timeout_s=0.1))
    h.note_plan(["v00000008.delta"], {})
    assert "v00000008.delta" not in h.status()
    clock.now += 0.09
    h.note_plan(["v00000008.delta"], {})
    assert "v00000008.delta" not in h.status()
    clock.now += 0.02
    h.note_plan(["v00000008.delta"], {})
    assert "no peer has listed it" in h.status()["v00000008.delta"]["reason"]
    assert h.counts(lambda url: True, [])["v00000008.delta"] == 0
    assert h.counts(lambda url: True, ["v00000008.delta"])["v00000008.delta"] == 1  # held here
    h.record("http://a:1", 9, ["v00000008.delta"])  # offered again: planned with again
    assert h.counts(lambda url: True, [])["v00000008.delta"] == 1
    assert h.status() == {}


def test_a_given_up_artifact_is_planned_with_again_after_its_hold(monkeypatch):
    clock = FakeClock(monkeypatch, daemon.peering.holders)
    h = Holders(SyncConfig(unoffered_timeout_s=0.1, progress_timeout_s=0.1))
    h.record("http://a:1", 9, ["v00000008.delta"])
    h.give_up("v00000008.delta", "no bytes for 0.1s")
    assert h.counts(lambda url: True, [])["v00000008.delta"] == 0
    clock.now += 0.19  # given up for 2 x the longer timeout
    h.record("http://a:1", 9, ["v00000008.delta"])
    assert h.counts(lambda url: True, [])["v00000008.delta"] == 0
    clock.now += 0.02
    h.record("http://a:1", 9, ["v00000008.delta"])
    assert h.counts(lambda url: True, [])["v00000008.delta"] == 1


def test_a_peer_listing_is_stale_once_it_claims_a_newer_head():
    h = Holders(SyncConfig())
    assert h.stale("http://a:1", None)
    h.record("http://a:1", 5, [])
    assert not h.stale("http://a:1", 5)
    assert h.stale("http://a:1", 6)


def _book(*urls: str) -> PeerBook:
    book = PeerBook("http://127.0.0.1:1", ("127.0.0.1", 2), "me", [], 32)
    for u in urls:
        book.learn(u)
    return book


def test_head_quorum_waits_for_every_known_peer_once_an_index_named_them():
    book = _book("http://127.0.0.2:1")
    q = HeadQuorum(quorum=3, wait_s=60)
    assert not q.check(book), "no head heard yet"
    q.reply("http://127.0.0.2:1", 3)
    assert not q.check(book), "no index read yet: other peers may exist"
    q.read_index = True
    book.learn("http://127.0.0.3:1")  # the stale peer's index named the trainer
    assert not q.check(book)
    q.reply("http://127.0.0.3:1", 8)
    assert q.check(book)


def test_head_quorum_settles_on_quorum_or_after_the_wait(monkeypatch):
    book = _book(*(f"http://127.0.0.{i}:1" for i in range(2, 9)))
    q = HeadQuorum(quorum=2, wait_s=60)
    q.reply("http://127.0.0.2:1", 3)
    assert not q.check(book)
    q.reply("http://127.0.0.3:1", 4)
    assert q.check(book)
    clock = FakeClock(monkeypatch)
    q = HeadQuorum(quorum=5, wait_s=5)
    q.reply("http://127.0.0.2:1", 3)
    assert not q.check(book)
    clock.now += 4.9
    assert not q.check(book)
    clock.now += 0.2
    assert q.check(book)


def test_live_nodes_age_out_and_stay_bounded():
    live = LiveNodes(within_s=10)
    live.seen("r1", "eu", 7, now=100.0)
    live.seen("r2", None, None, now=105.0)
    assert sorted(live.versions(now=108.0), key=str) == [7, None]
    assert live.versions(now=112.0) == [None]
    for i in range(MAX_NODES + 5):
        live.seen(f"n{i}", None, 1, now=200.0)
    assert len(live.versions(now=200.0)) == MAX_NODES


def test_a_restarted_keeper_still_keeps_what_the_recorded_live_versions_need(
        tmp_path, signing_key):
    store = ChainStore(tmp_path / "chain", signing_key.public_key())
    build_chain(store, signing_key, 12, snapshot_every=4)
    r = Retention(versions=2, behind_budget_bytes=1 << 30)
    Keeper(store, r, lambda: [2], 60, record=True).run()
    assert recorded_decision(store.root)[1] == [2]
    assert "v00000003.delta" in store.artifacts()
    restarted = Keeper(store, r, lambda: [], 60, record=True)  # no node has polled it yet
    restarted.run()
    assert "v00000003.delta" in store.artifacts()
    assert restarted.status()["kept_for"] == [2]
    Keeper(store, r, lambda: [], 0.0, record=True).run()  # the recorded versions aged out
    assert "v00000003.delta" not in store.artifacts()


def test_a_node_no_peer_answers_may_go_on_with_its_own_store_after_the_wait(monkeypatch):
    book = _book("http://127.0.0.2:1")
    clock = FakeClock(monkeypatch)
    q = HeadQuorum(quorum=3, wait_s=5)
    assert not q.check(book)
    clock.now += 5.1
    assert q.check(book) and not q.settled
    q.reply("http://127.0.0.2:1", 3)  # a first answer: gather the others before planning
    assert not q.check(book)


def test_a_given_up_artifact_comes_back_when_a_holder_that_was_gone_lists_it_again():
    h = Holders(SyncConfig(unoffered_timeout_s=0.2, progress_timeout_s=30))
    h.record("http://region:1", 9, ["v00000008.delta"])  # lists it, cannot serve it
    h.give_up("v00000008.delta", "no bytes for 30s")
    h.record("http://region:1", 9, ["v00000008.delta"])
    assert h.counts(lambda url: True, [])["v00000008.delta"] == 0
    h.record("http://trainer:1", 9, ["v00000008.delta"])  # the restarted trainer is back
    assert h.counts(lambda url: True, [])["v00000008.delta"] == 2
    assert h.status() == {}


def test_an_extended_listing_adds_what_was_published_since_and_counts_as_fresh(monkeypatch):
    """The trainer's listing between index reads (daemon/versions/sync.py refresh_holders):
    what it listed stays, the new head's artifacts are added, the listing is fresh again and
    no longer stale for that head."""
    clock = FakeClock(monkeypatch, daemon.peering.holders)
    h = Holders(SyncConfig(unoffered_timeout_s=10))
    h.record("http://t:1", 4, ["v00000004.delta", "v00000000.snapshot"])
    clock.now += 9
    assert h.stale("http://t:1", 5) and h.listed_head("http://t:1") == 4
    h.extend("http://t:1", 5, ["v00000005.delta"])
    assert not h.stale("http://t:1", 5) and h.listed_head("http://t:1") == 5
    clock.now += 5  # the first read is 14 s old; the extension keeps the listing counted
    assert h.counts(lambda url: True, []) == {
        "v00000004.delta": 1, "v00000000.snapshot": 1, "v00000005.delta": 1}
