"""How fleet reports travel (daemon/fleet/board.py holds what they say): `Reporter` posts this
node's
report plus the fresh ones it holds to each upstream every `fleet.interval_s`; `Verifier` checks
that a reporter's URL answers a hello challenge with the node name it claims; `LinkMeter` turns
libtorrent's per-connection byte counters into bytes per link class.

Upstreams are `fleet.report_to`, by default the bootstrap URLs: the operator's config, the only
daemons the swarm token is sent to unasked (THREAT_MODEL.md). An upstream's reply names it
(node, region, role) and the trainers it knows, so a node learns which peers are the trainer
and which region each upstream is in without trusting anything unsigned for data.
"""

import asyncio
import contextlib
import hashlib
import json
import logging
import random
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from daemon.fleet.board import LINK_CLASSES, FleetBoard, Name, NodeReport, sign_report
from daemon.peering.identity import NodeKey, check_hello, fingerprint
from daemon.peering.peer_client import PeerClient, PeerError, hello_proof, json_object

log = logging.getLogger("deltaswarm.fleet")
SAMPLE_S = 1.0
"""How often libtorrent's per-peer counters are read (bytes of a connection that closes between
two samples are lost; at 1 s that is at most a second's worth per connection)."""
PROOF_TTL_S = 600.0
PROOF_RETRY_S = 5.0
SENT_KEEP_S = 120.0
"""How long a reporter remembers the digests of the reports it sent (for the receiver's
confirmation request, which follows at once)."""
MAX_METERED_IPS = 4096
VIEW_CACHE_S = 1.0
FLEET_REPLY_CAP = 1 << 20


class Identity(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    node: Name
    region: Name
    role: Literal["trainer", "region"]


class UpstreamReply(BaseModel):
    """What an upstream answers a report: who it is and the trainers it knows (checked here;
    a reply of another shape counts as a failed report)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    node: Name
    region: Name
    role: Literal["trainer", "region"]
    stored: int = 0
    refused: list[dict] = []
    known: list[Identity] = []


class Directory:
    """node name → (region, role), from reports received and upstream replies (bounded)."""

    def __init__(self, limit: int = 50_000) -> None:
        self.limit = limit
        self.nodes: dict[str, tuple[str, str]] = {}

    def learn(self, node: str, region: str, role: str) -> None:
        if node in self.nodes or len(self.nodes) < self.limit:
            self.nodes[node] = (region, role)

    def trainers(self) -> list[dict]:
        return [{"node": n, "region": r, "role": role}
                for n, (r, role) in self.nodes.items() if role == "trainer"][:16]


class LinkMeter:
    """Bytes per remote IP since start, summed over libtorrent connections: a connection's
    counters restart at 0, so a fall on the same (torrent, endpoint) starts a new connection."""

    def __init__(self) -> None:
        self.last: dict[tuple[str, str], tuple[int, int]] = {}
        self.by_ip: dict[str, list[int]] = {}
        """ip → [bytes in, bytes out]; past MAX_METERED_IPS new addresses share the key "?"."""

    def sample(self, torrents: dict) -> None:
        cur: dict[tuple[str, str], tuple[int, int]] = {}
        for artifact, t in torrents.items():
            for p in t.get("peer_list", ()):
                key = (artifact, p["peer"])
                up, down = int(p["uploaded"]), int(p["downloaded"])
                lu, ld = self.last.get(key, (0, 0))
                if up < lu or down < ld:
                    lu = ld = 0
                ip = p["peer"].rpartition(":")[0].strip("[]")
                if ip not in self.by_ip and len(self.by_ip) >= MAX_METERED_IPS:
                    ip = "?"
                acc = self.by_ip.setdefault(ip, [0, 0])
                acc[0] += down - ld
                acc[1] += up - lu
                cur[key] = (up, down)
        self.last = cur

    def links(self, classify: Callable[[str], str]) -> dict[str, dict[str, int]]:
        sums = {c: [0, 0] for c in LINK_CLASSES}
        for ip, (down, up) in self.by_ip.items():
            acc = sums[classify(ip) if ip != "?" else "unknown"]
            acc[0] += down
            acc[1] += up
        return {c: {"bytes_in": v[0], "bytes_out": v[1]} for c, v in sums.items()}


class Verifier:
    """Whether the daemon at a URL holds the swarm token and is the node and key it claims:
    `GET <url>/healthz?challenge=<nonce>` must answer the HMAC proof for that URL and `node`,
    and its identity key's signature over the nonce (daemon/peering/identity.py) with `key`.
    Successes are cached for PROOF_TTL_S; a URL is asked at most once per PROOF_RETRY_S."""

    def __init__(self, client: PeerClient) -> None:
        self.client = client
        self.ok: dict[str, tuple[str, str | None, float]] = {}
        self.tried: dict[str, tuple[float, str]] = {}

    async def check(self, url: str, node: str, key: str | None = None) -> str | None:
        """None when verified, else why not (our words)."""
        now = time.monotonic()
        hit = self.ok.get(url)
        if hit is not None and hit[2] > now:
            if hit[0] != node:
                return f"{url} proved it is node {hit[0]}, not {node}"
            if key is not None and hit[1] is None:
                return (f"{url} proved no identity key (an older daemon?), so it cannot speak "
                        f"for key {fingerprint(key)}: upgrade that node")
            if key is not None and hit[1] != key:
                return f"{url} proved it holds key {fingerprint(hit[1])}, not {fingerprint(key)}"
            return None
        last = self.tried.get(url)
        if last is not None and now - last[0] < PROOF_RETRY_S:
            return last[1]
        why, proved_key = await self._prove(url, node, key)
        if len(self.tried) > 50_000:
            self.tried.clear()
        if why is None:
            if len(self.ok) > 50_000:
                self.ok.clear()
            self.ok[url] = (node, proved_key, now + PROOF_TTL_S)
            self.tried.pop(url, None)
        else:
            self.tried[url] = (now, why)
        return why

    async def _prove(self, url: str, node: str, key: str | None
                     ) -> tuple[str | None, str | None]:
        nonce = secrets.token_hex(16)
        try:
            doc = await self.client.get_json(f"{url}/healthz", "hello", auth=False,
                                             timeout=5.0, params={"challenge": nonce})
        except PeerError as e:
            return f"cannot verify {url} (it must answer GET /healthz?challenge): {e}", None
        proof = doc.get("proof")
        if not (isinstance(proof, str) and secrets.compare_digest(
                proof.encode(), hello_proof(self.client.token, nonce, url).encode())):
            return f"{url} did not prove it holds the swarm token", None
        if doc.get("node") != node:
            return f"{url} calls itself {str(doc.get('node'))[:64]!r}, not {node!r}", None
        ident = check_hello(doc.get("identity"), nonce, url)
        if key is not None and (ident is None or ident != (node, key)):
            return (f"{url} did not prove it holds the identity key {fingerprint(key)} of "
                    f"{node}"), None
        return None, ident[1] if ident else None


def report_digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


@dataclass
class Upstream:
    url: str
    node: str | None = None
    region: str | None = None
    role: str | None = None
    last_ok: float | None = None
    last_error: str = ""
    refused: int = 0
    sent: int = 0


@dataclass
class Reporter:
    """Sends this node's report (and what it forwards) upstream every `interval_s`."""

    board: FleetBoard
    client: PeerClient
    directory: Directory
    own: Callable[[], NodeReport]
    upstreams: Callable[[], list[str]]
    interval_s: float
    tick: Callable[[], None] = lambda: None
    state: dict[str, Upstream] = field(default_factory=dict)
    sent: dict[str, float] = field(default_factory=dict)
    """sha256 of each report body sent recently → monotonic time, for daemons from before
    identities, which confirm a report with `GET /v1/fleet/sent/<digest>`."""

    def did_send(self, digest: str) -> bool:
        return self.sent.get(digest, -1e18) > time.monotonic() - SENT_KEEP_S

    async def run(self) -> None:
        due = time.monotonic() + min(2.0, self.interval_s) * random.uniform(0.5, 1.0)
        while True:
            self.tick()
            if time.monotonic() >= due:
                await self.report_once()
                due = time.monotonic() + self.interval_s * random.uniform(0.9, 1.1)
            await asyncio.sleep(SAMPLE_S)

    async def report_once(self) -> None:
        urls = self.upstreams()
        self.state = {u: self.state.get(u) or Upstream(u) for u in urls}
        if urls:
            own = self.own()
            await asyncio.gather(*(self._send(self.state[u], own) for u in urls))

    async def _send(self, up: Upstream, own: NodeReport) -> None:
        fwd = self.board.forwardable(time.time(), up.node)
        body = json.dumps({"reports": [own.model_dump(mode="json"), *fwd]},
                          separators=(",", ":")).encode()
        now = time.monotonic()
        if len(self.sent) > 1024:
            self.sent = {d: t for d, t in self.sent.items() if t > now - SENT_KEEP_S}
        self.sent[report_digest(body)] = now
        try:
            reply = await self.client.request(
                "POST", f"{up.url}/v1/fleet/report", "fleet", auth=True,
                timeout=min(30.0, max(5.0, self.interval_s)), data=body,
                headers={"Content-Type": "application/json"}, cap=FLEET_REPLY_CAP)
            doc = UpstreamReply.model_validate(json_object(reply.body, up.url, "fleet reply"))
        except (PeerError, ValidationError) as e:
            up.last_error = f"{type(e).__name__}: {e}"[:200] if isinstance(e, PeerError) \
                else "fleet reply of the wrong shape"
            log.debug("fleet report to %s failed: %s", up.url, up.last_error)
            return
        up.node, up.region, up.role = doc.node, doc.region, doc.role
        up.last_ok, up.last_error, up.sent = time.time(), "", up.sent + 1 + len(fwd)
        up.refused += len(doc.refused)
        self.directory.learn(doc.node, doc.region, doc.role)
        for ident in doc.known[:16]:
            self.directory.learn(ident.node, ident.region, ident.role)

    def status(self) -> list[dict]:
        return [{"url": u.url, "node": u.node, "last_ok": u.last_ok,
                 "last_error": u.last_error or None, "entries_sent": u.sent,
                 "entries_refused": u.refused} for u in self.state.values()]


@dataclass
class FleetParts:
    """The fleet side of one daemon, given what it reads (never the node): its identity, the
    current version, the verified head, the swarm's per-peer counters, the peer book's
    (ip → node, region) and the spool depth."""

    node: str
    region: str
    role: str
    url: str
    board: FleetBoard
    verifier: Verifier
    current: Callable[[], dict | None]
    head: Callable[[], int | None]
    torrents: Callable[[], dict]
    peers_at: Callable[[str], list[tuple[str | None, str | None, str | None]]]
    """ip → [(node name, region, role announced)] of the book's peers at that address."""
    waiting: Callable[[], int]
    directory: Directory = field(default_factory=Directory)
    meter: LinkMeter = field(default_factory=LinkMeter)
    reporter: Reporter | None = None
    key: NodeKey | None = None
    """This node's identity key: signs its own entry."""
    _held: tuple[int | None, float] = (None, 0.0)
    _view: tuple[float, dict] | None = None
    _json: dict[bool, tuple[float, bytes]] = field(default_factory=dict)
    _building: asyncio.Lock = field(default_factory=asyncio.Lock)
    _task: asyncio.Task | None = None

    def tick(self) -> None:
        """Once a second: sample the byte counters, note a new head, note a new version."""
        now = time.time()
        self.meter.sample(self.torrents())
        self.board.note_head(self.head(), now)
        cur = self.current()
        version = cur["version"] if cur else None
        if version != self._held[0]:
            self._held = (version, now)

    def classify(self, ip: str) -> str:
        if self.role == "trainer":
            return "trainer"
        regions = set()
        for name, region, role in self.peers_at(ip):
            known = self.directory.nodes.get(name or "")
            entry = self.board.entries.get(name or "")
            if role == "trainer" or (known and known[1] == "trainer") or (
                    entry and entry.report.role == "trainer"):
                return "trainer"
            region = region or (known[0] if known else None) or (
                entry.report.region if entry else None)
            if region:
                regions.add(region)
        if not regions:
            return "unknown"
        return "intra" if regions == {self.region} else "cross"

    def own_report(self) -> NodeReport:
        """This node's entry, signed by its identity key (relays forward it unchanged)."""
        self.tick()
        version, since = self._held
        r = NodeReport(node=self.node, region=self.region, role=self.role, url=self.url,
                       version=version, held_s=None if version is None else
                       max(0.0, time.time() - since), head=self.head(),
                       links=self.meter.links(self.classify),
                       trajectories_waiting=self.waiting())
        if self.key is None:
            return r
        return sign_report(r, self.key)

    def identity(self) -> dict:
        """What a report's reply says about this daemon (and the trainers it knows)."""
        known = self.directory.trainers()
        if self.role == "trainer":
            known = [{"node": self.node, "region": self.region, "role": self.role}, *known]
        return {"node": self.node, "region": self.region, "role": self.role, "known": known}

    def view(self) -> dict:
        """The fleet view as last built, for status and /metrics (on the event loop). A board of
        a few hundred nodes is rebuilt here when the view is older than VIEW_CACHE_S; a larger
        one is rebuilt in a worker thread (`refresh`, started here when stale) and meanwhile
        the last view is served, so the loop never builds a 10k-node view but the first."""
        now = time.time()
        if self._view is None or (len(self.board.entries) < 500
                                  and now - self._view[0] >= VIEW_CACHE_S):
            self._view = self._build(self.board.snapshot(self.head(), now), self.own_report(),
                                     now)
            self._json.clear()
        elif now - self._view[0] >= VIEW_CACHE_S and (self._task is None or self._task.done()):
            # no running loop (plain code, a test): serve the last view
            with contextlib.suppress(RuntimeError):
                self._task = asyncio.get_running_loop().create_task(self.refresh())
        return self._view[1]

    def _build(self, board: FleetBoard, me: NodeReport, now: float) -> tuple[float, dict]:
        interval = self.reporter.interval_s if self.reporter else 10.0
        out = board.view(self.head(), now, me, 3 * interval)
        out["upstreams"] = self.reporter.status() if self.reporter else []
        return now, out

    async def refresh(self) -> dict:
        """Rebuild the view in a worker thread when older than VIEW_CACHE_S (at 10k nodes one
        build is ~0.5 s: off the loop, /healthz and long-polls keep answering)."""
        async with self._building:
            now = time.time()
            if self._view is None or now - self._view[0] >= VIEW_CACHE_S:
                snap = self.board.snapshot(self.head(), now)
                self._view = await asyncio.to_thread(self._build, snap, self.own_report(), now)
                self._json.clear()
            return self._view[1]

    async def view_json(self, nodes: bool) -> bytes:
        """`GET /v1/fleet`'s body: the view encoded in a worker thread, cached with it;
        `nodes=False` leaves out each region's node list."""
        view = await self.refresh()
        at = self._view[0] if self._view else 0.0
        hit = self._json.get(nodes)
        if hit is None or hit[0] != at:
            hit = (at, await asyncio.to_thread(encode_view, view, nodes))
            self._json[nodes] = hit
        return hit[1]


def encode_view(view: dict, nodes: bool) -> bytes:
    if not nodes:
        view = view | {"regions": {name: {k: v for k, v in reg.items() if k != "nodes"}
                                   for name, reg in view["regions"].items()},
                       "node_lists": False}
    return json.dumps(view, separators=(",", ":")).encode()
