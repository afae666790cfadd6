"""Node identity (daemon/peering/identity.py): the key made once in state_dir (mode 0600) and kept,
names
pinned to the first key and the pins kept across restarts, a second key refused and listed,
request signatures bound to what the request says and accepted once within the time window,
and the peer book updated only by the key that owns an entry (daemon/peering/peers.py)."""

import json
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from daemon.peering.identity import (
    KEY_FILE,
    PINS_FILE,
    BadIdentity,
    Identities,
    NodeKey,
    check_hello,
)
from daemon.peering.peers import PeerBook

T0 = 1_800_000_000.0


def key(node: str) -> NodeKey:
    return NodeKey(Ed25519PrivateKey.generate(), node)


def test_the_node_key_is_made_once_with_mode_0600_and_pins_survive_a_restart(
        tmp_path: Path) -> None:
    ids = Identities.open(tmp_path, "r1")
    path = tmp_path / KEY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    other = key("r2")
    assert ids.claim("r2", other.public, "test", T0)
    ids.save(force=True)
    again = Identities.open(tmp_path, "r1")
    assert again.own.public == ids.own.public and again.own.fingerprint.startswith("SHA256:")
    assert again.pinned("r2") == other.public
    assert not again.claim("r2", key("r2").public, "10.0.0.9", T0 + 1)
    assert again.refused[-1]["node"] == "r2" and again.refused[-1]["from"] == "10.0.0.9"
    assert again.refused_total == 1 and "pinned to" in again.refused[-1]["why"]
    assert not again.claim("r1", key("r1").public, "x", T0)  # nobody else is this node
    doc = json.loads((tmp_path / PINS_FILE).read_text())
    assert doc["r2"]["key"] == other.public
    path.chmod(0o644)
    Identities.open(tmp_path, "r1")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_damaged_key_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / KEY_FILE).write_text("not hex\n")
    (tmp_path / KEY_FILE).chmod(0o600)
    with pytest.raises(Exception, match=r"identity key .* move it away"):
        Identities.open(tmp_path, "r1")


def test_a_request_signature_covers_what_it_says_and_is_taken_once() -> None:
    ids, r1 = Identities(key("trainer")), key("r1")
    peer = "http://10.0.0.1:8700 10.0.0.1:6881 r1"
    q = [("node", "r1"), ("have", "3")]
    sig = r1.sign_request("GET", "/v1/chain/head", q, None, peer, "eu region", now=T0)
    got = ids.verify_request("GET", "/v1/chain/head", q, peer, "eu region", sig, "r1", "t",
                             now=T0 + 5)
    assert (got.node, got.key) == ("r1", r1.public)
    with pytest.raises(BadIdentity, match="replayed"):
        ids.verify_request("GET", "/v1/chain/head", q, peer, "eu region", sig, "r1", "t",
                           now=T0 + 6)
    for changed in ([("node", "r1"), ("have", "4")], q):
        sig = r1.sign_request("GET", "/v1/chain/head", q, None, peer, "eu region", now=T0)
        with pytest.raises(BadIdentity, match="does not verify"):
            ids.verify_request("GET", "/v1/chain/head", changed, peer, "ap region", sig, "r1",
                               "t", now=T0)
    sig = r1.sign_request("GET", "/v1/chain/head", q, None, peer, "", now=T0 - 1000)
    with pytest.raises(BadIdentity, match="clock"):
        ids.verify_request("GET", "/v1/chain/head", q, peer, "", sig, "r1", "t", now=T0)
    with pytest.raises(BadIdentity, match="must be"):
        ids.verify_request("GET", "/", [], peer, "", "garbage", "r1", "t", now=T0)
    body = b'{"artifact": "v00000001.delta"}'
    sig = r1.sign_request("POST", "/v1/swarm/complaints", [], body, peer, "", now=T0)
    got = ids.verify_request("POST", "/v1/swarm/complaints", [], peer, "", sig, "r1", "t",
                             now=T0)
    assert got.body_ok(body) and not got.body_ok(body + b" ")
    assert ids.bad_signatures == 5


def test_a_hello_identity_verifies_only_for_its_nonce_and_url() -> None:
    k = key("r1")
    doc = k.hello("ab" * 16, "http://10.0.0.1:8700")
    assert check_hello(doc, "ab" * 16, "http://10.0.0.1:8700") == ("r1", k.public)
    assert check_hello(doc, "cd" * 16, "http://10.0.0.1:8700") is None
    assert check_hello(doc, "ab" * 16, "http://10.0.0.2:8700") is None
    assert check_hello(doc | {"node": "r2"}, "ab" * 16, "http://10.0.0.1:8700") is None


def test_the_book_entry_of_a_peer_is_updated_only_by_its_own_key() -> None:
    book = PeerBook("http://10.0.0.9:8700", ("10.0.0.9", 6881), "me", [], 100)
    real, mallory = key("r1"), key("mallory")
    url = "http://10.0.0.1:8700"
    book.learn(url)
    book.learn_own(url, "r1", real.public, ("10.0.0.1", 6881))  # its own answer binds the key
    book.learn_signed(f"{url} 10.0.0.1:6882 r1", "eu region", "r1", real.public)
    p = book.peers[url]
    assert (p.bt, p.region, p.key_confirmed) == (("10.0.0.1", 6882), "eu", True)
    assert book.learn_signed(f"{url} 10.6.6.6:1 mallory", "x region", "mallory",
                             mallory.public) is None
    assert book.learn_signed(f"{url} 10.6.6.6:1 r1", "x region", "r1", mallory.public) is None
    book.learn(url, ("10.6.6.6", 1), "mallory", region="x", role="trainer")  # a hint
    book.learn_header(f"{url} 10.6.6.6:1 mallory", "x trainer")
    assert (p.bt, p.node, p.region, p.role) == (("10.0.0.1", 6882), "r1", "eu", "region")
    assert book.refused_headers == 2
    # a header may key a new entry provisionally; the URL's own answer overrides it
    other = "http://10.0.0.2:8700"
    book.learn_signed(f"{other} 10.6.6.6:2 mallory", "x region", "mallory", mallory.public)
    r2 = key("r2")
    book.learn_own(other, "r2", r2.public)
    q = book.peers[other]
    assert (q.key, q.bt, q.region, q.node) == (r2.public, None, None, "r2")


def test_deltaswarm_status_shows_the_key_and_the_last_refused_claim() -> None:
    import io

    from rich.console import Console

    from daemon.observe.status import NodeStatus
    from daemon.observe.status_cli import render

    ids = Identities(key("trainer"))
    ids.claim("r1", key("r1").public, "10.0.0.1", T0)
    ids.claim("r1", key("r1").public, "10.6.6.6", T0 + 1)
    out = io.StringIO()
    s = NodeStatus.model_validate({"node": "trainer", "identity": ids.status()})
    Console(file=out, width=250, color_system=None).print(render(s))
    line = next(x for x in out.getvalue().splitlines() if "identity" in x)
    assert ids.own.fingerprint in line and "1 refused name claims (last: r1 SHA256:" in line
    assert "from 10.6.6.6" in line
