"""The daemon's control plane (aiohttp): chain head long-poll, manifests, torrents, index, weights,
trajectories, publish, peers, status, metrics, health.

Every route but /healthz, /metrics and /ui (the static fleet page, daemon/observe/ui.py) needs
`Authorization: Bearer <token>` (see THREAT_MODEL.md).
Requests from other daemons carry `X-Deltaswarm-Peer`, which is how the mesh learns about them.
All inputs are validated here; errors are JSON `{"error": "..."}` with a 4xx status.
"""

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

from chain.auth import bearer_matches
from chain.errors import BadManifest
from chain.manifest import parse_artifact
from chain.store import ChainStore
from daemon.bittorrent.artifacts import Artifacts
from daemon.fleet.board import REPORT_MAX_BYTES, BadReport, Report, parse_report
from daemon.fleet.link import FleetParts
from daemon.observe.metrics import render_fleet
from daemon.observe.ui import fleet_page
from daemon.peering.identity import SIG_HEADER, BadIdentity, Identities, Signed, check_entry
from daemon.peering.peer_client import hello_proof
from daemon.peering.peers import (
    HEADER,
    REGION_HEADER,
    BadPeer,
    BookFull,
    PeerBook,
    check_node,
    check_url,
    parse_endpoint,
    parse_header,
    parse_region,
)
from daemon.trajectories.intake import Intake
from daemon.trajectories.spool import BadTrajectory, Spool, SpoolFull, SpoolWriteError, parse_batch
from daemon.versions.live import LiveNodes
from daemon.versions.longpoll import Board
from daemon.versions.publish import PublishError

log = logging.getLogger("deltaswarm.http")
_CHALLENGE = re.compile(r"^[0-9a-f]{32}$")
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


class RoleView(Protocol):
    name: str

    def current(self) -> dict | None: ...
    async def publish(self, version: int) -> dict: ...


@dataclass
class Parts:
    """What the routes use (the node's parts, not the node). `token` and `book` are what the
    auth middleware reads; `token` changes on reload."""

    node: str
    url: str
    token: str
    bt: Callable[[], str]
    long_poll_timeout_s: float
    max_body_bytes: int
    store: ChainStore
    book: PeerBook
    board: Board
    artifacts: Artifacts
    role: RoleView
    intake: Intake
    status: Callable[[], dict]
    metrics: Callable[[], tuple[bytes, str]]
    stopping: Callable[[], bool]
    fleet: FleetParts | None = None
    complaint: Callable[[str], bool] = lambda artifact: False
    """A peer says we sent it bad data for an artifact: re-check it (rate-limited there)."""
    live: LiveNodes | None = None
    """Where the `node`/`region`/`have` of head long-polls are recorded (retention's input)."""
    identity: Identities | None = None
    """This node's key and pins: who signed a request (daemon/peering/identity.py)."""
    engine_check: Callable[[], Awaitable[dict]] | None = None
    """POST /v1/engine/check: read the engine's live weights back in full now."""


NODE: web.AppKey[Parts] = web.AppKey("node")
OPEN_ROUTES = frozenset({"/healthz", "/metrics", "/ui"})


def fail(status: int, message: str, **headers: str) -> web.HTTPException:
    cls = {400: web.HTTPBadRequest, 401: web.HTTPUnauthorized, 404: web.HTTPNotFound,
           409: web.HTTPConflict, 429: web.HTTPTooManyRequests, 503: web.HTTPServiceUnavailable,
           }.get(status, web.HTTPBadRequest)
    return cls(text=json.dumps({"error": message}), content_type="application/json",
               headers=headers or None)


def int_param(request: web.Request, name: str, default: int | None, lo: int, hi: int) -> int | None:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise fail(400, f"query parameter {name}={raw!r:.40} is not an integer") from None
    if not lo <= value <= hi:
        raise fail(400, f"query parameter {name}={value} is outside [{lo}, {hi}]")
    return value


def timeout_param(request: web.Request, ceiling: float) -> float:
    raw = request.query.get("timeout")
    if raw is None:
        return ceiling
    try:
        value = float(raw)
    except ValueError:
        raise fail(400, f"query parameter timeout={raw!r:.40} is not a number") from None
    if not 0 <= value <= 3600:
        raise fail(400, f"timeout={value} is outside [0, 3600] seconds")
    return min(value, ceiling)


def artifact_param(request: web.Request) -> str:
    name = request.match_info["artifact"]
    try:
        parse_artifact(name)
    except BadManifest as e:
        raise fail(400, str(e)) from None
    return name


@web.middleware
async def auth(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
               ) -> web.StreamResponse:
    node = request.app[NODE]
    if request.path not in OPEN_ROUTES:
        if not bearer_matches(request.headers.get("Authorization"), node.token):
            raise web.HTTPUnauthorized(
                text=json.dumps({"error": "missing or wrong bearer token (Authorization: Bearer "
                                          "<token> from the swarm config)"}),
                content_type="application/json", headers={"WWW-Authenticate": "Bearer"})
        signer(request, node)
        announce = request.headers.get(HEADER)
        ident = request.get(IDENTITY)
        try:
            if announce and ident is not None:
                node.book.learn_signed(announce, request.headers.get(REGION_HEADER),
                                       ident.node, ident.key)
            elif announce:  # unsigned: not believed, but a malformed one is still a 400
                parse_header(announce)
        except BadPeer as e:
            raise fail(400, str(e)) from None
    return await handler(request)


IDENTITY: web.RequestKey[Signed | None] = web.RequestKey("identity")
"""request[IDENTITY]: the verified `Signed` sender, or None (unsigned or refused)."""
IDENTITY_ERROR: web.RequestKey[str] = web.RequestKey("identity_error", str)


def signer(request: web.Request, node: Parts) -> None:
    """Who signed this request (daemon/peering/identity.py): request[IDENTITY] is the verified
    signer,
    else None with request[IDENTITY_ERROR] saying why. An unsigned or refused request still
    gets what the token admits; only what it says about its sender is not believed."""
    request[IDENTITY], request[IDENTITY_ERROR] = None, "the request is not signed"
    value = request.headers.get(SIG_HEADER)
    ids = getattr(node, "identity", None)  # a test's partial Parts may have none
    if not value or ids is None:
        return
    announce = request.headers.get(HEADER, "")
    try:
        name = parse_header(announce)[2] if announce else None
    except BadPeer as e:
        raise fail(400, str(e)) from None
    if name is None:
        request[IDENTITY_ERROR] = f"a signed request must name its node in {HEADER}"
        return
    try:
        request[IDENTITY] = ids.verify_request(
            request.method, request.path, list(request.query.items()), announce,
            request.headers.get(REGION_HEADER, ""), value, name,
            source=str(request.remote or "?"))
    except BadIdentity as e:
        request[IDENTITY_ERROR] = str(e)


def signed_by(request: web.Request, what: str) -> Signed:
    """The verified signer, else 403 saying why `what` needs one."""
    ident = request.get(IDENTITY)
    if ident is None:
        raise web.HTTPForbidden(
            text=json.dumps({"error": f"{what} must be signed by its node's identity key "
                                      f"({SIG_HEADER}): {request.get(IDENTITY_ERROR)}"}),
            content_type="application/json")
    return ident


async def healthz(request: web.Request) -> web.Response:
    """Liveness; with `?challenge=<32 hex>` also this daemon's proof that it holds the swarm
    token (HMAC of the challenge and its own URL, see daemon/peering/peer_client.py), so peers can
    trust
    it without sending it the token first."""
    node = request.app[NODE]
    doc: dict[str, Any] = {"ok": True, "node": node.node, "role": node.role.name}
    challenge = request.query.get("challenge")
    if challenge is not None:
        if not _CHALLENGE.match(challenge):
            raise fail(400, "challenge must be 32 lowercase hex digits")
        doc["url"] = node.url
        doc["proof"] = hello_proof(node.token, challenge, node.url)
        ids = getattr(node, "identity", None)
        if ids is not None:
            doc["identity"] = ids.own.hello(challenge, node.url)
    return web.json_response(doc)


async def metrics(request: web.Request) -> web.Response:
    """This node's series; a scrape with the token also gets the fleet's per-region series."""
    node = request.app[NODE]
    body, content_type = node.metrics()
    if node.fleet is not None and bearer_matches(request.headers.get("Authorization"),
                                                 node.token):
        body += render_fleet(node.fleet.view)[0]
    return web.Response(body=body, headers={"Content-Type": content_type})


async def status(request: web.Request) -> web.Response:
    return web.json_response(request.app[NODE].status())


def head_doc(node: Parts) -> dict[str, Any]:
    head = node.store.head()
    arts = [a for a in node.store.artifacts() if head is not None and parse_artifact(a)[0] == head]
    ids = getattr(node, "identity", None)
    book = getattr(node, "book", None)
    nodes = live_nodes(node)
    syncer = getattr(node.role, "syncer", None)
    return {"version": head, "artifacts": arts, "bt": node.bt(), "node": node.node,
            "url": node.url, "key": ids.own.public if ids is not None else None,
            "region": getattr(book, "region", None), "role": getattr(book, "role", None),
            "nodes": nodes,
            # the trainer's count as this daemon believes it (its own on the trainer), relayed
            # so the nodes hearing the trainer through this one pace their asks of it from
            # their first poll (Syncer.trainer_fleet, glance_s)
            "trainer_nodes": nodes if syncer is None else syncer.trainer_fleet()}


def live_nodes(node: Parts) -> int:
    """How many nodes this daemon knows to be live: those polling it and those its fleet board
    heard from (through gateways) within `retention.live_within_s`. The trainer's count tells
    nodes that hear it through others how seldom to ask it themselves (Syncer.glance_s), so
    those asks stay about constant per second up to that pacing's cap."""
    live = getattr(node, "live", None)
    if live is None:
        return 0
    now = time.time()
    names = set(live.held(now))
    fleet = getattr(node, "fleet", None)
    if fleet is not None:
        names.update(e.report.node for e in fleet.board.live(now, live.within_s))
    return len(names)


def record_poller(request: web.Request, node: Parts) -> None:
    """A polling node's `node`, `region` and `have` (its current version; empty: none yet),
    believed only when the request is signed by that node's pinned key: retention keeps what
    live nodes need, so a token holder speaking for another node could make it drop data."""
    name = request.query.get("node")
    if name is None or node.live is None:
        return
    region = request.query.get("region") or None
    try:
        check_node(name)
        if region is not None:
            check_node(region)
    except BadPeer as e:
        raise fail(400, f"query parameter node or region: {e}") from None
    have = int_param(request, "have", None, 0, 2**62)
    ident = request.get(IDENTITY)
    if ident is None or ident.node != name:
        node.live.unsigned += 1
        return
    node.live.seen(name, region, have)


async def chain_head(request: web.Request) -> web.Response:
    node = request.app[NODE]
    after = int_param(request, "after", None, -1, 2**62)
    timeout = timeout_param(request, node.long_poll_timeout_s)
    record_poller(request, node)
    if after is not None:
        await node.board.wait(lambda: (node.store.head() if node.store.head() is not None
                                       else -1) > after or node.stopping(), timeout)
    return web.json_response(head_doc(node))


async def chain_index(request: web.Request) -> web.Response:
    """Artifacts, head, and the peers other daemons may learn: trusted ones only (bootstrap or
    proven, not banned), so an announcement that never proved itself does not spread.
    `?peers=0` leaves the peer list out (a sync step re-reading who holds what needs none of
    it); otherwise at most INDEX_PEERS of them (a list of every node would grow every reply
    with the fleet): the anchors of the asker's region (its X-Deltaswarm-Region header, a hint
    that only orders the list) first, see PeerBook.listing."""
    node = request.app[NODE]
    asker = None
    with contextlib.suppress(BadPeer):
        asker = parse_region(request.headers.get(REGION_HEADER, ""))[0]
    return web.json_response({
        "artifacts": node.store.artifacts(), "head": node.store.head(),
        "bt": node.bt(), "node": node.node, "url": node.url,
        "seeding": sorted(node.artifacts.seeding()), "held": node.artifacts.held(),
        "region": node.book.region, "role": node.book.role,
        "peers": [] if request.query.get("peers") == "0" else node.book.listing(asker)})


async def chain_manifest(request: web.Request) -> web.Response:
    node = request.app[NODE]
    name = artifact_param(request)
    try:
        raw = node.store.manifest_bytes(name)
    except BadManifest as e:
        raise fail(404, str(e)) from None
    return web.Response(body=raw, content_type="application/json")


async def chain_torrent(request: web.Request) -> web.Response:
    node = request.app[NODE]
    name = artifact_param(request)
    path = node.artifacts.torrent_path(name)
    if not path.is_file():
        raise fail(404, f"no torrent for {name} on {node.node}")
    return web.Response(body=path.read_bytes(), content_type="application/x-bittorrent")


async def weights_current(request: web.Request) -> web.Response:
    node = request.app[NODE]
    after = int_param(request, "after", None, -1, 2**62)
    timeout = timeout_param(request, node.long_poll_timeout_s)

    first = getattr(node.role, "syncer", None)
    first = first.engine_first if first is not None else None

    def newer() -> bool:
        cur = node.role.current()
        top = first.verified() if first is not None else None
        have = max(-1 if cur is None else cur["version"], -1 if top is None else top.patch.version)
        return node.stopping() or have > after

    if after is not None:
        await node.board.wait(newer, timeout)
    doc = node.role.current() or {"version": None, "state_digest": None, "path": None}
    # engine first: versions verified and patched but not yet on disk (daemon/engines/first.py)
    return web.json_response({**doc, "serving": first.serving_doc() if first else None})


async def engine_served(request: web.Request) -> web.Response:
    """An engine that follows this daemon says it now generates with a version (and how:
    "patch" or "load"); the status shows it per version (daemon/engines/first.py)."""
    node = request.app[NODE]
    try:
        body = await request.json()
        engine, version, how = str(body["engine"])[:100], int(body["version"]), str(body["how"])
    except (ValueError, KeyError, TypeError):
        raise web.HTTPBadRequest(text='{"error": "need {engine, version, how}"}',
                                 content_type="application/json") from None
    syncer = getattr(node.role, "syncer", None)
    if syncer is not None and syncer.engine_first is not None:
        syncer.engine_first.served(engine, version, how[:20])
    return web.json_response({"ok": True})


async def trajectories(request: web.Request) -> web.Response:
    intake = request.app[NODE].intake
    if intake.spool is None or intake.forwarder is None:
        raise fail(503, "the trajectory spool is not open yet", **{"Retry-After": "1"})
    body = await request.read()
    try:
        # Parsing and storing a batch (up to http.max_body_bytes) is CPU and disk work: it runs
        # in a worker thread so /healthz, long-polls and the swarm keep their event loop.
        held, fresh = await asyncio.to_thread(spool_batch, intake.spool, body,
                                              request.app[NODE].store.run())
    except BadTrajectory as e:
        raise web.HTTPBadRequest(
            text=json.dumps({**e.reply(), "error": f"trajectory batch refused: {e}"}),
            content_type="application/json") from None
    except SpoolFull as e:
        intake.refusals += 1
        raise fail(429, str(e), **{"Retry-After": str(intake.retry_after_s())}) from None
    except SpoolWriteError as e:
        raise fail(503, str(e), **{"Retry-After": str(intake.retry_after_s())}) from None
    intake.accepted += fresh
    intake.duplicates += len(held) - fresh
    if fresh:
        intake.forwarder.kick()
    return web.json_response({"held": held})


def spool_batch(spool: Spool, body: bytes, run: str | None = None) -> tuple[list[str], int]:
    """Validate an NDJSON batch (chain.trajectory; none stamped with a run other than this
    chain's) and store it durably: (ids, newly stored)."""
    return spool.append(parse_batch(body, run=run))


async def publish(request: web.Request) -> web.Response:
    node = request.app[NODE]
    try:
        doc = await request.json()
    except ValueError:
        raise fail(400, 'body must be JSON {"version": N}') from None
    version = doc.get("version") if isinstance(doc, dict) else None
    if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version < 2**62:
        raise fail(400, f'body must be {{"version": N}} with N an int >= 0, got {doc!r:.80}')
    try:
        return web.json_response(await node.role.publish(version))
    except PublishError as e:
        raise fail(e.status, str(e)) from None


async def peers_list(request: web.Request) -> web.Response:
    node = request.app[NODE]
    return web.json_response({"self": {"url": node.url, "bt": node.bt(), "node": node.node,
                                       "region": node.book.region, "role": node.book.role},
                              "peers": node.book.snapshot()})


async def peers_announce(request: web.Request) -> web.Response:
    node = request.app[NODE]
    try:
        doc = await request.json()
        if not isinstance(doc, dict):
            raise BadPeer("body must be a JSON object")
        bt = parse_endpoint(doc["bt"]) if doc.get("bt") else None
        name = check_node(doc["node"]) if doc.get("node") is not None else None
        region = check_node(doc["region"]) if doc.get("region") is not None else None
        node.book.learn(check_url(doc.get("url")), bt, name, region=region,
                        role=doc.get("role"))
    except BookFull as e:
        raise fail(409, str(e)) from None
    except (ValueError, BadPeer) as e:
        raise fail(400, f'announce must be {{"url": "http(s)://host:port", "bt": "ip:port", '
                        f'"node", "region", "role"}}: {e}') from None
    return web.json_response({"ok": True, "peers": len(node.book.peers)})


async def fleet_report(request: web.Request) -> web.Response:
    """A node's fleet report (its own entry and those it forwards, daemon/fleet/board.py). Checked
    before the body is parsed: the request must be signed by the reporting node's pinned key
    and its URL (X-Deltaswarm-Peer) must answer the hello challenge as that node with that key
    (fleet_link.Verifier); the body must be the one signed. Then every entry must carry its
    origin's signature: a relay forwards, it cannot forge."""
    node = request.app[NODE]
    fleet = node.fleet
    if fleet is None:
        raise fail(503, "this daemon keeps no fleet board")
    announce = request.headers.get(HEADER)
    if not announce:
        raise fail(400, f"a fleet report must carry {HEADER}: <url> <bt ip:port> <node> naming "
                        "the reporting node")
    try:
        url, _, name = parse_header(announce)
    except BadPeer as e:
        raise fail(400, str(e)) from None
    if name is None:
        raise fail(400, f"{HEADER} must name the reporting node (third field)")
    ident = signed_by(request, f"a fleet report from {name}")
    if request.content_length is not None and request.content_length > REPORT_MAX_BYTES:
        raise fail(400, f"fleet report larger than {REPORT_MAX_BYTES} bytes")
    why = await fleet.verifier.check(url, name, ident.key)
    if why is not None:
        raise web.HTTPForbidden(text=json.dumps({"error": f"fleet report from {name} refused: "
                                                          f"{why}"}),
                                content_type="application/json")
    body = await read_bounded(request, REPORT_MAX_BYTES, "fleet report")
    if not ident.body_ok(body):
        raise fail(400, "the fleet report body is not the one its signature covers")
    try:
        report, checks = await asyncio.to_thread(parse_and_check, body, time.time(),
                                                 fleet.board.forget_s, fleet.board.entries)
    except BadReport as e:
        raise fail(400, str(e)) from None
    try:
        accepted = fleet.board.accept(name, url, report.reports, time.time(), checks,
                                      node.identity, source=url)
    except BadReport as e:
        raise fail(400, str(e)) from None
    return web.json_response({"stored": accepted.stored, "refused": accepted.refused[:100],
                              **fleet.identity()})


def parse_and_check(body: bytes, now: float, forget_s: float, held: dict
                    ) -> tuple[Report, list[str | None]]:
    """Parse a report and check every entry's origin signature (CPU work: a worker thread).
    An entry no newer than the one `held` for its node is left unchecked: the board ignores
    it anyway (FleetBoard._store), so a gateway resending its region costs no verification."""
    report = parse_report(body)
    checks: list[str | None] = []
    for r in report.reports:
        old = held.get(r.node)
        if old is not None and r.sig is not None and r.sig.ts <= old.ts \
                and r.sig.key == old.key:
            checks.append(None)
        else:
            checks.append(check_entry(r.model_dump(mode="json"), now, forget_s))
    return report, checks


async def read_bounded(request: web.Request, cap: int, what: str) -> bytes:
    """The request body, refused (400) past `cap` bytes whatever Content-Length said."""
    buf = bytearray()
    async for chunk in request.content.iter_chunked(256 << 10):
        buf += chunk
        if len(buf) > cap:
            raise fail(400, f"{what} larger than {cap} bytes")
    return bytes(buf)


async def fleet_sent(request: web.Request) -> web.Response:
    """Whether this daemon sent the fleet report with this sha256 recently: the receiver asks,
    so a report announcing this daemon's URL from anywhere else is refused."""
    fleet = request.app[NODE].fleet
    digest = request.match_info["digest"]
    if not _DIGEST.match(digest):
        raise fail(400, "digest must be 64 lowercase hex digits (sha256 of the report body)")
    if fleet is None or fleet.reporter is None or not fleet.reporter.did_send(digest):
        raise fail(404, "this daemon did not send a fleet report with that digest recently")
    return web.json_response({"sent": True})


async def fleet_view(request: web.Request) -> web.Response:
    """The whole fleet as this daemon knows it, by region (daemon/fleet/board.py `FleetBoard.view`),
    built and encoded in a worker thread and cached (fleet_link.FleetParts.view_json);
    `?nodes=0` leaves out the node lists (what `deltaswarm status --fleet` shows by default)."""
    fleet = request.app[NODE].fleet
    if fleet is None:
        raise fail(503, "this daemon keeps no fleet board")
    nodes = request.query.get("nodes", "1")
    if nodes not in ("0", "1"):
        raise fail(400, "query parameter nodes must be 0 or 1")
    body = await fleet.view_json(nodes == "1")
    return web.Response(body=body, content_type="application/json")


async def swarm_complaint(request: web.Request) -> web.Response:
    """A peer that banned us says we sent it data failing the hash check for an artifact. It
    proves nothing (the peer may lie or be wrong), so it only schedules our own check of that
    artifact, at most once per artifact every few seconds (daemon/bittorrent/selfcheck.py). It must
    be
    signed by the complaining node's identity key (403 otherwise)."""
    node = request.app[NODE]
    ident = signed_by(request, "a complaint")
    body = await read_bounded(request, 64 << 10, "complaint")
    if not ident.body_ok(body):
        raise fail(400, "the complaint body is not the one its signature covers")
    try:
        doc = json.loads(body)
    except ValueError:
        raise fail(400, 'body must be JSON {"artifact": "v00000001.delta"}') from None
    artifact = doc.get("artifact") if isinstance(doc, dict) else None
    try:
        parse_artifact(artifact)
    except (BadManifest, TypeError):
        raise fail(400, f'body must be {{"artifact": "vNNNNNNNN.delta|snapshot"}}, got '
                        f'{artifact!r:.80}') from None
    return web.json_response({"ok": True, "checking": node.complaint(artifact)})


async def engine_check(request: web.Request) -> web.Response:
    """Read the engine's live weights back in full now (vLLM backend hook); the result also
    shows in the status's engine_check.full_check."""
    node = request.app[NODE]
    if node.engine_check is None:
        raise fail(404, "this node has no engine weight check")
    try:
        found = await node.engine_check()
    except LookupError as e:
        raise fail(404, str(e)) from None
    except Exception as e:  # the engine's answer, not ours: say what it was
        raise fail(409, f"the engine check did not run: {type(e).__name__}: {e}"[:500]) \
            from None
    return web.json_response(found)


def build_app(node: Parts) -> web.Application:
    app = web.Application(middlewares=[auth], client_max_size=node.max_body_bytes)
    app[NODE] = node
    app.add_routes([
        web.get("/healthz", healthz),
        web.get("/metrics", metrics),
        web.get("/v1/status", status),
        web.get("/v1/chain/head", chain_head),
        web.get("/v1/chain/index", chain_index),
        web.get("/v1/chain/manifests/{artifact}", chain_manifest),
        web.get("/v1/chain/torrents/{artifact}", chain_torrent),
        web.get("/v1/weights/current", weights_current),
        web.post("/v1/trajectories", trajectories),
        web.post("/v1/engine/served", engine_served),
        web.post("/v1/publish", publish),
        web.get("/v1/peers", peers_list),
        web.post("/v1/peers", peers_announce),
        web.post("/v1/fleet/report", fleet_report),
        web.get("/v1/fleet", fleet_view),
        web.get("/v1/fleet/sent/{digest}", fleet_sent),
        web.post("/v1/swarm/complaints", swarm_complaint),
        web.get("/ui", fleet_page),
        web.post("/v1/engine/check", engine_check),
    ])
    return app
