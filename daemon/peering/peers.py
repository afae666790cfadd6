"""Peer and head discovery: who the other daemons are, where their BitTorrent ports are, which
version each claims, and how far each is trusted.

A daemon starts from its bootstrap URLs; every request one daemon makes to another carries an
`X-Deltaswarm-Peer: <control url> <bt ip:port> <node>` header (and `X-Deltaswarm-Region: <region>
<role>`), and /v1/chain/index replies list known peers with their regions, so the mesh grows
beyond the bootstrap list without a DHT. Which of them the swarm dials is
daemon/peering/regions.py's.

What an announcement may hold (`check_url`, `parse_endpoint`, `check_node`): a control URL of the
daemon API's shape (http/https, host, optional port; no path, query, fragment or user info), a
BitTorrent endpoint whose host is an IP literal (libtorrent's connect_peer takes nothing else;
a daemon resolves its own advertised host name once at start, see node.py), a node name of
1-64 `[A-Za-z0-9_.-]`. The book holds at most `max_peers` peers: a newcomer evicts the peer in
the worst standing if it ranks better, else it is not stored.

Anchors: beyond `max_peers`, a book keeps each region's `ANCHORS_PER_REGION` live, proven members
that rank first by election rank (`names.rank`) and up to `MAX_TRAINER_ANCHORS` trainers, and an
index reply lists the anchors of the asker's region, then the trainers' regions, then one of
each other region, before a random sample of the rest. A newcomer that would rank among them
waits beside them, unproven, until its hello proves it (anyone can choose a name that ranks
first; an unproven one must cost no proven peer its place).

Why anchors: fetch roles and gateways are computed from the book, the same way in every view
only if every view holds the same first-ranked members. With books of 32 and a fleet of 600 (20
regions of 30) a full book of proven peers took no newcomer, views froze with whoever came
first, and 485 nodes each believed they fetched for their region (bench/fleet_views.py on the
code before). Each index read now carries the best members the peer knows of the asker's region,
so the first-ranked member spreads to a whole region in a few reads.

Standing: bootstrap peers (the operator's config) are trusted with the swarm token; any other peer
first proves it holds the token (`PeerClient.prove`, no token sent); until then it gets no token,
its heads are not polled and its BitTorrent endpoint is not dialled. Every failure backs a peer
off (1 s doubling to 60 s, jittered) and demotes it; `BAN_FAILURES` failures in a row or
`BAN_STRIKES` refuted head claims (a claimed head whose manifest it could not serve) ban a
non-bootstrap peer for `BAN_S`. A peer answering that it does not hold what was asked
(`not_held`: 404/410) has answered honestly and takes no failure; failures of requests that were
already under way when an earlier failure was booked count once (`failed(since=)`: ten downloads
asking one peer at once must not reach a ban from a single blip, issue 11 chaos finding).
Heads peers claim are hints for what to fetch; the head a node
reports is the newest manifest it verified.
"""

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from daemon.peering.names import BadName, Endpoint, check_node, check_url, parse_endpoint, rank
from daemon.peering.peer_client import PeerError, PeerHttpError

log = logging.getLogger("deltaswarm.peers")
HEADER = "X-Deltaswarm-Peer"
REGION_HEADER = "X-Deltaswarm-Region"
"""`<region> <role>` of the sender; a header of its own so daemons that predate regions ignore
it instead of refusing a longer X-Deltaswarm-Peer."""
ROLES = ("trainer", "region")
BACKOFF_MIN_S, BACKOFF_MAX_S = 1.0, 60.0
BAN_FAILURES = 6
BAN_STRIKES = 2
BAN_S = 600.0
ANCHORS_PER_REGION = 2
"""Members of each region, best by election rank, a book keeps beyond `max_peers`."""
MAX_ANCHORS = 512
"""At most this many anchors in all (a bound on what announcements of made-up regions cost)."""
MAX_UNPROVEN_ANCHORS = 32
"""Of those, at most this many not yet proven: a newcomer that would be an anchor holds a place
of its own while its hello runs (a name that never proves fails and loses it), beside the
trusted anchors, never instead of one."""
MAX_TRAINER_ANCHORS = 4
"""Trainers kept as anchors (a run has one trainer daemon), trusted and best-ranked first: a
peer's role is what others announce of it, so made-up trainers are bounded like made-up
regions."""
ANCHOR_DEAD_AFTER = 2
"""Failures in a row after which a peer no longer holds an anchor place (regions.DEAD_AFTER)."""
INDEX_PEERS = 64
"""Most peers an index reply lists, and an index reader takes."""
NOT_HELD = (404, 410)
"""Statuses with which a daemon says it does not hold an artifact, manifest or torrent."""


BadPeer = BadName
"""A peer announcement (header, body or list entry) is malformed."""


class BookFull(BadPeer):
    """The peer book holds `max_peers` peers in better standing than the newcomer."""


@dataclass
class Peer:
    url: str
    bt: Endpoint | None = None
    node: str | None = None
    head: int | None = None
    """The newest version it claimed (a hint, not verified)."""
    bootstrap: bool = False
    proven: bool = False
    """It answered a hello challenge with the swarm token's proof."""
    last_seen: float = 0.0
    failures: int = 0
    strikes: int = 0
    retry_at: float = 0.0
    banned_until: float = 0.0
    last_error: str = ""
    region: str | None = None
    """The region it announced (X-Deltaswarm-Region, index entries); None until known."""
    role: str | None = None
    """'trainer' or 'region', as announced with the region."""
    failed_at: float = 0.0
    """Monotonic time of the last failure booked (see PeerBook.failed's `since`)."""
    misses: int = 0
    """Asks it answered with 'not held' (no strike; shown in status)."""
    key: str | None = None
    """Its identity key (daemon/peering/identity.py): only requests signed with it update this
    entry."""
    key_confirmed: bool = False
    """The key came from the URL's own answer (hello or head reply), not from a header."""
    identified: bool = False
    """Its URL was asked who it is (hello) since it became known."""
    _order: tuple[str, str, str] | None = None
    """(region, node, rank) cached: the election rank of this peer's last region and name."""
    fleet_nodes: int | None = None
    """How many live nodes it said it knows in its last head reply (the trainer's count paces
    how often nodes that hear it through others still ask it: Syncer.glance_s)."""
    trainer_nodes: int | None = None
    """The trainer's count as this peer last heard it (its head replies relay it), so a node
    that hears the trainer through this peer paces its asks by the fleet's size from its first
    reply on, not after its own first ask of the trainer."""

    @property
    def trusted(self) -> bool:
        return self.bootstrap or self.proven

    def banned(self, now: float | None = None) -> bool:
        return self.banned_until > (time.monotonic() if now is None else now)

    def usable(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return self.trusted and not self.banned(now) and self.retry_at <= now

    def order(self, region: str, node: str) -> str:
        """Its election rank as `region`'s member `node` (cached: a sha256 per call would be
        paid for every peer of the book at each newcomer)."""
        if self._order is None or self._order[:2] != (region, node):
            self._order = (region, node, rank(region, node))
        return self._order[2]

    def rank(self) -> tuple:
        """Standing, worst first when sorted ascending."""
        return (self.bootstrap, not self.banned(), self.proven, -self.strikes, -self.failures,
                self.last_seen)

    def as_dict(self) -> dict:
        now = time.monotonic()
        return {"url": self.url, "node": self.node, "head": self.head,
                "bt": f"{self.bt[0]}:{self.bt[1]}" if self.bt else None,
                "bootstrap": self.bootstrap, "proven": self.proven, "failures": self.failures,
                "strikes": self.strikes, "banned_s": round(max(0.0, self.banned_until - now), 1),
                "last_seen": round(self.last_seen, 3), "last_error": self.last_error,
                "region": self.region, "role": self.role, "misses": self.misses,
                "key": self.key, "key_confirmed": self.key_confirmed}


def parse_header(value: str) -> tuple[str, Endpoint | None, str | None]:
    """`<url> <bt ip:port|-> [node]` → (url, endpoint, node); raises BadPeer."""
    if len(value) > 512:
        raise BadPeer(f"{HEADER} is longer than 512 characters")
    parts = value.split()
    if not 1 <= len(parts) <= 3:
        raise BadPeer(f"{HEADER} must be '<url> <bt ip:port> <node>', got {value!r:.120}")
    url = check_url(parts[0])
    bt = parse_endpoint(parts[1]) if len(parts) > 1 and parts[1] != "-" else None
    node = check_node(parts[2]) if len(parts) > 2 else None
    return url, bt, node


def parse_region(value: str) -> tuple[str, str | None]:
    """`<region> [role]` → (region, role); raises BadPeer."""
    parts = value.split()
    if not 1 <= len(parts) <= 2 or len(value) > 200:
        raise BadPeer(f"{REGION_HEADER} must be '<region> <trainer|region>', got {value!r:.80}")
    region = check_node(parts[0])
    role = parts[1] if len(parts) > 1 else None
    if role is not None and role not in ROLES:
        raise BadPeer(f"{REGION_HEADER} role must be one of {ROLES}, got {role!r:.40}")
    return region, role


class Signal:
    """`set()` wakes every subscriber; each clears only its own event."""

    def __init__(self) -> None:
        self._events: list[asyncio.Event] = []

    def subscribe(self) -> asyncio.Event:
        ev = asyncio.Event()
        self._events.append(ev)
        return ev

    def set(self) -> None:
        for ev in self._events:
            ev.set()


class PeerBook:
    """Known peers keyed by control URL (this node excluded), at most `max_peers` of them."""

    def __init__(self, self_url: str, self_bt: Endpoint, node: str, bootstrap: list[str],
                 max_peers: int) -> None:
        self.self_url = check_url(self_url)
        self.self_bt = self_bt
        self.node = node
        self.max_peers = max_peers
        self.peers: dict[str, Peer] = {}
        self.bans: dict[str, float] = {}
        """url → monotonic end of its ban; survives eviction so re-announcing does not unban."""
        self.changed = Signal()
        self.pin: Callable[[str, str, str], bool] = lambda node, key, source: True
        """Whether `key` may be `node` (daemon/peering/identity.py `Identities.claim`: pins the
        name on
        first contact); a URL answering as a name pinned to another key is not bound."""
        self.refused_headers = 0
        """Signed announcements refused because the entry they named is another key's."""
        self.last_refused_header = ""
        self.region: str | None = None
        self.role: str | None = None
        self.peering = None
        """A `daemon.peering.regions.RegionPeering` choosing which BitTorrent endpoints to dial
        (`swarm_endpoints`); None dials every trusted peer."""
        self.set_bootstrap(bootstrap)

    def header(self) -> str:
        return f"{self.self_url} {self.self_bt[0]}:{self.self_bt[1]} {self.node}"

    def announce(self) -> dict[str, str]:
        out = {HEADER: self.header()}
        if self.region is not None:
            out[REGION_HEADER] = f"{self.region} {self.role}" if self.role else self.region
        return out

    def set_region(self, region: str, role: str | None, peering: object = None) -> None:
        """This node's own region and role (announced on every request) and its peering policy."""
        self.region, self.role, self.peering = check_node(region), role, peering

    def reconfigure(self, bootstrap: list[str], max_peers: int) -> None:
        self.max_peers = max_peers
        self.set_bootstrap(bootstrap)
        self._trim()
        self.changed.set()

    def set_bootstrap(self, urls: list[str]) -> None:
        for p in self.peers.values():
            p.bootstrap = False
        for url in urls:
            url = check_url(url)
            if url == self.self_url:
                continue
            peer = self.peers.get(url) or self._add(url, force=True)
            peer.bootstrap = True
            peer.banned_until = 0.0

    def _add(self, url: str, force: bool = False, region: str | None = None,
             node: str | None = None, role: str | None = None) -> Peer:
        """Store a newcomer (with what its announcement says of it, so the anchors count it).
        Bootstrap peers (`force`) always; others while an ordinary place is free, as an anchor
        candidate (a place of its own, beside the trusted anchors: it takes an anchor's rank
        only once it proves, `proved`), or in place of the ordinary peer in the worst standing
        if it stands better (it never does while unproven, so an unproven name, however it
        ranks, costs no proven peer its place). Else BookFull."""
        newcomer = Peer(url, last_seen=time.time(), banned_until=self.bans.get(url, 0.0))
        if region is not None:
            newcomer.region, newcomer.node, newcomer.role = region, node, role
        anchor = False
        if not force and len(self.peers) >= self.max_peers:
            # one anchor computation per newcomer (an index read brings 64 of them)
            anchors = self._anchors_with(newcomer)
            anchor = url in anchors
            if not anchor and len(self.peers) - len(anchors) >= self.max_peers:
                ordinary = [p for p in self.peers.values()
                            if not p.bootstrap and p.url not in anchors]
                worst = min(ordinary, key=Peer.rank, default=None)
                if worst is None or worst.rank() >= newcomer.rank():
                    raise BookFull(f"the peer book is full ({self.max_peers} peers in better "
                                   "standing)")
                self._evict(worst, url)
        self.peers[url] = newcomer
        log.info("learned peer %s", url)
        if anchor:  # it may have displaced another candidate, now ordinary
            self._trim()
        self.changed.set()
        return newcomer

    def proved(self, peer: Peer) -> None:
        """`peer` answered its hello with the swarm token's proof. As a trusted member it may
        now rank among its region's anchors; the anchor it displaced is ordinary, and the
        ordinary peer in the worst standing beyond `max_peers` goes."""
        peer.proven = True
        self._trim()
        self.changed.set()

    def _evict(self, worst: Peer, why: str) -> None:
        del self.peers[worst.url]
        log.info("evicted peer %s (failures %d, strikes %d) for %s", worst.url, worst.failures,
                 worst.strikes, why)

    def _trim(self) -> None:
        """Drop the ordinary peers (neither bootstrap nor anchor) in the worst standing beyond
        `max_peers`: unproven and failing ones first (Peer.rank)."""
        if len(self.peers) <= self.max_peers:
            return
        anchors = self.anchors()
        over = len(self.peers) - len(anchors) - self.max_peers
        if over <= 0:
            return
        ordinary = sorted((p for p in self.peers.values() if not p.bootstrap
                           and p.url not in anchors), key=Peer.rank)
        for p in ordinary[:over]:
            self._evict(p, "a smaller book")

    # --- anchors ----------------------------------------------------------------------------
    def _anchor_key(self, p: Peer, now: float | None = None) -> tuple[str | None, str] | None:
        """(its group: its region, or None for the trainers; its election rank) of a peer
        that may hold an anchor place, else None: its region and name known, not banned,
        not failing."""
        region, role = self.where(p)
        if (region is None or p.node is None or p.banned(now)
                or p.failures >= ANCHOR_DEAD_AFTER):
            return None
        return (None if role == "trainer" else region), p.order(region, p.node)

    def anchors(self) -> set[str]:
        """URLs of the book's anchors. In each group (the trainers, each region) the trusted
        peers that rank first: MAX_TRAINER_ANCHORS trainers, ANCHORS_PER_REGION members;
        then, as candidates beside them, unproven peers that rank before the group's last
        trusted anchor (or while it has places left), at most as many as the group has places
        and MAX_UNPROVEN_ANCHORS in all, those of groups with a trusted member first. At most
        MAX_ANCHORS in all: trusted before unproven, the trainers first, then the regions by
        name."""
        now = time.monotonic()
        groups: dict[str | None, list[tuple[str, str]]] = {}
        for p in self.peers.values():
            if (key := self._anchor_key(p, now)) is not None:
                groups.setdefault(key[0], []).append((key[1], p.url))
        trusted: list[str] = []
        candidates: list[tuple[bool, str]] = []
        for group in sorted(groups, key=lambda g: (g is not None, g or "")):
            places = MAX_TRAINER_ANCHORS if group is None else ANCHORS_PER_REGION
            ranked = sorted(groups[group])
            held = [(r, url) for r, url in ranked if self.peers[url].trusted][:places]
            trusted.extend(url for _, url in held)
            last = held[-1][0] if len(held) == places else None
            # candidates of groups with a trusted member first: names of made-up regions,
            # however they sort, then cannot hold every candidate place against a real one
            candidates.extend((not held, url) for url in [
                url for r, url in ranked if not self.peers[url].trusted
                and (last is None or r < last)][:places])
        out = set(trusted[:MAX_ANCHORS])
        candidates.sort(key=lambda c: c[0])  # stable: group order within each kind
        for _, url in candidates[:MAX_UNPROVEN_ANCHORS]:
            if len(out) >= MAX_ANCHORS:
                break
            out.add(url)
        return out

    def _anchors_with(self, newcomer: Peer) -> set[str]:
        """`anchors()` of the book with `newcomer` (not stored yet, its announced region, role
        and name set) counted: the same rule, asked of the book with it."""
        if self._anchor_key(newcomer) is None:
            return self.anchors()
        self.peers[newcomer.url] = newcomer
        try:
            return self.anchors()
        finally:
            del self.peers[newcomer.url]

    def listing(self, for_region: str | None = None, limit: int = INDEX_PEERS) -> list[dict]:
        """The peers an index reply lists: trusted, unbanned and not failing, at most `limit`:
        the anchors of `for_region` (the asker's) first, then trainers and the anchors of
        their regions, then one anchor of each other region, then a random sample of the
        rest."""
        now = time.monotonic()
        live = [p for p in self.peers.values() if p.trusted and not p.banned(now)
                and p.failures < ANCHOR_DEAD_AFTER]
        anchors = self.anchors()
        trainer_regions = {self.where(p)[0] for p in live if self.where(p)[1] == "trainer"}

        def tier(p: Peer) -> int:
            region, role = self.where(p)
            if p.url not in anchors:
                return 4
            if for_region is not None and region == for_region:
                return 0
            return 1 if role == "trainer" or region in trainer_regions else 2

        random.shuffle(live)
        live.sort(key=tier)
        seen_regions: set[str | None] = set()
        first, rest = [], []
        for p in live:
            region = self.where(p)[0]
            if tier(p) < 2 or (tier(p) == 2 and region not in seen_regions):
                first.append(p)
                seen_regions.add(region)
            else:
                rest.append(p)
        chosen = (first + rest)[:limit]
        return [{"url": p.url, "bt": f"{p.bt[0]}:{p.bt[1]}" if p.bt else None, "node": p.node,
                 "region": p.region, "role": p.role} for p in chosen]

    def learn(self, url: str, bt: Endpoint | None = None, node: str | None = None,
              head: int | None = None, region: str | None = None,
              role: str | None = None) -> Peer | None:
        """Add or update a peer; None for this node itself. Raises BadPeer (BookFull)."""
        url = check_url(url)
        if url == self.self_url or (node is not None and node == self.node):
            return None
        if region is not None:
            check_node(region)
        if role is not None and role not in ROLES:
            raise BadPeer(f"role must be one of {ROLES}, got {role!r:.40}")
        peer = self.peers.get(url) or self._add(url, region=region, node=node, role=role)
        if peer.key is not None:
            # A keyed entry is updated only by its own signed requests and answers
            # (learn_signed, learn_own): a hint from anyone else cannot rewrite it.
            if head is not None:
                peer.head = head
            return peer
        if bt is not None and bt != self.self_bt:
            if peer.bt != bt:
                self.changed.set()
            peer.bt = bt
        if node is not None:
            peer.node = node
        if head is not None:
            peer.head = head
        self._learn_region(peer, region, role)
        peer.last_seen = time.time()
        return peer

    def _learn_region(self, peer: Peer, region: str | None, role: str | None) -> None:
        if region is not None:
            region = check_node(region)
            if peer.region != region:
                self.changed.set()
            peer.region = region
        if role is not None:
            peer.role = role

    def learn_header(self, value: str, region: str | None = None) -> Peer | None:
        """An announcement taken as a hint (it updates only entries no key owns yet); a full
        book ignores it. The control plane takes a request's own headers through
        `learn_signed` only."""
        url, bt, node = parse_header(value)
        where, role = parse_region(region) if region else (None, None)
        try:
            return self.learn(url, bt, node, region=where, role=role)
        except BookFull:
            return None

    def learn_signed(self, value: str, region: str | None, signer: str, key: str
                     ) -> Peer | None:
        """A signed request's own announcement (`X-Deltaswarm-Peer`, `X-Deltaswarm-Region`),
        `signer` its verified node name and `key`: it updates only the entry of the sender,
        i.e. the entry at its URL whose key is `key` (or a new one, keyed provisionally until
        the URL itself answers). None when refused (another key's entry, a full book, a
        trusted entry whose key only its own answer may set)."""
        url, bt, node = parse_header(value)
        where, role = parse_region(region) if region else (None, None)
        if node != signer:
            raise BadPeer(f"{HEADER} names node {node!r:.64} but the request is signed by "
                          f"{signer}")
        if url == self.self_url or node == self.node:
            return None
        peer = self.peers.get(url)
        if peer is not None and peer.key is None and peer.trusted:
            return None  # a trusted entry takes its key from its URL's own answer first
        if peer is not None and peer.key is not None and peer.key != key:
            self.refused_headers += 1
            self.last_refused_header = (f"{signer} ({key[:16]}…) announced {url}, whose entry "
                                        f"belongs to key {peer.key[:16]}…")[:300]
            return None
        if peer is None:
            try:
                peer = self._add(url, region=where, node=node, role=role)
            except BookFull:
                return None
            peer.key = key
        if bt is not None and bt != self.self_bt:
            if peer.bt != bt:
                self.changed.set()
            peer.bt = bt
        peer.node = node
        self._learn_region(peer, where, role)
        peer.last_seen = time.time()
        return peer

    def learn_own(self, url: str, node: str | None, key: str | None,
                  bt: Endpoint | None = None, head: int | None = None,
                  region: str | None = None, role: str | None = None) -> Peer | None:
        """What the daemon at `url` said of itself in its own answer (head reply, hello): its
        key binds the entry. A different key than the entry held (one a header claimed, or a
        re-keyed node) resets what that key's headers had set."""
        peer = self.peers.get(check_url(url))
        if peer is None:
            return None
        peer.identified = True
        if key is not None and node is not None and not self.pin(node, key, url):
            peer.last_error = f"answers as {node} with a key another node pinned that name to"
            return peer
        if key is not None:
            if peer.key != key and (peer.key is not None or peer.key_confirmed):
                log.warning("peer %s answers with key %s…, not %s…: its entry is reset", url,
                            key[:16], (peer.key or "")[:16])
                peer.bt, peer.region, peer.role = None, None, None
                self.changed.set()
            peer.key, peer.key_confirmed = key, True
        if bt is not None and bt != self.self_bt and (key is not None or peer.key is None):
            if peer.bt != bt:
                self.changed.set()
            peer.bt = bt
        if node is not None and (key is not None or peer.key is None):
            peer.node = node
        if key is not None or peer.key is None:
            self._learn_region(peer, region, role if role in ROLES else None)
        if head is not None:
            peer.head = head
        peer.last_seen = time.time()
        return peer

    # --- standing ---------------------------------------------------------------------------
    def succeeded(self, peer: Peer) -> None:
        peer.failures, peer.retry_at, peer.last_error = 0, 0.0, ""

    def failed(self, peer: Peer, err: Exception | str, since: float | None = None) -> None:
        """Back off and demote; a non-bootstrap peer failing BAN_FAILURES times in a row is
        banned. `since`: when the failed request started; a failure was already booked after
        that, so this one is the same episode (concurrent requests to one peer) and only its
        text is kept. The error text shown is ours (exception type and our message), never the
        peer's reply."""
        if since is not None and peer.failed_at >= since:
            peer.last_error = describe(err)
            return
        peer.failed_at = time.monotonic()
        peer.failures += 1
        peer.last_error = describe(err)
        backoff = min(BACKOFF_MAX_S, BACKOFF_MIN_S * 2 ** min(peer.failures - 1, 16))
        peer.retry_at = time.monotonic() + backoff * random.uniform(0.5, 1.0)
        if peer.failures >= BAN_FAILURES:
            self.ban(peer, f"{peer.failures} failures in a row, the last {peer.last_error}")

    def lacks(self, peer: Peer, err: Exception) -> None:
        """The peer answered that it does not hold what was asked: an honest answer, so no
        failure and no backoff (the caller asks someone else)."""
        peer.misses += 1
        log.debug("peer %s does not hold what was asked: %s", peer.url, describe(err))

    def lied(self, peer: Peer, why: str) -> None:
        """A claim of the peer (its head) was refuted: forget the claim and strike it."""
        peer.strikes += 1
        peer.head = None
        peer.last_error = why
        log.warning("peer %s: %s (strike %d)", peer.url, why, peer.strikes)
        if peer.strikes >= BAN_STRIKES:
            self.ban(peer, f"{peer.strikes} refuted claims")
        else:
            self.failed(peer, why)

    def ban(self, peer: Peer, why: str) -> None:
        if peer.bootstrap:
            return
        peer.banned_until = time.monotonic() + BAN_S
        peer.last_error = f"banned for {BAN_S:.0f}s: {why}"
        self.bans[peer.url] = peer.banned_until
        if len(self.bans) > 4 * self.max_peers + 64:
            now = time.monotonic()
            self.bans = {u: t for u, t in self.bans.items() if t > now}
        log.warning("peer %s banned for %.0fs: %s", peer.url, BAN_S, why)
        self.changed.set()

    # --- queries ----------------------------------------------------------------------------
    def bt_endpoints(self) -> list[Endpoint]:
        """Endpoints of trusted, unbanned peers (announced ones are dialled only once proven)."""
        now = time.monotonic()
        return [p.bt for p in self.peers.values()
                if p.bt is not None and p.trusted and not p.banned(now)]

    def swarm_endpoints(self) -> list[Endpoint]:
        """What the swarm dials: `bt_endpoints()` thinned by the region peering policy."""
        if self.peering is None:
            return self.bt_endpoints()
        return self.peering.endpoints(self)

    def claimed_head(self) -> int | None:
        """The newest head a trusted, unbanned peer claims: what sync tries to fetch."""
        now = time.monotonic()
        return max((p.head for p in self.peers.values()
                    if p.head is not None and p.trusted and not p.banned(now)), default=None)

    def by_head(self, version: int | None = None,
                holds: Callable[[str], bool] | None = None) -> list[Peer]:
        """Usable peers to ask for data: those known to hold it (`holds(url)`, e.g. from
        their index) first, then those claiming `version`, then by standing."""
        now = time.monotonic()

        def key(p: Peer) -> tuple:
            has = version is not None and p.head is not None and p.head >= version
            held = holds is not None and holds(p.url)
            return (not held, not has, p.strikes, p.failures, random.random())
        return sorted((p for p in self.peers.values() if p.usable(now)), key=key)

    def where(self, p: Peer) -> tuple[str | None, str | None]:
        """(region, role) of a peer: what it said of itself when the peering policy heard it
        first-hand (RegionPeering.where), else what it announced."""
        own = getattr(self.peering, "where", None)
        return own(p) if own is not None else (p.region, p.role)

    def sources(self, version: int) -> tuple[list[Peer], list[Peer]]:
        """Whom to ask for a version's manifests and torrent, in two rounds: first the peers
        other than the trainer that claim `version`, this node's region first; then every
        other usable peer (the trainer among them), as `by_head` orders them.

        Why: every node fetching each new manifest, index and torrent from the trainer costs
        it a copy per node (76 GB per version at 10,000 nodes and a 1 TB MoE, docs/SCALE.md);
        asked second, it serves the few nodes that hear of a version before anyone else."""
        ordered = self.by_head(version)
        where = self.where
        first = [p for p in ordered if p.head is not None and p.head >= version
                 and where(p)[1] != "trainer"]
        first.sort(key=lambda p: where(p)[0] != self.region)  # stable: by_head's order within
        chosen = {id(p) for p in first}
        return first, [p for p in ordered if id(p) not in chosen]

    def to_watch(self, limit: int) -> list[Peer]:
        """Trusted, unbanned peers in the best standing, at most `limit`."""
        now = time.monotonic()
        live = [p for p in self.peers.values() if p.trusted and not p.banned(now)]
        return sorted(live, key=Peer.rank, reverse=True)[:limit]

    def at_endpoint(self, endpoint: str) -> Peer | None:
        """The peer at a BitTorrent `ip:port` (a ban names one): the exact endpoint, else the
        only peer at that address (a connection it made may show another source port)."""
        ip = endpoint.rpartition(":")[0].strip("[]")
        exact = [p for p in self.peers.values() if p.bt and f"{p.bt[0]}:{p.bt[1]}" == endpoint]
        found = exact or [p for p in self.peers.values() if p.bt and p.bt[0] == ip]
        return found[0] if len(found) == 1 else None

    def snapshot(self) -> list[dict]:
        return [p.as_dict() for p in sorted(self.peers.values(), key=lambda p: p.url)]


def not_held(err: BaseException) -> bool:
    """Whether a failed request was a peer saying it does not hold what was asked."""
    return isinstance(err, PeerHttpError) and err.status in NOT_HELD


def describe(err: Exception | str) -> str:
    """Our own words for a failure: PeerError messages never quote a reply."""
    if isinstance(err, str):
        return err[:200]
    if isinstance(err, PeerError):
        return f"{type(err).__name__}: {err}"[:200]
    return type(err).__name__
