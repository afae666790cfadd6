"""GET /v1/chain/head records who polls and what it holds (`node`, `region`, `have`): the input
of retention that knows who is behind. Only a poll signed by the named node's pinned key is
recorded (issue 20, finding 3); bad values answer 400 naming the parameter."""

from types import SimpleNamespace

from aiohttp.test_utils import TestClient, TestServer
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from daemon.app import build_app
from daemon.peering.identity import SIG_HEADER, Identities, NodeKey
from daemon.peering.peers import HEADER
from daemon.versions.live import LiveNodes
from daemon.versions.longpoll import Board


class Store:
    def head(self) -> int:
        return 4

    def artifacts(self) -> list[str]:
        return ["v00000004.delta"]


class Book:
    def learn_signed(self, *args: object) -> None:
        return None

    learn_header = learn_signed


def app_node(live: LiveNodes) -> SimpleNamespace:
    return SimpleNamespace(
        token="t", book=Book(), store=Store(), board=Board(), live=live,
        role=SimpleNamespace(syncer=None),  # the trainer's: it never applies
        long_poll_timeout_s=1.0, stopping=lambda: False, bt=lambda: "x:1", node="trainer",
        url="http://127.0.0.1:1", max_body_bytes=1 << 20,
        identity=Identities(NodeKey(Ed25519PrivateKey.generate(), "trainer")))


def signed(key: NodeKey, query: dict[str, str]) -> dict[str, str]:
    peer = f"http://10.0.0.9:8700 - {key.node}"
    return {"Authorization": "Bearer t", HEADER: peer,
            SIG_HEADER: key.sign_request("GET", "/v1/chain/head", list(query.items()), None,
                                         peer, "")}


async def test_a_head_poll_records_the_poller_and_refuses_bad_values() -> None:
    live = LiveNodes()
    node = app_node(live)
    r1, r2 = (NodeKey(Ed25519PrivateKey.generate(), n) for n in ("r1", "r2"))
    auth = {"Authorization": "Bearer t"}
    async with TestClient(TestServer(build_app(node))) as client:
        q = {"node": "r1", "region": "eu", "have": "3"}
        r = await client.get("/v1/chain/head", params=q, headers=signed(r1, q))
        assert r.status == 200 and (await r.json())["version"] == 4
        q = {"node": "r2", "have": ""}
        r = await client.get("/v1/chain/head", params=q, headers=signed(r2, q))
        assert r.status == 200
        doc = await r.json()  # the trainer's own count, relayed as such by those polling it
        assert doc["nodes"] == doc["trainer_nodes"] == 2
        bad = [await client.get(f"/v1/chain/head?{q}", headers=auth)
               for q in ("node=a/b", "node=r3&region=%20", "node=r3&have=-1", "node=r3&have=x")]
        errors = [(b.status, (await b.json())["error"]) for b in bad]
    assert sorted(live.versions(), key=str) == [3, None]
    assert [s for s, _ in errors] == [400] * 4
    assert "node or region" in errors[0][1] and "have" in errors[3][1]


async def test_a_poll_speaking_for_another_node_is_not_recorded() -> None:
    live = LiveNodes()
    node = app_node(live)
    real, mallory = (NodeKey(Ed25519PrivateKey.generate(), n) for n in ("r1", "mallory"))
    impostor = NodeKey(Ed25519PrivateKey.generate(), "r1")
    async with TestClient(TestServer(build_app(node))) as client:
        q = {"node": "r1", "have": "1"}
        first = signed(real, q)
        await client.get("/v1/chain/head", params=q, headers=first)
        now = {"node": "r1", "have": "2"}
        await client.get("/v1/chain/head", params=now, headers=signed(real, now))
        forged = {"node": "r1", "have": "4"}
        for headers in ({"Authorization": "Bearer t"},  # unsigned
                        signed(mallory, forged),  # signed, but by another node
                        signed(impostor, forged)):  # a second key claiming r1
            r = await client.get("/v1/chain/head", params=forged, headers=headers)
            assert r.status == 200  # the token still admits it: only the claim is ignored
        r = await client.get("/v1/chain/head", params=q, headers=first)  # a replay
        assert r.status == 200
        stale = first | {SIG_HEADER: real.sign_request(
            "GET", "/v1/chain/head", list(q.items()), None, first[HEADER], "",
            now=1_000_000.0)}
        await client.get("/v1/chain/head", params=q, headers=stale)
    assert live.held() == {"r1": 2}  # what the real node said last, nothing else
    ids = node.identity
    assert ids.refused_total == 1 and ids.refused[0]["node"] == "r1"
    assert ids.refused[0]["fingerprint"] == impostor.fingerprint
    assert ids.bad_signatures == 2 and "clock" in ids.last_bad  # the replay, the stale one
    assert live.unsigned == 5


async def test_a_complaint_must_be_signed_by_the_complaining_node() -> None:
    """Complaints (`POST /v1/swarm/complaints`) schedule a self-check: only a signed one, whose
    body is the one signed, is taken (issue 20: what a node says about itself is signed)."""
    asked: list[str] = []
    node = app_node(LiveNodes())
    node.complaint = lambda artifact: asked.append(artifact) or True
    r1 = NodeKey(Ed25519PrivateKey.generate(), "r1")
    body = b'{"artifact": "v00000004.delta", "reason": "hash_failed"}'
    peer = "http://10.0.0.9:8700 - r1"

    def headers(data: bytes) -> dict[str, str]:
        return {"Authorization": "Bearer t", HEADER: peer, "Content-Type": "application/json",
                SIG_HEADER: r1.sign_request("POST", "/v1/swarm/complaints", [], data, peer, "")}

    async with TestClient(TestServer(build_app(node))) as client:
        unsigned = await client.post("/v1/swarm/complaints", data=body,
                                     headers={"Authorization": "Bearer t"})
        swapped = await client.post("/v1/swarm/complaints", data=body.replace(b"04", b"05"),
                                    headers=headers(body))
        good = await client.post("/v1/swarm/complaints", data=body, headers=headers(body))
        assert unsigned.status == 403 and "must be signed" in (await unsigned.json())["error"]
        assert swapped.status == 400 and good.status == 200
    assert asked == ["v00000004.delta"]
