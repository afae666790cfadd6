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
(views differ for a poll interval), and BitTorrent's end-game duplicates at the gateway.
"""

import asyncio
import contextlib
import hashlib
import logging
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from daemon.names import BadName, Endpoint, check_node, parse_endpoint
from daemon.peer_client import PeerError

if TYPE_CHECKING:
    from daemon.peer_client import PeerClient
    from daemon.peers import Peer, PeerBook

log = logging.getLogger("deltaswarm.regions")

MODES = ("aware", "blind")
DEAD_AFTER = 2
"""Failed control-plane contacts in a row after which a member no longer counts in elections: a
killed daemon refuses the retry a second later, while one slow reply (a loaded host, a node still
starting) does not move a region's gateway."""


def rank(region: str, node: str) -> str:
    """Election order inside a region: the same on every daemon (not Python's salted hash)."""
    return hashlib.sha256(f"{region}/{node}".encode()).hexdigest()


@dataclass
class RegionPeering:
    mode: str = "aware"
    gateways: int = 1
    last: dict = field(default_factory=dict)
    """What the last `endpoints` call chose (for status)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"region peering mode must be one of {MODES}, got {self.mode!r}")
        if self.gateways < 1:
            raise ValueError(f"gateways per region must be >= 1, got {self.gateways}")

    def endpoints(self, book: "PeerBook") -> list[Endpoint]:
        dialable = book.bt_endpoints()
        if self.mode == "blind" or book.region is None:
            self.last = {"mode": self.mode, "dialled": len(dialable)}
            return dialable
        allowed = set(dialable)
        live = [p for p in book.peers.values() if p.bt in allowed and p.failures < DEAD_AFTER]
        chosen = gateways_by_region(book, live, self.gateways)
        me_gateway = book.node in chosen.get(book.region, ())
        dial: list[Endpoint] = []
        for p in book.peers.values():
            if p.bt is None or p.bt not in allowed:
                continue
            local = p.region is None or p.region == book.region
            if local or (me_gateway and p.node in chosen.get(p.region, ())):
                dial.append(p.bt)
        view = {r: sorted(n) for r, n in sorted(chosen.items())}
        if view != self.last.get("gateways") or me_gateway != self.last.get("gateway"):
            log.info("region %s: gateways %s (this node %s); dialling %d of %d peers",
                     book.region, view, "is one" if me_gateway else "is not", len(dial),
                     len(dialable))
        self.last = {"mode": self.mode, "region": book.region, "gateway": me_gateway,
                     "gateways": {r: sorted(n) for r, n in sorted(chosen.items())},
                     "dialled": len(dial), "known": len(dialable)}
        return dial

    def status(self) -> dict:
        return {"mode": self.mode, "gateways_per_region": self.gateways, **self.last}


def gateways_by_region(book: "PeerBook", live: "list[Peer]", per_region: int
                       ) -> dict[str, set[str]]:
    """region → the node names elected as its gateways, this node included in its own region.
    Non-trainer members by rank first; a trainer only fills a region with no other member."""
    members: dict[str, list[tuple[bool, str, str]]] = {}
    for p in live:
        if p.region is not None and p.node is not None:
            members.setdefault(p.region, []).append((p.role == "trainer", rank(p.region, p.node),
                                                     p.node))
    if book.region is not None and book.role != "trainer":
        members.setdefault(book.region, []).append((False, rank(book.region, book.node),
                                                    book.node))
    out = {}
    for region, m in members.items():
        others = sorted((rk, n) for trainer, rk, n in m if not trainer)
        out[region] = ({n for _, n in others[:per_region]}
                       or {n for trainer, _, n in m if trainer})
    return out


def learn_index(book: "PeerBook", peer: "Peer", index: dict) -> int:
    """Learn what a peer's /v1/chain/index says of itself and of the peers it trusts (with their
    regions and roles); malformed entries are skipped. Returns how many entries were taken."""
    taken = 0
    with contextlib.suppress(BadName):
        book.learn(peer.url, region=index.get("region"), role=index.get("role"))
    listed = index.get("peers")
    for p in (listed if isinstance(listed, list) else [])[:book.max_peers]:
        if not isinstance(p, dict):
            continue
        with contextlib.suppress(BadName, TypeError, KeyError):
            bt = parse_endpoint(p["bt"]) if p.get("bt") else None
            node = check_node(p["node"]) if p.get("node") is not None else None
            book.learn(p.get("url"), bt, node, region=p.get("region"), role=p.get("role"))
            taken += 1
    return taken


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
    region_of = {p.bt[0]: p.region for p in book.peers.values() if p.bt is not None}
    out = {c: {"up": 0, "down": 0} for c in ("local", "cross", "unknown")}
    for t in (swarm_status.get("torrents") or {}).values():
        for pi in t.get("peer_list") or []:
            region = region_of.get(pi["peer"].rpartition(":")[0].strip("[]"))
            cls = "unknown" if region is None else "local" if region == book.region else "cross"
            out[cls]["up"] += int(pi["uploaded"])
            out[cls]["down"] += int(pi["downloaded"])
    return out
