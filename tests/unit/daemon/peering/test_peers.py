"""Peer announcements and standing: API-shaped URLs, IP-only BitTorrent endpoints, node names,
a bounded book that evicts the worst, backoff, strikes and bans."""

import pytest

from daemon.peering.asking import parse_head
from daemon.peering.peer_client import BadReply
from daemon.peering.peers import (
    BAN_FAILURES,
    BadPeer,
    BookFull,
    PeerBook,
    check_url,
    parse_endpoint,
    parse_header,
)


def new_book(max_peers: int = 4, bootstrap: tuple[str, ...] = ()) -> PeerBook:
    return PeerBook("http://127.0.0.1:8700", ("127.0.0.1", 6881), "me", list(bootstrap),
                    max_peers)


@pytest.mark.parametrize("url", [
    "http://10.0.0.1:7000/internal/admin/keys?", "http://10.0.0.1:7000/x", "ftp://10.0.0.1:1",
    "http://u:p@10.0.0.1:7000", "http://10.0.0.1:7000/#frag", "http://10.0.0.1:7000?a=1",
    "http://bad_host:7000", "http://10.0.0.1:99999", "x" * 400, 5, "http://a b:1"])
def test_peer_urls_must_be_the_daemon_api_root(url: object) -> None:
    with pytest.raises(BadPeer):
        check_url(url)


def test_peer_urls_are_normalised() -> None:
    assert check_url("http://Host.Example:7000/") == "http://host.example:7000"
    assert check_url("https://10.0.0.1") == "https://10.0.0.1:443"
    assert check_url("http://[::1]:80") == "http://[::1]:80"


@pytest.mark.parametrize("text", ["evil.example:6881", "localhost:1", "0.0.0.0:6881",
                                  "10.0.0.1:0", "10.0.0.1", "[::1]:x", "a" * 100])
def test_bt_endpoints_must_be_ip_literals(text: str) -> None:
    with pytest.raises(BadPeer):
        parse_endpoint(text)


def test_bt_endpoints_parse_v4_and_v6() -> None:
    assert parse_endpoint("10.0.0.2:6881") == ("10.0.0.2", 6881)
    assert parse_endpoint("[::1]:6881") == ("::1", 6881)


def test_header_node_names_are_bounded_and_plain() -> None:
    with pytest.raises(BadPeer):
        parse_header("http://10.0.0.1:7000 10.0.0.1:6881 [/oops]")
    with pytest.raises(BadPeer):
        parse_header("http://10.0.0.1:7000 10.0.0.1:6881 " + "n" * 65)


async def test_the_book_holds_at_most_max_peers_and_evicts_the_worst() -> None:
    book = new_book(max_peers=3, bootstrap=("http://10.0.0.9:7000",))
    a = book.learn("http://10.0.0.1:7000")
    book.learn("http://10.0.0.2:7000")
    for _ in range(3):
        book.failed(a, "down")
    book.learn("http://10.0.0.3:7000")  # evicts a, the worst
    assert "http://10.0.0.1:7000" not in book.peers
    for p in book.peers.values():
        p.proven = True
    with pytest.raises(BookFull):
        book.learn("http://10.0.0.4:7000")  # everyone is in better standing
    assert book.learn_header("http://10.0.0.5:7000 10.0.0.5:6881 x") is None
    assert len(book.peers) == 3 and "http://10.0.0.9:7000" in book.peers


async def test_failures_back_off_then_ban_and_bans_survive_eviction() -> None:
    book = new_book(max_peers=2)
    p = book.learn("http://10.0.0.1:7000", ("10.0.0.1", 6881))
    p.proven = True
    assert book.bt_endpoints() == [("10.0.0.1", 6881)]
    book.failed(p, "x")
    assert not p.usable() and not p.banned()
    for _ in range(BAN_FAILURES):
        book.failed(p, "x")
    assert p.banned() and book.bt_endpoints() == []
    del book.peers[p.url]
    assert book.learn(p.url).banned()


async def test_a_refuted_claim_is_forgotten_and_two_ban() -> None:
    book = new_book()
    p = book.learn("http://10.0.0.1:7000", head=10**12)
    p.proven = True
    assert book.claimed_head() == 10**12
    book.lied(p, "claimed v1000000000000")
    assert p.head is None and book.claimed_head() is None and not p.banned()
    book.learn(p.url, head=10**12)
    book.lied(p, "again")
    assert p.banned() and book.claimed_head() is None


async def test_unproven_peers_are_not_dialled_nor_counted_for_heads() -> None:
    book = new_book()
    book.learn("http://10.0.0.1:7000", ("10.0.0.1", 6881), head=5)
    assert book.bt_endpoints() == [] and book.claimed_head() is None
    assert book.to_watch(10) == [] and book.by_head(5) == []


def test_head_replies_are_validated_in_our_own_words() -> None:
    assert parse_head({"version": 3, "bt": "10.0.0.1:1", "node": "n"}, "u") == \
        (3, ("10.0.0.1", 1), "n")
    for bad in ({"version": 10**400}, {"version": -1}, {"version": True},
                {"bt": "evil.example:6881"}, {"node": "[/oops]"}):
        with pytest.raises(BadReply) as e:
            parse_head(bad, "u")
        assert "evil" not in str(e.value) and "oops" not in str(e.value)


def test_the_config_refuses_bootstrap_and_advertise_urls_that_are_not_api_roots() -> None:
    import pydantic

    from daemon.config import Config

    base = {"node": "n", "region": "r", "role": "region", "state_dir": "/tmp",
            "trainer_public_key": "ab" * 32, "token": "t" * 8}
    for doc in ({"bootstrap": ["http://10.0.0.1:7000/v1/chain"]},
                {"http": {"advertise_url": "http://10.0.0.1:7000/x?y"}}):
        with pytest.raises(pydantic.ValidationError, match="host:port"):
            Config.model_validate(base | doc)
    cfg = Config.model_validate(base | {"bootstrap": ["http://10.0.0.1:7000/"]})
    assert cfg.bootstrap == ["http://10.0.0.1:7000"]


def test_a_ban_endpoint_names_its_peer_exactly_or_by_its_only_address() -> None:
    b = new_book(max_peers=8)
    b.learn("http://127.0.0.5:8700", ("127.0.0.5", 6881), "r5")
    b.learn("http://127.0.0.6:8700", ("127.0.0.6", 6881), "r6a")
    b.learn("http://127.0.0.6:8701", ("127.0.0.6", 6882), "r6b")
    assert b.at_endpoint("127.0.0.5:6881").node == "r5"
    assert b.at_endpoint("127.0.0.5:40000").node == "r5"  # the only daemon at that address
    assert b.at_endpoint("127.0.0.6:6882").node == "r6b"
    assert b.at_endpoint("127.0.0.6:40000") is None  # two daemons there: name neither
    assert b.at_endpoint("127.0.0.9:6881") is None
