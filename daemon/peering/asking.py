"""Asking peers: one head long-poll loop per trusted peer (`HeadWatcher`), proofs that announced
peers hold the swarm token (`prove_loop`), head replies checked in our own words
(`parse_head`), and asking several peers at once where the first good answer wins
(`first_good`), so a silent peer only ever costs its own slot.
"""

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

from daemon.peering.identity import is_key_hex
from daemon.peering.names import BadName, Endpoint, check_node, parse_endpoint
from daemon.peering.peer_client import BadReply, PeerClient, PeerError, bounded_int
from daemon.peering.peers import BadPeer, Peer, PeerBook, not_held

log = logging.getLogger("deltaswarm.peers")
FANOUT = 3
"""Peers asked at once for an index or a torrent; the first good answer is used."""
GRACE_S = 2.0
"""Once one peer has answered, the others still pending get this long before they are dropped
(a silent peer never holds a sync step for its whole request timeout)."""
T = TypeVar("T")


def _plain_name(node: str) -> bool:
    try:
        check_node(node)
    except BadName:
        return False
    return True


def parse_head(reply: dict, url: str) -> tuple[int | None, Endpoint | None, str | None]:
    """(version, bt, node) of a head reply; BadReply (our words only) when a field is bad."""
    version = reply.get("version")
    if version is not None:
        version = bounded_int(version, url, "head version")
    bt = None
    if reply.get("bt"):
        try:
            bt = parse_endpoint(reply["bt"])
        except BadPeer:
            raise BadReply(url, "head reply has a bt endpoint that is not ip:port") from None
    node = reply.get("node")
    if node is not None and not (isinstance(node, str) and _plain_name(node)):
        raise BadReply(url, "head reply has an invalid node name")
    return version, bt, node


def _node_count(reply: dict, field: str, url: str) -> int | None:
    """A head reply's count of nodes (`nodes`, `trainer_nodes`): None when absent (older
    daemons), BadReply when it is not a plausible count."""
    value = reply.get(field)
    return None if value is None else bounded_int(value, url, f"head {field}", 10**8)


OnHead = Callable[[Peer, int | None], Awaitable[None]]


async def prove_loop(book: PeerBook, client: PeerClient, parallel: int = 8) -> None:
    """Ask every unproven, unbanned peer (not backing off) to prove it holds the swarm token,
    `parallel` at a time; each failure backs it off and repeated ones ban it. Runs on every
    role: the trainer's index lists only trusted peers, so regions learn each other through it
    only once the trainer has proven them."""
    running: dict[str, asyncio.Task] = {}
    changed = book.changed.subscribe()

    async def prove(peer: Peer) -> None:
        try:
            ok, ident = await client.prove_identity(peer.url)
            if ok:
                book.learn_own(peer.url, *(ident or (None, None)))
                if not peer.proven:
                    log.info("peer %s proved it is a daemon of this swarm", peer.url)
                book.succeeded(peer)
                peer.proven = True
                entry = book.peers.get(peer.url)  # evicted, or evicted and learned again,
                if entry is not None:  # while its hello ran: the entry now in the book
                    book.proved(entry)
            else:
                book.failed(peer, "did not prove it holds the swarm token")
        except PeerError as e:
            book.failed(peer, e)

    try:
        while True:
            for url in [u for u, t in running.items() if t.done()]:
                del running[url]
            now = time.monotonic()
            for peer in list(book.peers.values()):
                if len(running) >= parallel:
                    break
                # unproven peers, and trusted ones whose URL has not said who it is yet
                # (its own answer binds its identity key, daemon/peering/peers.py learn_own)
                if ((not peer.trusted or not peer.identified) and not peer.banned(now)
                        and peer.retry_at <= now and peer.url not in running):
                    running[peer.url] = asyncio.create_task(prove(peer))
            changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), 1.0)
    finally:
        for task in running.values():
            task.cancel()
        await asyncio.gather(*running.values(), return_exceptions=True)


class HeadWatcher:
    """One long-poll loop per watched (trusted) peer, so a silent peer holds up only its own
    loop; calls `on_head(peer, version)` on every reply. Each poll says who asks and what it
    holds (`poller()`: node, region, have), which is how the polled daemon's retention knows
    who is behind."""

    def __init__(self, book: PeerBook, client: PeerClient, on_head: OnHead,
                 known_head: Callable[[], int | None], max_peers: int,
                 poll_timeout: float,
                 poller: Callable[[], dict[str, str]] | None = None,
                 elsewhere: Callable[[Peer], bool] | None = None,
                 through: Callable[[], list[str]] | None = None,
                 glance_s: Callable[[], float] | None = None) -> None:
        self.book = book
        self.elsewhere = elsewhere
        """`elsewhere(peer)`: this node hears that peer's heads through others, so it does not
        watch it (a region's members do not watch the trainer: daemon/versions/sync.py)."""
        self.through = through
        """`through()`: URLs long-polled whatever their standing among `max_peers` (at a large
        fleet they may rank below them): the peer the trainer's heads come through, else the
        trainer itself."""
        self.glance_s = glance_s
        """`glance_s()`: a peer heard elsewhere is still asked its head (without holding the
        request) this often, so two nodes whose views make each hear the trainer through the
        other are not both left behind for good; None: never."""
        self.poller = poller
        self.client = client
        self.on_head = on_head
        self.known_head = known_head
        self.max_peers = max_peers
        self.poll_timeout = poll_timeout
        self._tasks: dict[str, asyncio.Task] = {}
        self._glancing: dict[str, bool] = {}

    def reconfigure(self, max_peers: int, poll_timeout: float) -> None:
        self.max_peers, self.poll_timeout = max_peers, poll_timeout
        self.book.changed.set()

    async def run(self) -> None:
        changed = self.book.changed.subscribe()
        try:
            while True:
                wanted: dict[str, bool] = {}  # url → only glanced at (heard elsewhere)
                for p in self.book.to_watch(self.max_peers):
                    if self.elsewhere is None or not self.elsewhere(p):
                        wanted[p.url] = False
                for url in self.through() if self.through is not None else ():
                    if url in self.book.peers:
                        wanted[url] = False
                if self.elsewhere is not None and self.glance_s is not None:
                    now = time.monotonic()  # every such peer, ranked among max_peers or not
                    for p in self.book.peers.values():
                        if (p.url not in wanted and p.trusted and not p.banned(now)
                                and self.elsewhere(p)):
                            wanted[p.url] = True
                for url in list(self._tasks):
                    if (url not in wanted or self._tasks[url].done()
                            or self._glancing.get(url) != wanted[url]):
                        await self._stop(url)
                for url in wanted.keys() - self._tasks.keys():
                    self._glancing[url] = wanted[url]
                    self._tasks[url] = asyncio.create_task(self._watch(url, wanted[url]),
                                                           name=f"head:{url}")
                changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), 5.0)
        finally:
            for url in list(self._tasks):
                await self._stop(url)

    async def _stop(self, url: str) -> None:
        self._glancing.pop(url, None)
        task = self._tasks.pop(url)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _watch(self, url: str, glance: bool = False) -> None:
        if glance and self.glance_s is not None:
            await self._first_glance(self.glance_s)
        while True:
            peer = self.book.peers.get(url)
            if peer is None or peer.banned():
                return
            wait = peer.retry_at - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            try:
                await self._poll(peer, hold=not glance)
            except (PeerError, BadPeer) as e:
                self.book.failed(peer, e)
                log.debug("head poll of %s failed: %s", url, peer.last_error)
            if glance and self.glance_s is not None:
                await asyncio.sleep(self.glance_s())

    @staticmethod
    async def _first_glance(period: Callable[[], float]) -> None:
        """Wait a share of the glance period drawn once, so the fleet's first glances spread
        over it; the period is read again each second, because a node that has just started
        learns the fleet's size (and so how seldom to glance) from its first replies: a
        period fixed at start had every node of a restarted fleet glance within the first
        TRAINER_INDEX_S (at 10,000 nodes, ~330 asks a second at the trainer)."""
        share, start = random.random(), time.monotonic()
        while (left := start + share * period() - time.monotonic()) > 0:
            await asyncio.sleep(min(left, 1.0))

    async def _poll(self, peer: Peer, hold: bool = True) -> None:
        heads = [h for h in (self.known_head(), peer.head) if h is not None]
        after = max(heads, default=-1)
        params = {"timeout": str(self.poll_timeout if hold else 0), "after": str(after),
                  **(self.poller() if self.poller is not None else {})}
        reply = await self.client.get_json(f"{peer.url}/v1/chain/head", "head", params=params,
                                           timeout=self.poll_timeout + 10)
        version, bt, node = parse_head(reply, peer.url)
        peer.fleet_nodes = _node_count(reply, "nodes", peer.url)
        peer.trainer_nodes = _node_count(reply, "trainer_nodes", peer.url)
        key, region = reply.get("key"), reply.get("region")
        self.book.learn_own(peer.url, node, key if is_key_hex(key) else None, bt, version,
                            region if isinstance(region, str) and _plain_name(region) else None,
                            reply.get("role") if isinstance(reply.get("role"), str) else None)
        self.book.succeeded(peer)
        await self.on_head(peer, version)
        if hold and (version is None or version <= after):
            await asyncio.sleep(0.2)


class HeadQuorum:
    """Whether enough heads are in to plan (issue 11, finding 5: a late joiner acted on the first
    head it heard, a stale one, and downloaded two snapshots). Settled once `quorum` peers
    replied, or every peer known (and askable now) replied after an index said who they are,
    or `wait_s` passed since the first reply; once settled it stays so."""

    def __init__(self, quorum: int, wait_s: float) -> None:
        self.quorum, self.wait_s = quorum, wait_s
        self.heard: dict[str, int | None] = {}
        self.started = time.monotonic()
        self.first: float | None = None
        self.read_index = False
        self.settled = False

    def reply(self, url: str, version: int | None) -> None:
        self.heard[url] = version
        if self.first is None:
            self.first = time.monotonic()

    def check(self, book: PeerBook) -> bool:
        """Also true, for now, while no peer has answered at all for `wait_s` since start: the
        node may go on with what it holds (a plan its own store allows) meanwhile."""
        now = time.monotonic()
        if self.settled or self.first is None:
            return self.settled or now - self.started >= self.wait_s
        pending = [p for p in book.peers.values()
                   if p.url not in self.heard and not p.banned(now) and p.retry_at <= now]
        if (len(self.heard) >= self.quorum or (self.read_index and not pending)
                or now - self.first >= self.wait_s):
            self.settled = True
            log.info("heads settled after %.2fs: %s", now - self.first, self.heard)
        return self.settled


async def first_good(peers: Iterable[Peer], ask: Callable[[Peer], Awaitable[T]],
                     book: PeerBook, fanout: int = FANOUT, grace: float = GRACE_S,
                     settle: bool = True) -> T | None:
    """Ask peers `fanout` at a time, in order; the first truthy answer is returned. A failing
    peer is backed off (book.failed, once for requests that overlapped an earlier failure); one
    answering that it does not hold what was asked (404) takes no strike (book.lacks); a slow
    one only costs its own slot. Once any peer has answered, nobody new is asked after a good
    answer, and the requests still running get `grace` seconds to finish (so a peer halfway
    through serving manifests is not cut off) before they are cancelled; with `settle=False` a
    good answer cancels them at once."""
    queue = list(peers)
    running: dict[asyncio.Task, Peer] = {}
    started: dict[asyncio.Task, float] = {}
    answered_at: float | None = None
    best: T | None = None
    try:
        while queue or running:
            while queue and len(running) < fanout:
                peer = queue.pop(0)
                task = asyncio.create_task(ask(peer))
                running[task], started[task] = peer, time.monotonic()
            if not running:
                break
            timeout = None
            if answered_at is not None and not queue:
                timeout = max(0.0, answered_at + grace - time.monotonic())
            done, _ = await asyncio.wait(running, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done:
                break  # the grace ran out; the finally cancels the laggards
            for task in done:
                peer = running.pop(task)
                try:
                    result = task.result()
                except (PeerError, BadPeer) as e:
                    if not_held(e):
                        book.lacks(peer, e)
                    else:
                        book.failed(peer, e, since=started[task])
                    continue
                if answered_at is None:
                    answered_at = time.monotonic()
                if result and best is None:
                    best = result
                    queue.clear()
                    if not settle:
                        return best
        return best
    finally:
        for task in running:
            task.cancel()
        if running:
            await asyncio.gather(*running, return_exceptions=True)
