"""Peer and head discovery: who the other daemons are, where their BitTorrent ports are, and
which version each holds.

A daemon starts from its bootstrap URLs; every request one daemon makes to another carries an
`X-Deltaswarm-Peer: <control url> <bt host:port> <node>` header, and /v1/chain/index replies list
known peers, so the mesh grows beyond the bootstrap list without a DHT. `HeadWatcher` long-polls
`GET /v1/chain/head?after=N` on up to `max_peers` peers and reports every newer head.
"""

import asyncio
import contextlib
import logging
import random
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp

log = logging.getLogger("deltaswarm.peers")
HEADER = "X-Deltaswarm-Peer"
_URL = re.compile(r"^https?://[A-Za-z0-9.\-\[\]:]+(:\d{1,5})?(/[^\s]*)?$")
_NODE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")

Endpoint = tuple[str, int]


class BadPeer(ValueError):
    """A peer announcement (header or list entry) is malformed."""


@dataclass
class Peer:
    url: str
    bt: Endpoint | None = None
    node: str | None = None
    head: int | None = None
    bootstrap: bool = False
    last_seen: float = 0.0
    failures: int = 0
    last_error: str = ""
    watched: bool = field(default=False, repr=False)

    def as_dict(self) -> dict:
        return {"url": self.url, "node": self.node, "head": self.head,
                "bt": f"{self.bt[0]}:{self.bt[1]}" if self.bt else None,
                "bootstrap": self.bootstrap, "failures": self.failures,
                "last_seen": round(self.last_seen, 3), "last_error": self.last_error}


def check_url(url: object) -> str:
    if not isinstance(url, str) or len(url) > 2048 or not _URL.match(url):
        raise BadPeer(f"peer URL {url!r:.80} is not an http(s) URL")
    return url.rstrip("/")


def parse_endpoint(text: object) -> Endpoint:
    if not isinstance(text, str) or len(text) > 300:
        raise BadPeer(f"BitTorrent endpoint {text!r:.80} is not host:port")
    host, _, port = text.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or " " in host:
        raise BadPeer(f"BitTorrent endpoint {text!r:.80} is not host:port")
    return host, int(port)


def parse_header(value: str) -> tuple[str, Endpoint | None, str | None]:
    """`<url> <bt host:port|-> [node]` → (url, endpoint, node); raises BadPeer."""
    parts = value.split()
    if not 1 <= len(parts) <= 3:
        raise BadPeer(f"{HEADER} must be '<url> <bt host:port> <node>', got {value!r:.120}")
    url = check_url(parts[0])
    bt = parse_endpoint(parts[1]) if len(parts) > 1 and parts[1] != "-" else None
    node = parts[2] if len(parts) > 2 else None
    if node is not None and not _NODE.match(node):
        raise BadPeer(f"node name {node!r:.80} in {HEADER} is invalid")
    return url, bt, node


class PeerBook:
    """Known peers keyed by control URL (this node excluded)."""

    def __init__(self, self_url: str, self_bt: Endpoint, node: str, bootstrap: list[str]) -> None:
        self.self_url = self_url.rstrip("/")
        self.self_bt = self_bt
        self.node = node
        self.peers: dict[str, Peer] = {}
        self.changed = asyncio.Event()
        self.set_bootstrap(bootstrap)

    def header(self) -> str:
        return f"{self.self_url} {self.self_bt[0]}:{self.self_bt[1]} {self.node}"

    def set_bootstrap(self, urls: list[str]) -> None:
        for p in self.peers.values():
            p.bootstrap = False
        for url in urls:
            peer = self.learn(url)
            if peer is not None:
                peer.bootstrap = True

    def learn(self, url: str, bt: Endpoint | None = None, node: str | None = None,
              head: int | None = None) -> Peer | None:
        url = check_url(url)
        if url == self.self_url or (node is not None and node == self.node):
            return None
        peer = self.peers.get(url)
        if peer is None:
            peer = self.peers[url] = Peer(url)
            log.info("learned peer %s", url)
            self.changed.set()
        if bt is not None and bt != self.self_bt:
            if peer.bt != bt:
                self.changed.set()
            peer.bt = bt
        if node is not None:
            peer.node = node
        if head is not None and (peer.head is None or head > peer.head):
            peer.head = head
        peer.last_seen = time.time()
        return peer

    def learn_header(self, value: str) -> Peer | None:
        url, bt, node = parse_header(value)
        return self.learn(url, bt, node)

    def bt_endpoints(self) -> list[Endpoint]:
        return [p.bt for p in self.peers.values() if p.bt is not None]

    def best_head(self) -> int | None:
        return max((p.head for p in self.peers.values() if p.head is not None), default=None)

    def by_head(self, version: int | None = None) -> list[Peer]:
        """Peers to ask for data, those holding `version` first, the least failing first."""
        def rank(p: Peer) -> tuple:
            has = version is not None and p.head is not None and p.head >= version
            return (not has, p.failures, random.random())
        return sorted(self.peers.values(), key=rank)

    def to_watch(self, limit: int) -> list[Peer]:
        ordered = sorted(self.peers.values(), key=lambda p: (not p.bootstrap, p.failures))
        return ordered[:limit]

    def snapshot(self) -> list[dict]:
        return [p.as_dict() for p in sorted(self.peers.values(), key=lambda p: p.url)]


OnHead = Callable[[Peer, dict], Awaitable[None]]


class HeadWatcher:
    """One long-poll loop per watched peer; calls `on_head(peer, reply)` on every reply."""

    def __init__(self, book: PeerBook, session: aiohttp.ClientSession, headers: dict[str, str],
                 on_head: OnHead, known_head: Callable[[], int | None], max_peers: int,
                 poll_timeout: float) -> None:
        self.book = book
        self.session = session
        self.headers = headers
        self.on_head = on_head
        self.known_head = known_head
        self.max_peers = max_peers
        self.poll_timeout = poll_timeout
        self._tasks: dict[str, asyncio.Task] = {}

    async def run(self) -> None:
        try:
            while True:
                wanted = {p.url for p in self.book.to_watch(self.max_peers)}
                for url in list(self._tasks):
                    if url not in wanted or self._tasks[url].done():
                        await self._stop(url)
                for url in wanted - self._tasks.keys():
                    self._tasks[url] = asyncio.create_task(self._watch(url), name=f"head:{url}")
                self.book.changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.book.changed.wait(), 5.0)
        finally:
            for url in list(self._tasks):
                await self._stop(url)

    async def _stop(self, url: str) -> None:
        task = self._tasks.pop(url)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _watch(self, url: str) -> None:
        delay = 0.5
        while True:
            peer = self.book.peers.get(url)
            if peer is None:
                return
            heads = [h for h in (self.known_head(), peer.head) if h is not None]
            after = max(heads, default=-1)
            params = {"timeout": str(self.poll_timeout), "after": str(after)}
            try:
                async with self.session.get(
                    f"{url}/v1/chain/head", params=params, headers=self.headers,
                    timeout=aiohttp.ClientTimeout(total=self.poll_timeout + 10),
                ) as r:
                    if r.status != 200:
                        raise BadPeer(f"HTTP {r.status}: {(await r.text())[:200]}")
                    reply = await r.json()
                if not isinstance(reply, dict):
                    raise BadPeer("head reply is not a JSON object")
                version = reply.get("version")
                if version is not None and (not isinstance(version, int) or version < 0):
                    raise BadPeer(f"head reply has invalid version {version!r:.40}")
                bt = parse_endpoint(reply["bt"]) if reply.get("bt") else None
                node = reply.get("node") if isinstance(reply.get("node"), str) else None
                self.book.learn(url, bt, node if node and _NODE.match(node) else None, version)
                peer.failures, peer.last_error = 0, ""
                delay = 0.5
                await self.on_head(peer, reply)
                if version is None or version <= after:
                    await asyncio.sleep(0.2)
            except asyncio.CancelledError:
                raise
            except (aiohttp.ClientError, TimeoutError, BadPeer, ValueError, KeyError) as e:
                peer.failures += 1
                peer.last_error = f"{type(e).__name__}: {e}"[:300]
                log.debug("head poll of %s failed: %s", url, peer.last_error)
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))
                delay = min(delay * 2, 30.0)
