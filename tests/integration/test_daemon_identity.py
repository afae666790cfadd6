"""Node identity with real daemons (issue 20, findings 3 and 10): a token holder ("mallory", a
real aiohttp server on its own loopback address that holds the swarm token and its own identity
key, and answers the hello challenge as itself) tries to speak for the trainer's region node r1
and to flood the fleet board. Each attack is sent the way it worked before identities (unsigned)
and the way it would be tried now (signed with mallory's own key, or a second key claiming r1).

- a head long-poll `?node=r1&have=…` does not change what the trainer believes r1 holds;
- `X-Deltaswarm-Peer` / `X-Deltaswarm-Region` naming the trainer (on r1) or r1 (on the trainer)
  do not rewrite those peers' book entries;
- a forwarded fleet entry for r1 does not overwrite r1's row; a second key claiming r1 is refused
  and shown in the trainer's status (`identity.refused`);
- one reporter's flood of invented nodes does not lock a real node out of a full board, and a
  large report from a sender that cannot be verified is refused before it is parsed.
"""

import asyncio
import json
import secrets
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from daemon.peering.identity import NodeKey
from daemon.peering.peer_client import PeerClient, PeerHttpError, hello_proof
from tests.integration.harness import TOKEN, Cluster, http, step, tiny_model
from tests.support import wait_until

FLEET = {"interval_s": 1, "forget_s": 60}
EVIL_BT = "127.0.0.250:6999"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root: Path = tmp_path_factory.mktemp("identity")
    with Cluster(root) as c:
        c.trainer(fleet=FLEET | {"max_nodes": 30})
        c.region("r1", region="east", fleet=FLEET | {"interval_s": 10})
        c.region("r2", region="west", fleet=FLEET)  # started late, by the flood test
        c.daemons["trainer"].start()
        c.daemons["r1"].start()
        c.daemons["trainer"].wait_ready()
        c.daemons["r1"].wait_ready()
        state = tiny_model(0)
        c.publish(0, state)
        c.publish(1, step(state, 1))
        c.wait_all_at(1, 90, names=["r1"])
        yield c


class Mallory:
    """A token holder with its own identity key, serving the hello challenge as itself (and, for
    daemons before identities, confirming any fleet report digest)."""

    def __init__(self, host: str = "127.0.0.250") -> None:
        node = f"mallory-{secrets.token_hex(4)}"  # a new key each time: a name of its own
        self.key = NodeKey(Ed25519PrivateKey.generate(), node)
        self.node, self.host = node, host
        self.url = ""
        self.runner: web.AppRunner | None = None

    async def __aenter__(self) -> "Mallory":
        async def healthz(request: web.Request) -> web.Response:
            nonce = request.query.get("challenge", "")
            return web.json_response({"ok": True, "node": self.node, "url": self.url,
                                      "proof": hello_proof(TOKEN, nonce, self.url),
                                      "identity": self.key.hello(nonce, self.url)})

        async def sent(request: web.Request) -> web.Response:
            return web.json_response({"sent": True})

        app = web.Application()
        app.add_routes([web.get("/healthz", healthz), web.get("/v1/fleet/sent/{d}", sent)])
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://{self.host}:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    def client(self, session: aiohttp.ClientSession, peer: str | None = None,
               region: str = "mallory-land region", key: NodeKey | None = None) -> PeerClient:
        """A client announcing `peer` (default: mallory itself), signing with `key` (None:
        unsigned, as before identities)."""
        announce = {"X-Deltaswarm-Peer": peer or f"{self.url} {EVIL_BT} {self.node}",
                    "X-Deltaswarm-Region": region}
        c = PeerClient(session, TOKEN, lambda: announce)
        c.signer = key
        return c

    def entry(self, node: str, url: str, key: NodeKey | None, **kw: object) -> dict:
        doc = {"node": node, "region": "mallory-land", "role": "trainer", "url": url,
               "version": 4242, "head": 4242, "held_s": 1.0, "age_s": 0.0, "hops": 0,
               "links": {"cross": {"bytes_in": 7 << 40, "bytes_out": 7 << 40}},
               "trajectories_waiting": 999_999} | kw
        return key.sign_entry(doc) if key is not None else doc

    async def report(self, target: str, entries: list[dict], signed: bool) -> tuple[int, dict]:
        own = self.entry(self.node, self.url, self.key if signed else None, version=1)
        body = json.dumps({"reports": [own, *entries]}).encode()
        async with aiohttp.ClientSession() as s:
            c = self.client(s, key=self.key if signed else None)
            try:
                r = await c.request("POST", f"{target}/v1/fleet/report", "ack", auth=True,
                                    timeout=60, data=body,
                                    headers={"Content-Type": "application/json"})
            except PeerHttpError as e:
                return e.status, json.loads(e.body or b"{}")
            return r.status, json.loads(r.body)


def fleet_rows(c: Cluster) -> dict[str, dict]:
    view = c.daemons["trainer"].get("/v1/fleet")
    return {n["node"]: n | {"region_name": region}
            for region, r in view["regions"].items() for n in r["nodes"]}


def book_entry(d, url: str) -> dict:
    return next(p for p in d.status()["detail"]["peer_book"] if p["url"] == url)


def test_a_head_poll_naming_another_node_does_not_change_what_it_holds(cluster: Cluster) -> None:
    trainer, r1 = cluster.daemons["trainer"], cluster.daemons["r1"]

    def r1_have() -> int | None:
        rows = {n["node"]: n for n in trainer.status()["retention"]["nodes"]}
        return rows["r1"]["have"] if "r1" in rows else -1

    wait_until(lambda: r1_have() == 1, 30, "the trainer to see r1's polls at v1")
    forged = {"node": "r1", "region": "east", "have": "0", "timeout": "0"}
    impostor = NodeKey(Ed25519PrivateKey.generate(), "r1")

    async def attack() -> None:
        async with Mallory() as m, aiohttp.ClientSession() as s:
            for client in (m.client(s, f"{r1.url} {EVIL_BT} r1"),  # unsigned, as r1
                           m.client(s, key=m.key),  # signed by mallory, naming r1
                           m.client(s, f"{r1.url} {EVIL_BT} r1", key=impostor)):  # r1's name
                await client.get_json(f"{trainer.url}/v1/chain/head", "head", params=forged)

    asyncio.run(attack())
    assert r1_have() == 1
    ident = trainer.status()["identity"]
    refused = [x for x in ident["refused"] if x["node"] == "r1"]
    assert refused and refused[-1]["fingerprint"] == impostor.fingerprint
    assert ident["unsigned_polls"] >= 3 and ident["fingerprint"].startswith("SHA256:")
    _, text, _ = http(f"{trainer.url}/metrics")
    assert b"deltaswarm_identity_refused_claims_total" in text


def test_peer_headers_update_only_the_senders_own_entry(cluster: Cluster) -> None:
    trainer, r1 = cluster.daemons["trainer"], cluster.daemons["r1"]
    wait_until(lambda: book_entry(trainer, r1.url)["proven"]
               and book_entry(trainer, r1.url)["key_confirmed"], 30,
               "the trainer to prove r1 and bind its key")
    before = {d.name: book_entry(d, u) for d, u in ((r1, trainer.url), (trainer, r1.url))}
    impostor = NodeKey(Ed25519PrivateKey.generate(), "trainer")

    async def attack() -> None:
        async with Mallory() as m, aiohttp.ClientSession() as s:
            for target, victim, name in ((r1, trainer, "trainer"), (trainer, r1, "r1")):
                header = f"{victim.url} {EVIL_BT} {name}"
                for client in (m.client(s, header),  # unsigned
                               m.client(s, f"{victim.url} {EVIL_BT} {m.node}", key=m.key),
                               m.client(s, header, key=impostor)):
                    await client.get_json(f"{target.url}/v1/chain/index", "index")

    asyncio.run(attack())
    for d, url in ((r1, trainer.url), (trainer, r1.url)):
        after = book_entry(d, url)
        for k in ("bt", "node", "region", "role", "key"):
            assert after.get(k) == before[d.name].get(k), (d.name, k, after.get(k))
        assert after["bt"] != EVIL_BT and after["region"] != "mallory-land"
    assert r1.status()["identity"]["refused_headers"] >= 1


def test_a_relay_cannot_forge_a_fleet_entry_for_a_real_node(cluster: Cluster) -> None:
    trainer, r1 = cluster.daemons["trainer"], cluster.daemons["r1"]
    wait_until(lambda: fleet_rows(cluster).get("r1", {}).get("version") == 1, 30,
               "r1's row at v1")
    impostor = NodeKey(Ed25519PrivateKey.generate(), "r1")

    rows: list[dict] = []

    async def attack() -> list[tuple[int, dict]]:
        replies = []
        async with Mallory() as m:
            for key, signed in ((None, False), (m.key, True), (impostor, True)):
                entry = m.entry("r1", r1.url, key, hops=1)
                replies.append(await m.report(trainer.url, [entry], signed))
                for _ in range(8):  # the view is cached for 1 s; r1 reports every 10 s
                    await asyncio.sleep(0.3)
                    rows.append((await asyncio.to_thread(fleet_rows, cluster))["r1"])
        return replies

    replies = asyncio.run(attack())
    for row in [*rows, fleet_rows(cluster)["r1"]]:  # right after each try, and now
        assert (row["version"], row["region_name"], row["role"]) == (1, "east", "region")
        assert row["trajectories_waiting"] < 999_999
    unsigned, foreign, second_key = replies
    assert unsigned[0] in (400, 403)
    assert foreign[0] == 200 and foreign[1]["refused"][0]["node"] == "r1"
    assert second_key[0] == 200 and "cannot forge" in second_key[1]["refused"][0]["error"]
    assert any(x["node"] == "r1" and x["fingerprint"] == impostor.fingerprint
               for x in trainer.status()["identity"]["refused"])


def test_a_flood_of_invented_nodes_does_not_lock_out_a_real_node(cluster: Cluster) -> None:
    trainer = cluster.daemons["trainer"]

    async def flood() -> list[tuple[int, dict]]:
        async with Mallory() as m:
            unsigned = [m.entry(f"ghost{i}", f"http://10.66.0.{i % 250 + 1}:{8000 + i}", None,
                                hops=1) for i in range(60)]
            signed = [m.entry(f"ghost{i}", f"http://10.66.0.{i % 250 + 1}:{8000 + i}",
                              NodeKey(Ed25519PrivateKey.generate(), f"ghost{i}"), hops=1)
                      for i in range(60)]
            return [await m.report(trainer.url, unsigned, False),
                    await m.report(trainer.url, signed, True)]

    unsigned, signed = asyncio.run(flood())
    assert unsigned[0] in (400, 403), unsigned
    assert signed[0] == 200 and signed[1]["stored"] >= 1, signed
    # the premise: the flood filled the board (max_nodes=30), so r2 must displace a ghost
    # (the fleet view is cached for 1 s: the previous test's read may still be served)
    wait_until(lambda: len(rows := fleet_rows(cluster)) >= 30
               and any(n.startswith("ghost") for n in rows), 10, "the flood to fill the board")
    rows = fleet_rows(cluster)
    assert sum(n.startswith("ghost") for n in rows) <= 30
    r2 = cluster.daemons["r2"]
    r2.start()
    r2.wait_ready()
    wait_until(lambda: "r2" in fleet_rows(cluster), 30, "r2 to show on the full board")
    fleet = trainer.get("/v1/fleet?nodes=0")
    assert "nodes" not in fleet["regions"]["west"] and fleet["nodes"] <= 31


def test_a_large_report_from_an_unverified_sender_is_refused_before_parsing(
        cluster: Cluster) -> None:
    trainer, r1 = cluster.daemons["trainer"], cluster.daemons["r1"]
    body = b'{"reports": [' + b"x" * (15 << 20) + b"]}"  # not even JSON
    code, reply, _ = post_report(trainer.url, body, f"{r1.url} - r1")
    assert code == 403 and b"must be signed" in reply


def post_report(url: str, body: bytes, announce: str) -> tuple[int, bytes, dict]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        f"{url}/v1/fleet/report", data=body, method="POST",
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json",
                 "X-Deltaswarm-Peer": announce})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)
