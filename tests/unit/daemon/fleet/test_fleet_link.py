"""The fleet's transport (daemon/fleet/link.py): byte counters per link class from libtorrent's
per-connection stats, peers classified by region and role, the hello check of a reporter's
name against a real aiohttp server, and the per-region metrics (no node names as labels)."""

import json
import threading
import time
from types import SimpleNamespace

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from daemon.fleet import link as fleet_link
from daemon.fleet.board import FleetBoard, NodeReport, sign_report
from daemon.fleet.link import Directory, FleetParts, LinkMeter, Verifier
from daemon.observe.metrics import render_fleet
from daemon.peering.identity import NodeKey
from daemon.peering.peer_client import PeerClient, hello_proof

TOKEN = "tok-12345"


def signed(r: NodeReport, now: float = 1e9) -> NodeReport:
    return sign_report(r, NodeKey(Ed25519PrivateKey.generate(), r.node), now)


def torrents(*peers: tuple[str, str, int, int]) -> dict:
    out: dict = {}
    for artifact, peer, up, down in peers:
        out.setdefault(artifact, {"peer_list": []})["peer_list"].append(
            {"peer": peer, "uploaded": up, "downloaded": down})
    return out


def test_the_meter_sums_connections_and_survives_reconnects_and_closed_ones() -> None:
    m = LinkMeter()
    m.sample(torrents(("v1", "10.0.0.1:5000", 10, 100), ("v2", "10.0.0.1:5001", 0, 50)))
    m.sample(torrents(("v1", "10.0.0.1:5000", 30, 400)))  # v2's connection closed: kept
    assert m.by_ip["10.0.0.1"] == [450, 30]
    m.sample(torrents(("v1", "10.0.0.1:5000", 5, 20)))  # counters fell: a new connection
    assert m.by_ip["10.0.0.1"] == [470, 35]
    m.sample(torrents(("v1", "[::1]:7000", 1, 2)))
    assert m.by_ip["::1"] == [2, 1]


def parts(role: str = "region", region: str = "east",
          at: dict[str, list[tuple[str | None, str | None, str | None]]] | None = None
          ) -> FleetParts:
    at = at or {}
    return FleetParts(node="me", region=region, role=role, url="http://10.0.0.9:8700",
                      board=FleetBoard("me"), verifier=Verifier(PeerClient(None, TOKEN)),
                      current=lambda: {"version": 4}, head=lambda: 5, torrents=dict,
                      peers_at=lambda ip: at.get(ip, []), waiting=lambda: 7)


def test_peers_are_classified_by_announced_region_reports_and_the_trainer_role() -> None:
    p = parts(at={"10.0.0.1": [("a", "east", None)], "10.0.0.2": [("b", None, None)],
                  "10.0.0.3": [("t", None, None)], "10.0.0.4": [(None, None, None)],
                  "10.0.0.5": [("c", None, None)], "10.0.0.7": [("t2", "east", "trainer")]})
    p.directory.learn("t", "home", "trainer")
    p.directory.learn("b", "west", "region")
    p.board.accept("c", "http://10.0.0.5:8700", [signed(NodeReport(
        node="c", region="east", role="region", url="http://10.0.0.5:8700"))], 1e9)
    got = {ip: p.classify(ip) for ip in ("10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4",
                                         "10.0.0.5", "10.0.0.6", "10.0.0.7")}
    assert got == {"10.0.0.1": "intra", "10.0.0.2": "cross", "10.0.0.3": "trainer",
                   "10.0.0.4": "unknown", "10.0.0.5": "intra", "10.0.0.6": "unknown",
                   "10.0.0.7": "trainer"}
    assert parts(role="trainer").classify("10.0.0.1") == "trainer"


def test_the_own_report_carries_version_links_and_trajectories_waiting() -> None:
    p = parts(at={"10.0.0.1": [("a", "west", "region")]})
    p.meter.sample(torrents(("v1", "10.0.0.1:1", 3, 900)))
    r = p.own_report()
    assert (r.version, r.head, r.trajectories_waiting) == (4, 5, 7)
    assert r.links["cross"] == {"bytes_in": 900, "bytes_out": 3}
    assert r.held_s is not None and r.held_s >= 0
    assert p.identity()["known"] == []
    assert parts(role="trainer").identity()["known"][0]["role"] == "trainer"


def test_the_directory_is_bounded_and_lists_trainers_only() -> None:
    d = Directory(limit=2)
    for n in ("t", "a", "b"):
        d.learn(n, "x", "trainer" if n == "t" else "region")
    assert set(d.nodes) == {"t", "a"} and [x["node"] for x in d.trainers()] == ["t"]


async def test_the_verifier_accepts_only_the_name_and_token_the_url_proves(monkeypatch) -> None:
    names = {"node": "r1"}
    asked: list[str] = []
    clock = [1000.0]
    monkeypatch.setattr(fleet_link, "time", SimpleNamespace(monotonic=lambda: clock[0],
                                                             time=time.time))

    async def healthz(request: web.Request) -> web.Response:
        asked.append(request.query["challenge"])
        url = str(request.url.origin())
        return web.json_response({"node": names["node"], "proof": hello_proof(
            TOKEN, request.query["challenge"], url)})

    app = web.Application()
    app.add_routes([web.get("/healthz", healthz)])
    async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as s:
        url = str(server.make_url("")).rstrip("/")
        v = Verifier(PeerClient(s, TOKEN))
        assert await v.check(url, "r1") is None
        assert "proved it is node r1" in (await v.check(url, "r2") or "")
        v.ok.clear()
        names["node"] = "other"
        assert "calls itself 'other'" in (await v.check(url, "r1") or "")
        before = len(asked)
        clock[0] += fleet_link.PROOF_RETRY_S - 0.1  # within the retry interval: not asked
        assert "calls itself" in (await v.check(url, "r1") or "")
        assert len(asked) == before, "asked again within PROOF_RETRY_S"
        names["node"] = "r1"  # it would prove itself now, but is not asked before its time
        assert "calls itself" in (await v.check(url, "r1") or "")
        clock[0] += 0.2
        assert await v.check(url, "r1") is None and len(asked) == before + 1
        wrong = Verifier(PeerClient(s, "another-token"))
        assert "did not prove it holds the swarm token" in (await wrong.check(url, "other")
                                                             or "")
        assert "cannot verify" in (await v.check("http://127.0.0.1:9", "x") or "")


async def test_the_verifier_checks_the_identity_key_the_url_signs_with() -> None:
    key = NodeKey(Ed25519PrivateKey.generate(), "r1")

    async def healthz(request: web.Request) -> web.Response:
        url = str(request.url.origin())
        nonce = request.query["challenge"]
        return web.json_response({"node": "r1", "proof": hello_proof(TOKEN, nonce, url),
                                  "identity": key.hello(nonce, url)})

    app = web.Application()
    app.add_routes([web.get("/healthz", healthz)])
    async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as s:
        url = str(server.make_url("")).rstrip("/")
        v = Verifier(PeerClient(s, TOKEN))
        other = NodeKey(Ed25519PrivateKey.generate(), "r1").public
        assert "did not prove it holds the identity key" in (await v.check(url, "r1", other)
                                                              or "")
        v.tried.clear()
        assert await v.check(url, "r1", key.public) is None
        assert "proved it holds key" in (await v.check(url, "r1", other) or "")


def test_fleet_metrics_are_labelled_by_region_never_by_node() -> None:
    board = FleetBoard("trainer")
    reps = [signed(NodeReport(node=f"n{i}", region=f"r{i % 3}", role="region", version=2,
                              url=f"http://10.0.1.{i}:8700")) for i in range(30)]
    board.accept("n0", reps[0].url, reps, 1e9)
    text = render_fleet(lambda: board.view(head=2, now=1e9))[0].decode()
    assert 'deltaswarm_fleet_nodes{region="r1"} 10.0' in text
    assert 'deltaswarm_fleet_nodes_at_head{region="r0"} 10.0' in text
    assert 'deltaswarm_fleet_link_bytes{direction="in",link_class="cross",region="r2"}' in text
    assert "n17" not in text


async def test_the_fleet_view_is_built_and_encoded_off_the_event_loop(monkeypatch) -> None:
    """Issue 20, finding 10: `GET /v1/fleet` built a 10k-node view on the event loop (/healthz
    up to 1.8 s). The view is built in a worker thread, cached, and served with or without
    node lists; status and /metrics read the cached one."""
    monkeypatch.setattr(fleet_link, "VIEW_CACHE_S", 60.0)  # a stall is no rebuild here
    threads: list[str] = []

    class Board(FleetBoard):
        def view(self, *a, **kw) -> dict:
            threads.append(threading.current_thread().name)
            return super().view(*a, **kw)

    p = parts()
    p.board = Board("me")
    p.key = NodeKey(Ed25519PrivateKey.generate(), "me")
    b = signed(NodeReport(node="b", region="west", role="region", url="http://10.0.0.2:1"),
               time.time())
    own = p.own_report()
    p.board.accept("me-gw", "http://10.0.0.3:1", [signed(own.model_copy(update={
        "node": "me-gw", "url": "http://10.0.0.3:1", "sig": None}), time.time()), b],
        time.time())
    full = json.loads(await p.view_json(True))
    slim = json.loads(await p.view_json(False))
    assert threads and all(t != threading.main_thread().name for t in threads)
    assert {n["node"] for n in full["regions"]["west"]["nodes"]} == {"b"}
    assert "nodes" not in slim["regions"]["west"] and slim["regions"]["west"]["node_count"] == 1
    assert p.own_report().sig is not None and p.own_report().sig.key == p.key.public
    built = len(threads)
    assert p.view()["nodes"] == full["nodes"] and len(threads) == built  # cached: no rebuild
