"""The daemon's control plane (aiohttp): chain head long-poll, manifests, torrents, index, weights,
trajectories, publish, peers, status, metrics, health.

Every route but /healthz and /metrics needs `Authorization: Bearer <token>` (see THREAT_MODEL.md).
Requests from other daemons carry `X-Deltaswarm-Peer`, which is how the mesh learns about them.
All inputs are validated here; errors are JSON `{"error": "..."}` with a 4xx status.
"""

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from chain.auth import bearer_matches
from chain.errors import BadManifest
from chain.manifest import parse_artifact
from daemon.peers import HEADER, BadPeer, check_url, parse_endpoint
from daemon.publish import PublishError
from daemon.spool import BadTrajectory, Spool, SpoolFull, SpoolWriteError, parse_batch

if TYPE_CHECKING:
    from daemon.node import Node

log = logging.getLogger("deltaswarm.http")
NODE: web.AppKey["Node"] = web.AppKey("node")
OPEN_ROUTES = frozenset({"/healthz", "/metrics"})


class Board:
    """Wakes long-polls when the chain head or the current weights change."""

    def __init__(self) -> None:
        self.cond = asyncio.Condition()

    async def wait(self, pred: Callable[[], bool], timeout: float) -> None:
        async with self.cond:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.cond.wait_for(pred), timeout)

    async def bump(self) -> None:
        async with self.cond:
            self.cond.notify_all()


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
        announce = request.headers.get(HEADER)
        if announce:
            try:
                node.book.learn_header(announce)
            except BadPeer as e:
                raise fail(400, str(e)) from None
    return await handler(request)


async def healthz(request: web.Request) -> web.Response:
    node = request.app[NODE]
    return web.json_response({"ok": True, "node": node.cfg.node, "role": node.cfg.role})


async def metrics(request: web.Request) -> web.Response:
    node = request.app[NODE]
    body, content_type = node.metrics_text()
    return web.Response(body=body, headers={"Content-Type": content_type})


async def status(request: web.Request) -> web.Response:
    return web.json_response(request.app[NODE].status())


def head_doc(node: "Node") -> dict[str, Any]:
    head = node.store.head()
    arts = [a for a in node.store.artifacts() if head is not None and parse_artifact(a)[0] == head]
    return {"version": head, "artifacts": arts, "bt": node.bt_advertised(),
            "node": node.cfg.node, "url": node.url}


async def chain_head(request: web.Request) -> web.Response:
    node = request.app[NODE]
    after = int_param(request, "after", None, -1, 2**62)
    timeout = timeout_param(request, node.cfg.long_poll_timeout_s)
    if after is not None:
        await node.board.wait(lambda: (node.store.head() if node.store.head() is not None
                                       else -1) > after or node.stopping, timeout)
    return web.json_response(head_doc(node))


async def chain_index(request: web.Request) -> web.Response:
    node = request.app[NODE]
    seeding = set(node.swarm.artifacts()) if node.swarm is not None else set()
    return web.json_response({
        "artifacts": node.store.artifacts(), "head": node.store.head(),
        "bt": node.bt_advertised(), "node": node.cfg.node, "url": node.url,
        "seeding": sorted(seeding), "peers": node.book.snapshot()})


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
    path = node.paths.torrents / f"{name}.torrent"
    if not path.is_file():
        raise fail(404, f"no torrent for {name} on {node.cfg.node}")
    return web.Response(body=path.read_bytes(), content_type="application/x-bittorrent")


async def weights_current(request: web.Request) -> web.Response:
    node = request.app[NODE]
    after = int_param(request, "after", None, -1, 2**62)
    timeout = timeout_param(request, node.cfg.long_poll_timeout_s)

    def newer() -> bool:
        cur = node.current()
        return node.stopping or (cur is not None and cur["version"] > after)

    if after is not None:
        await node.board.wait(newer, timeout)
    return web.json_response(node.current() or {"version": None, "state_digest": None,
                                                "path": None})


async def trajectories(request: web.Request) -> web.Response:
    node = request.app[NODE]
    body = await request.read()
    try:
        # Parsing and storing a batch (up to http.max_body_bytes) is CPU and disk work: it runs
        # in a worker thread so /healthz, long-polls and the swarm keep their event loop.
        held, fresh = await asyncio.to_thread(spool_batch, node.spool, body)
    except BadTrajectory as e:
        raise web.HTTPBadRequest(
            text=json.dumps({**e.reply(), "error": f"trajectory batch refused: {e}"}),
            content_type="application/json") from None
    except SpoolFull as e:
        node.spool_refusals += 1
        raise fail(429, str(e), **{"Retry-After": str(node.retry_after_s())}) from None
    except SpoolWriteError as e:
        raise fail(503, str(e), **{"Retry-After": str(node.retry_after_s())}) from None
    node.spool_accepted += fresh
    node.spool_duplicates += len(held) - fresh
    if fresh:
        node.forwarder.kick()
    return web.json_response({"held": held})


def spool_batch(spool: Spool, body: bytes) -> tuple[list[str], int]:
    """Validate an NDJSON batch (chain.trajectory) and store it durably: (ids, newly stored)."""
    return spool.append(parse_batch(body))


async def publish(request: web.Request) -> web.Response:
    node = request.app[NODE]
    if node.seeder is None:
        raise fail(409, f"{node.cfg.node} is a region daemon; only role: trainer accepts publish")
    try:
        doc = await request.json()
    except ValueError:
        raise fail(400, 'body must be JSON {"version": N}') from None
    version = doc.get("version") if isinstance(doc, dict) else None
    if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version < 2**62:
        raise fail(400, f'body must be {{"version": N}} with N an int >= 0, got {doc!r:.80}')
    try:
        return web.json_response(await node.seeder.publish(version))
    except PublishError as e:
        raise fail(e.status, str(e)) from None


async def peers_list(request: web.Request) -> web.Response:
    node = request.app[NODE]
    return web.json_response({"self": {"url": node.url, "bt": node.bt_advertised(),
                                       "node": node.cfg.node}, "peers": node.book.snapshot()})


async def peers_announce(request: web.Request) -> web.Response:
    node = request.app[NODE]
    try:
        doc = await request.json()
        if not isinstance(doc, dict):
            raise BadPeer("body must be a JSON object")
        bt = parse_endpoint(doc["bt"]) if doc.get("bt") else None
        node.book.learn(check_url(doc.get("url")), bt,
                        doc.get("node") if isinstance(doc.get("node"), str) else None)
    except (ValueError, BadPeer) as e:
        raise fail(400, f'announce must be {{"url", "bt": "host:port", "node"}}: {e}') from None
    return web.json_response({"ok": True, "peers": len(node.book.peers)})


def build_app(node: "Node") -> web.Application:
    app = web.Application(middlewares=[auth], client_max_size=node.cfg.http.max_body_bytes)
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
        web.post("/v1/publish", publish),
        web.get("/v1/peers", peers_list),
        web.post("/v1/peers", peers_announce),
    ])
    return app
