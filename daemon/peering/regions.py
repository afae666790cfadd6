"""Region-aware peering: which BitTorrent peers a daemon dials so that each piece crosses into a
region about once, nodes inside a region serve each other, and the trainer's uplink sends about
one copy.

Design (issue 14): every region elects `gateways` nodes (default one) by a hash of their names
among the region's live members; everyone computes the same election from the peer book
(regions and roles travel in X-Deltaswarm-Region and index entries). A daemon dials

- every trusted peer of its own region (the trainer too, when it lives here), and
- when it is one of its region's gateways: the gateways of every other region.

Nobody else dials across, and ut_pex is off (SwarmConfig.pex), so cross-region connections exist
only between gateways. The trainer is never a gateway while its region has another live node:
all data enters the swarm in the trainer's region, its gateway holds each piece before any other
region can, so other regions never send pieces back into it, and the trainer serves only its own
region (rotating unchokes, SEED_SETTINGS) instead of one copy per region. A region whose only
live node is the trainer is represented by the trainer itself.

Liveness: a member is live until DEAD_AFTER control-plane contacts in a row failed (head
long-polls fail at once on a kill -9 and the retry is refused a second or two later), so when a
gateway dies the next node by hash takes over and dials the other gateways, and they dial it
back when they see it; pieces the dead gateway fetched stay in the region (its neighbours hold
them). A one-node region is its own gateway. A region behind a slow link only slows its own
gateway: other gateways fetch from every gateway they are connected to. A peer whose region is
not known yet is dialled (blind), so an old daemon or a half-learned book costs bytes, never
liveness.

Cost: a transient double import when two nodes of a region briefly disagree on who is gateway
(views differ for a poll interval), and BitTorrent's end-game duplicates at the gateway. Choices
are settled (`_settle`): a gateway that is still electable keeps its place against a member that
is better by service until that member has ranked best for `deadline_s`, so a view that flips
for a second moves nobody.

Gateways earn their role (issue 20, finding 4: a token holder announcing a node of region eu
under a name that ranked first, with a BitTorrent endpoint that never sends, was elected by
both eu nodes, and every version reached eu only after a 15-17 s stall):

- Served data ranks first. The election key is (trainer, has not served, rank): a member has
  served when it delivered at least MIN_SERVED payload bytes to this node (libtorrent's own
  per-connection counts, summed over connections as they come and go: `Service`), and this
  node has served when it sent that much to a peer of its region. A name chosen to rank first
  only orders members that never served anything (a fleet's first version), never a node that
  did; and a region's first version costs a name-chooser one deadline, below.
- A silent gateway is passed over. A node whose region's gateway is another node, while it
  downloads an artifact a live peer lists as held, and that receives less than MIN_SERVED
  payload bytes from anyone in `deadline_s` (seconds; far below the 20 s stall timeout; a
  trickle does not hold the deadline off), demotes that gateway: for
  `demote_s` (doubling on each repeat, at most an hour) it is not electable in this node's view,
  so the next member by the key, or this node itself, fetches across regions meanwhile.
  Status (`region_peering`) lists the elected gateways, this region's candidates and the
  demoted gateways with reason and since; /metrics counts demotions.
- A region is what a peer says of itself. The region and role a peer's own index gives (read
  from its URL: `heard`) win over what headers and third-party index entries say, so rewriting
  a gateway's region in one node's book (finding 4's second part) no longer makes that node
  elect itself and pull data across regions.
- No cycles: a node electing another means that one served it, so it counts itself as served
  too; along "X elects Y" the key strictly falls, so every chain ends at a node that elects
  itself and dials across. Views still differ for a while (each counts service first-hand),
  which costs a transient double import, never liveness (a starving node demotes).
"""

import asyncio
import contextlib
import logging
import random
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from daemon.peering.names import BadName, Endpoint, check_node, parse_endpoint, rank
from daemon.peering.peer_client import PeerError
from daemon.peering.peers import INDEX_PEERS

if TYPE_CHECKING:
    from daemon.bittorrent.swarm import Swarm
    from daemon.peering.peer_client import PeerClient
    from daemon.peering.peers import Peer, PeerBook

log = logging.getLogger("deltaswarm.regions")

MODES = ("aware", "blind")
DEAD_AFTER = 2
"""Failed control-plane contacts in a row after which a member no longer counts in elections: a
killed daemon refuses the retry a second later, while one slow reply (a loaded host, a node still
starting) does not move a region's gateway."""


MIN_SERVED = 16 * 1024
"""Payload bytes (one BitTorrent block) a member must have delivered to count as serving."""
WATCH_S = 0.5
"""How often the swarm's per-connection counters are read (`watch`)."""
MAX_DEMOTE_S = 3600.0
MAX_OWN = 1024
"""First-hand regions are pruned to the book's peers once past 4x this many."""


class Service:
    """Payload bytes each peer delivered to this node and took from it, summed per peer (control
    URL) over the connections libtorrent reports as they come and go, and what this node
    received from anyone lately."""

    def __init__(self) -> None:
        self.delivered: Counter[str] = Counter()
        """peer url → payload bytes received from it."""
        self.taken: Counter[str] = Counter()
        """peer url → payload bytes sent to it."""
        self.received: deque[tuple[float, int]] = deque(maxlen=4096)
        """(monotonic time, payload bytes received from anyone) per reading that got some."""
        self._last: dict[tuple[str, str], tuple[int, int]] = {}

    def update(self, book: "PeerBook", conns: list[tuple[str, str, int, int]],
               now: float) -> None:
        """Take one reading of `Swarm.peer_bytes()`; a connection's counters only grow, so a
        drop means a new connection on that key (counted from zero)."""
        exact: dict[str, list[str]] = {}
        by_ip: dict[str, list[str]] = {}
        for p in book.peers.values():
            if p.bt:
                exact.setdefault(f"{p.bt[0]}:{p.bt[1]}", []).append(p.url)
                by_ip.setdefault(p.bt[0], []).append(p.url)
        seen: dict[tuple[str, str], tuple[int, int]] = {}
        got = 0
        for artifact, endpoint, down, up in conns:
            key = (artifact, endpoint)
            last_down, last_up = self._last.get(key, (0, 0))
            d_down = down - last_down if down >= last_down else down
            d_up = up - last_up if up >= last_up else up
            seen[key] = (down, up)
            got += d_down
            # the peer at that exact endpoint, else the only one at that address; bytes from
            # an endpoint two entries claim are credited to neither (a copied endpoint earns
            # nothing)
            urls = (exact.get(endpoint.replace("[", "").replace("]", ""))
                    or by_ip.get(endpoint.rpartition(":")[0].strip("[]"), []))
            url = urls[0] if len(urls) == 1 else None
            if url is not None:
                self.delivered[url] += d_down
                self.taken[url] += d_up
        self._last = seen
        if got > 0:
            self.received.append((now, got))

    def received_since(self, t: float) -> int:
        """Payload bytes received from anyone after monotonic time `t`."""
        return sum(n for at, n in self.received if at > t)


@dataclass
class Member:
    url: str | None
    """None for this node itself."""
    node: str
    region: str
    trainer: bool
    served: bool
    rank: str

    def key(self) -> tuple:
        return (self.trainer, not self.served, self.rank)


@dataclass
class RegionPeering:
    mode: str = "aware"
    gateways: int = 1
    deadline_s: float = 5.0
    """A gateway that lets this node receive nothing for this long while it downloads
    something a peer holds is demoted (passed over)."""
    demote_s: float = 120.0
    """How long a demoted gateway stays passed over (doubling on each repeat)."""
    last: dict = field(default_factory=dict)
    """What the last `endpoints` call chose (for status)."""
    service: Service = field(default_factory=Service)
    own: dict = field(default_factory=dict)
    """peer url → (region, role) as the peer's own index said (`heard`)."""
    demoted: dict = field(default_factory=dict)
    """peer url → {node, reason, since, until (monotonic), count}."""
    demotions: int = 0
    book: "PeerBook | None" = None
    _gateway_set: frozenset = frozenset()
    _gateway_since: float = 0.0
    _want_since: float | None = None
    _held: dict = field(default_factory=dict)
    """region → node names of its gateways as last chosen (`_settle`)."""
    _challenger: dict = field(default_factory=dict)
    """region → (node names that rank best now, since when: monotonic)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"region peering mode must be one of {MODES}, got {self.mode!r}")
        if self.gateways < 1:
            raise ValueError(f"gateways per region must be >= 1, got {self.gateways}")
        if not self.deadline_s > 0 or not self.demote_s > 0:
            raise ValueError(f"gateway deadline_s and demote_s must be > 0, got "
                             f"{self.deadline_s}, {self.demote_s}")

    # --- what peers say of themselves -------------------------------------------------------
    def heard(self, url: str, region: object, role: object) -> None:
        """The region and role a peer's own index gave (read from its URL): first-hand."""
        with contextlib.suppress(BadName, TypeError):
            where = check_node(region) if region is not None else None
            self.own[url] = (where, role if role in ("trainer", "region") else None)
        if len(self.own) > 4 * MAX_OWN and self.book is not None:
            self.own = {u: v for u, v in self.own.items() if u in self.book.peers}

    def where(self, p: "Peer") -> tuple[str | None, str | None]:
        region, role = self.own.get(p.url, (None, None))
        return (region if region is not None else p.region, role if role is not None else p.role)

    # --- the election -----------------------------------------------------------------------
    def members(self, book: "PeerBook", now: float | None = None) -> list[Member]:
        """Electable members of every region in this node's view: trusted, unbanned, live,
        not demoted; this node itself (unless it is the trainer)."""
        now = time.monotonic() if now is None else now
        allowed = set(book.bt_endpoints())
        out = []
        served_region = 0
        for p in book.peers.values():
            region, role = self.where(p)
            if region == book.region and region is not None:
                served_region += self.service.taken[p.url]
            if (p.bt is None or p.bt not in allowed or p.failures >= DEAD_AFTER
                    or p.node is None or region is None or self.is_demoted(p.url, now)):
                continue
            out.append(Member(p.url, p.node, region, role == "trainer",
                              self.service.delivered[p.url] >= MIN_SERVED, rank(region, p.node)))
        if book.region is not None and book.role != "trainer":
            out.append(Member(None, book.node, book.region, False, served_region >= MIN_SERVED,
                              rank(book.region, book.node)))
        return out

    def elect(self, book: "PeerBook", now: float | None = None) -> dict[str, list[Member]]:
        """region → its elected gateways (at most `gateways`), best first, settled: a region's
        gateways change at once when one of them is no longer electable (dead, demoted, gone,
        or a trainer once another member is live), else only after the new choice has been
        best for `deadline_s` (`_settle`)."""
        now = time.monotonic() if now is None else now
        by_region: dict[str, list[Member]] = {}
        for m in self.members(book, now):
            by_region.setdefault(m.region, []).append(m)
        out = {}
        for region, ms in by_region.items():
            ms.sort(key=Member.key)
            pool = [m for m in ms if not m.trainer] or ms
            out[region] = self._settle(region, pool, now)
        return out

    def _settle(self, region: str, pool: list[Member], now: float) -> list[Member]:
        """Hold a region's gateways against a better-ranked challenger for `deadline_s`.

        Why: "served" is first-hand, so in the first second of a version the members of the
        trainer's region each see themselves as served (they passed the trainer's pieces on)
        before the gateway has served them; each then briefly elected itself, dialled the other
        regions' gateways and pulled pieces back in that its region already had (measured:
        0.03-0.13x the artifact imported into the trainer's region, where 0 is right). Holding
        the choice absorbs the flip; a name-chooser that never serves still loses its place
        within one deadline (it is demoted, or the member that served takes over). Only a
        challenger that is better by service waits; one better by rank alone (a member this node
        just learned of, before anyone served) takes over at once, as every node's view does."""
        best = [m.node for m in pool[:self.gateways]]
        by_node = {m.node: m for m in pool}
        held = self._held.get(region)
        if (held is None or held == best or any(n not in by_node for n in held)
                or [by_node[n].served for n in held] == [m.served for m in pool[:self.gateways]]):
            # new, gone, or better by rank alone (a member just learned): no flip to absorb
            self._held[region] = best
            self._challenger.pop(region, None)
            return pool[:self.gateways]
        challenger = self._challenger.get(region)
        if challenger is None or challenger[0] != best:
            challenger = self._challenger[region] = (best, now)
        if now - challenger[1] >= self.deadline_s:
            self._held[region] = best
            self._challenger.pop(region, None)
            return pool[:self.gateways]
        return [by_node[n] for n in held]

    def endpoints(self, book: "PeerBook") -> list[Endpoint]:
        self.book = book
        dialable = book.bt_endpoints()
        if self.mode == "blind" or book.region is None:
            self.last = {"mode": self.mode, "dialled": len(dialable)}
            return dialable
        allowed = set(dialable)
        elected = self.elect(book)
        chosen = {r: {m.node for m in ms} for r, ms in elected.items()}
        me_gateway = book.node in chosen.get(book.region, ())
        dial: list[Endpoint] = []
        for p in book.peers.values():
            if p.bt is None or p.bt not in allowed:
                continue
            region, _ = self.where(p)
            local = region is None or region == book.region
            if local or (me_gateway and p.node in chosen.get(region, ())):
                dial.append(p.bt)
        view = {r: sorted(n) for r, n in sorted(chosen.items())}
        if view != self.last.get("gateways") or me_gateway != self.last.get("gateway"):
            log.info("region %s: gateways %s (this node %s); dialling %d of %d peers",
                     book.region, view, "is one" if me_gateway else "is not", len(dial),
                     len(dialable))
        self.last = {"mode": self.mode, "region": book.region, "gateway": me_gateway,
                     "gateways": view, "dialled": len(dial), "known": len(dialable)}
        return dial

    def fetch_role(self, book: "PeerBook") -> str | None:
        """Who fetches a new version's manifest and torrent from where (daemon/versions/
        sync.py `ask_sparing_trainer`): "fleet" for the one member of the fleet that asks the
        trainer at once; "region" for the member of each other region that takes them from
        whichever other region holds them first; "member" for the rest, which take them from
        their own region. None with blind peering or no region.

        Each region's fetcher is its first member by hash rank among live, undemoted members,
        and the fleet's is the first of those (in the trainer's region when it has members:
        data enters the swarm there), so every view agrees without any exchange. Why not the
        elected gateway: "served" is first-hand, so views of the gateway differ for several
        versions at a time (each of them then asking the trainer). A member that ranks first
        and never serves costs the others `sync.region_wait_s` per version, and is struck
        when it claims a head it does not serve."""
        return self.fetchers(book)[0]

    def fetchers(self, book: "PeerBook") -> tuple[str | None, str | None]:
        """(this node's fetch role as `fetch_role` says, the URL of the node it hears the
        trainer through): a member hears it through its region's fetcher, a region's fetcher
        through the fleet's; the fleet's fetcher (and blind peering) hears the trainer itself
        (None). Long-polls of the trainer's head go that way (daemon/versions/sync.py
        `upstream`), so the trainer answers one node per version, not one per region."""
        if self.mode == "blind" or book.region is None:
            return None, None
        firsts: dict[str, Member] = {}
        trainer_regions = set()
        for m in self.members(book):
            if m.trainer:
                trainer_regions.add(m.region)
            elif m.region not in firsts or m.rank < firsts[m.region].rank:
                firsts[m.region] = m
        mine = firsts.get(book.region)
        if mine is not None and mine.url is not None:
            return "member", mine.url
        pool = [m for r, m in firsts.items() if r in trainer_regions] or list(firsts.values())
        fleet = min(pool, key=lambda m: m.rank) if pool else None
        if fleet is None or fleet.url is None:
            return "fleet", None
        return "region", fleet.url

    # --- demotion ---------------------------------------------------------------------------
    def is_demoted(self, url: str, now: float) -> bool:
        d = self.demoted.get(url)
        return d is not None and d["until"] > now

    def demote(self, url: str, node: str, reason: str, now: float) -> None:
        prev = self.demoted.get(url, {"count": 0})
        count = prev["count"] + 1
        hold = min(MAX_DEMOTE_S, self.demote_s * 2 ** min(count - 1, 16))
        self.demoted[url] = {"node": node, "reason": reason, "since": round(time.time(), 3),
                             "until": now + hold, "count": count}
        self.demotions += 1
        log.warning("gateway %s (%s) demoted for %.0fs: %s; fetching across regions "
                    "meanwhile if this node is next", node, url, hold, reason)
        if self.book is not None:
            self.book.changed.set()

    def tick(self, book: "PeerBook", conns: list[tuple[str, str, int, int]], wanting: bool,
             now: float | None = None) -> None:
        """One reading of the swarm (`conns`: `Swarm.peer_bytes()`); `wanting`: this node is
        downloading something a live peer lists as held. Demotes this region's gateway when,
        after `deadline_s` of wanting while it was gateway, less than MIN_SERVED payload bytes
        arrived (from anyone) in the last `deadline_s`."""
        now = time.monotonic() if now is None else now
        self.book = book
        self.service.update(book, conns, now)
        if self.mode == "blind" or book.region is None:
            return
        elected = self.elect(book, now).get(book.region, [])
        mine = [] if any(m.url is None for m in elected) else elected
        gw = frozenset(m.url for m in mine)
        if gw != self._gateway_set:
            self._gateway_set, self._gateway_since = gw, now
        if not wanting or not mine:
            self._want_since = None
            return
        if self._want_since is None:
            self._want_since = now
        if now - max(self._want_since, self._gateway_since) < self.deadline_s:
            return
        got = self.service.received_since(now - self.deadline_s)
        if got >= MIN_SERVED:
            return
        for m in mine:
            assert m.url is not None
            self.demote(m.url, m.node, f"{got} payload bytes received in the last "
                                       f"{self.deadline_s:g}s while downloading what a live "
                                       "peer holds", now)
        self._gateway_set, self._gateway_since = frozenset(), now

    async def watch(self, book: "PeerBook", swarm: "Callable[[], Swarm | None]",
                    wanting: Callable[[], bool]) -> None:
        """Read the swarm's per-connection counters every WATCH_S (`tick`)."""
        while True:
            s = swarm()
            if s is not None:
                try:
                    conns = s.peer_bytes()
                except Exception as e:  # a closing swarm: try again next round
                    log.debug("reading peer bytes: %s", e)
                    conns = []
                try:
                    self.tick(book, conns, wanting())
                except Exception:  # a bug here must not stop the daemon; the log says it
                    log.exception("gateway watch")
            await asyncio.sleep(WATCH_S)

    # --- status -----------------------------------------------------------------------------
    def status(self) -> dict:
        out = {"mode": self.mode, "gateways_per_region": self.gateways, **self.last,
               "deadline_s": self.deadline_s, "demote_s": self.demote_s,
               "demotions": self.demotions}
        now = time.monotonic()
        out["demoted"] = [{"url": url, "node": d["node"], "reason": d["reason"],
                           "since": d["since"], "count": d["count"],
                           "active": d["until"] > now,
                           "left_s": round(max(0.0, d["until"] - now), 1)}
                          for url, d in sorted(self.demoted.items())]
        book = self.book
        if book is not None:
            out["anchors"] = len(book.anchors())
        if book is None or self.mode == "blind" or book.region is None:
            return out
        elected = self.elect(book, now)
        mine = elected.get(book.region, [])
        out["gateway"] = any(m.url is None for m in mine)
        out["gateways"] = {r: sorted(m.node for m in ms) for r, ms in sorted(elected.items())}
        role, via = self.fetchers(book)
        out["fetch_role"], out["hears_trainer_via"] = role, via
        out["candidates"] = [
            {"node": m.node, "served": m.served, "trainer": m.trainer,
             "delivered_bytes": (self.service.delivered[m.url] if m.url is not None else None)}
            for m in sorted((m for m in self.members(book, now) if m.region == book.region),
                            key=Member.key)]
        return out

    def collect(self) -> Iterator[Metric]:
        """/metrics series (no peer names: /metrics is open)."""
        yield CounterMetricFamily("deltaswarm_gateway_demotions",
                                  "Gateways of this node's region it passed over for "
                                  "delivering nothing", value=self.demotions)
        now = time.monotonic()
        yield GaugeMetricFamily("deltaswarm_gateways_demoted",
                                "Gateways passed over now", value=sum(
                                    d["until"] > now for d in self.demoted.values()))
        yield GaugeMetricFamily("deltaswarm_gateway",
                                "1 if this node fetches across regions for its region",
                                value=int(bool(self.status().get("gateway"))))


def learn_index(book: "PeerBook", peer: "Peer", index: dict) -> int:
    """Learn what a peer's /v1/chain/index says of itself and of the peers it trusts (with their
    regions and roles); malformed entries are skipped. Returns how many entries were taken."""
    taken = 0
    with contextlib.suppress(BadName):
        book.learn(peer.url, region=index.get("region"), role=index.get("role"))
    heard_from(book, peer.url, index)
    listed = index.get("peers")
    for p in (listed if isinstance(listed, list) else [])[:INDEX_PEERS]:
        if not isinstance(p, dict):
            continue
        with contextlib.suppress(BadName, TypeError, KeyError):
            bt = parse_endpoint(p["bt"]) if p.get("bt") else None
            node = check_node(p["node"]) if p.get("node") is not None else None
            book.learn(p.get("url"), bt, node, region=p.get("region"), role=p.get("role"))
            taken += 1
    return taken


def heard_from(book: "PeerBook", url: str, index: dict) -> None:
    """Record the region and role the peer at `url` gave in its own index (first-hand)."""
    if isinstance(book.peering, RegionPeering) and isinstance(index, dict):
        book.peering.heard(url, index.get("region"), index.get("role"))


async def discover_loop(book: "PeerBook", client: "PeerClient", fast_s: float = 2.0,
                        slow_s: float = 30.0, fast_for_s: float = 60.0) -> None:
    """Read one trusted peer's index (a random one: the load spreads over the fleet) every
    `fast_s` for the first `fast_for_s`, then every `slow_s`. Without it a region node learns the
    fleet only when it syncs its first version, so the first transfer would run with half-known
    regions and every node electing itself gateway."""
    t0 = time.monotonic()
    while True:
        now = time.monotonic()
        peers = [p for p in book.peers.values() if p.usable(now)]
        # the trainer only while nobody else can answer or until its own region, role and
        # endpoint are known: every node reading its index (whose peer list grows with the
        # fleet) would grow its load with the fleet
        peers = [p for p in peers if book.where(p)[1] != "trainer" or book.where(p)[0] is None
                 or p.bt is None] or peers
        if peers:
            peer = random.choice(peers)
            try:
                index = await client.get_json(f"{peer.url}/v1/chain/index", "index", timeout=10)
                learn_index(book, peer, index)
                book.succeeded(peer)
            except PeerError as e:
                book.failed(peer, e)
                log.debug("index of %s: %s", peer.url, e)
        await asyncio.sleep(fast_s if time.monotonic() - t0 < fast_for_s else slow_s)


def link_bytes(book: "PeerBook", swarm_status: dict) -> dict[str, dict[str, int]]:
    """Payload bytes on this node's current swarm connections by link class: `local` (a peer of
    this node's region), `cross` (another region), `unknown` (region not known yet), each
    `up`/`down`. Connections are matched to peers by IP address (incoming ones come from
    ephemeral ports); torrents already removed are not counted."""
    peering = book.peering if isinstance(book.peering, RegionPeering) else RegionPeering()
    region_of = {p.bt[0]: peering.where(p)[0] for p in book.peers.values() if p.bt is not None}
    out = {c: {"up": 0, "down": 0} for c in ("local", "cross", "unknown")}
    for t in (swarm_status.get("torrents") or {}).values():
        for pi in t.get("peer_list") or []:
            region = region_of.get(pi["peer"].rpartition(":")[0].strip("[]"))
            cls = "unknown" if region is None else "local" if region == book.region else "cross"
            out[cls]["up"] += int(pi["uploaded"])
            out[cls]["down"] += int(pi["downloaded"])
    return out


def wanting(syncer: object, swarm: "Swarm | None", book: "PeerBook") -> bool:
    """Whether `syncer` (a region's `daemon.versions.sync.Syncer`; None on the trainer) is
    downloading an
    artifact that a live peer's fresh index lists as held, past libtorrent's file check: only
    then does a silent gateway count against its deadline (a version nobody live holds, e.g.
    while the trainer restarts, demotes no one)."""
    if syncer is None or swarm is None:
        return False
    now = time.monotonic()

    def live(url: str) -> bool:
        p = book.peers.get(url)
        return p is not None and p.failures < DEAD_AFTER and not p.banned(now)

    holders = getattr(syncer, "holders", None)
    local = set(swarm.complete())
    for artifact in list(getattr(syncer, "downloads", {})):
        if artifact in local or holders is None or not holders.holding(artifact, live):
            continue
        with contextlib.suppress(Exception):  # left the swarm meanwhile: not wanted
            p = swarm.progress(artifact)
            if not p.finished and "checking" not in p.state:
                return True
    return False


class GatewayMetrics:
    """Registers `RegionPeering.collect` in a prometheus registry (a dataclass is unhashable)."""

    def __init__(self, peering: RegionPeering) -> None:
        self.peering = peering

    def collect(self) -> Iterator[Metric]:
        return self.peering.collect()
